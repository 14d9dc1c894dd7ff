"""Callbacks on many ranks: which run where, and which model object they see.

Logs handed to callbacks are already global (metric states are reduced inside every train/test
step), so a callback running on every rank takes the same decisions everywhere (EarlyStopping,
ReduceLROnPlateau, ...). Callbacks that only write (checkpoints, progress bars, CSV, TensorBoard)
run on the master rank. Where steps defer their updates, :class:`ApplyPending` applies the
pending one before callbacks that read the weights.
"""

from __future__ import annotations

import os
from typing import Any

import keras

from tnt_notebook import settings
from tnt_notebook.rank import api as ranks
from tnt_notebook.rank import progress_publisher as progress

#: Keras callbacks whose only effect is output: they run on the master rank only.
MASTER_ONLY: tuple[type, ...] = (
    keras.callbacks.ModelCheckpoint,
    keras.callbacks.ProgbarLogger,
    keras.callbacks.CSVLogger,
    keras.callbacks.TensorBoard,
    keras.callbacks.RemoteMonitor,
)


class Callback(keras.callbacks.Callback):
    """Tarantella's wrapper: ``Callback(callback, aggregate_logs=True, run_on_all_ranks=True)``.

    ``run_on_all_ranks=False`` runs the wrapped callback on the master rank only. ``aggregate_logs``
    is accepted for Tarantella compatibility; logs are always global here (metrics are aggregated
    over ranks weighted by sample count inside each step), so both values give the serial logs.
    A callback on every rank sees the :class:`~tnt_notebook.keras.model.Model` as ``self.model``
    (so its ``self.model.save(...)`` writes once, collectively); one on the master rank alone
    sees the plain Keras model (no collectives, which the other ranks would never join).
    """

    def __init__(
        self,
        callback: keras.callbacks.Callback,
        aggregate_logs: bool = True,
        run_on_all_ranks: bool = True,
    ):
        super().__init__()
        if isinstance(callback, Callback):
            callback = callback.callback
        self.callback = callback
        self.aggregate_logs = aggregate_logs
        self.run_on_all_ranks = run_on_all_ranks
        for attr in ("_supports_tf_logs", "async_safe"):
            if hasattr(callback, attr):
                setattr(self, attr, getattr(callback, attr))

    @property
    def active(self) -> bool:
        return self.run_on_all_ranks or ranks.is_master_rank()

    def set_params(self, params):
        super().set_params(params)
        self.callback.set_params(params)

    def set_model(self, model):
        super().set_model(model)
        if not self.run_on_all_ranks and hasattr(model, "_tnt_plain"):
            model = model._tnt_plain()
        self.callback.set_model(model)


def _forward(name: str):
    def method(self, *args, **kwargs):
        if self.active:
            return getattr(self.callback, name)(*args, **kwargs)
        return None

    method.__name__ = name
    return method


for _name in (
    "on_batch_begin",
    "on_batch_end",
    "on_epoch_begin",
    "on_epoch_end",
    "on_train_batch_begin",
    "on_train_batch_end",
    "on_test_batch_begin",
    "on_test_batch_end",
    "on_predict_batch_begin",
    "on_predict_batch_end",
    "on_train_begin",
    "on_train_end",
    "on_test_begin",
    "on_test_end",
    "on_predict_begin",
    "on_predict_end",
):
    setattr(Callback, _name, _forward(_name))


def tensorboard_on_all_devices() -> bool:
    return settings.TENSORBOARD_ON_ALL_DEVICES.read()


def is_master_only(callback: Any) -> bool:
    if isinstance(callback, keras.callbacks.TensorBoard) and tensorboard_on_all_devices():
        return False
    return isinstance(callback, MASTER_ONLY)


def prepare(callbacks: list | None) -> list:
    """The callbacks this rank passes to Keras: output-only Keras callbacks on the master rank
    alone (seeing the plain Keras model; a ProgbarLogger as it is: Keras's progress bar),
    TensorBoard on every rank with its own log directory when asked, everything else as it is."""
    out = []
    for cb in callbacks or []:
        if isinstance(cb, keras.callbacks.ProgbarLogger):  # Keras's progress bar, seen as such by
            if ranks.is_master_rank():  # Keras (which then adds no bar of its own)
                out.append(cb)
        elif isinstance(cb, Callback):
            if cb.active:
                out.append(cb)
        elif is_master_only(cb):
            if ranks.is_master_rank():
                out.append(Callback(cb, run_on_all_ranks=False))
        else:
            if isinstance(cb, keras.callbacks.TensorBoard) and not getattr(
                cb, "_tnt_rank_dir", False
            ):  # on all devices: one log dir per rank
                cb.log_dir = os.path.join(cb.log_dir, f"rank_{ranks.get_rank()}")
                cb._log_write_dir = cb.log_dir
                cb._tnt_rank_dir = True
            out.append(cb)
    return out


def for_this_rank(
    callbacks: Any, verbose: Any, mode: str, prepared: Any, **params: Any
) -> tuple[list, Any]:
    """This rank's callbacks and verbosity; the master asks the progress module for a view of
    ``prepared`` (:class:`~tnt_notebook.keras.data.Prepared`)."""
    cbs = prepare(list(callbacks or []))
    if not ranks.is_master_rank() and not settings.OUTPUT_ON_ALL_DEVICES.read():
        return cbs, 0
    if verbose != 0:
        if params.get("steps") is None:
            params["steps"] = prepared.steps()
        shown = progress.progress_callback(
            mode,
            verbose,
            batch_size=prepared.global_batch_size,
            num_samples=prepared.num_samples,
            world_size=ranks.get_size(),
            **params,
        )
        if shown is not None:
            return [*cbs, shown], 0
    return cbs, verbose


class ApplyPending(keras.callbacks.Callback):
    """First among a fit's callbacks where steps defer their updates: applies the last step's
    update before callbacks that read weights run (at every batch's end where some callback hooks
    into batches, and at every epoch's end, after the validation, which applies it itself)."""

    def __init__(self, each_batch: bool):
        super().__init__()
        self.each_batch = each_batch

    def on_train_batch_end(self, batch, logs=None):
        if self.each_batch:
            self.model._tnt_apply_pending()

    def on_epoch_end(self, epoch, logs=None):
        self.model._tnt_apply_pending()

    def on_train_end(self, logs=None):
        self.model._tnt_apply_pending()


#: Keras callbacks whose hooks into batches read only the logs, never the weights.
_BATCH_LOGS_ONLY: tuple[type, ...] = (
    keras.callbacks.History,
    keras.callbacks.ProgbarLogger,
    keras.callbacks.CSVLogger,
    keras.callbacks.TensorBoard,
    keras.callbacks.TerminateOnNaN,
)
_BATCH_HOOKS = ("on_batch_begin", "on_batch_end", "on_train_batch_begin", "on_train_batch_end")


def may_read_weights_between_steps(callback: Any) -> bool:
    """Whether ``callback`` hooks into training batches in a way that may read the weights."""
    if isinstance(callback, Callback):  # (Tarantella's wrapper: what it wraps)
        callback = callback.callback
    if isinstance(callback, _BATCH_LOGS_ONLY):
        return False
    if isinstance(callback, keras.callbacks.ModelCheckpoint):
        return callback.save_freq != "epoch"
    declared = getattr(callback, "reads_weights_each_batch", None)
    if declared is not None:
        return bool(declared)
    base = keras.callbacks.Callback
    return any(
        name in vars(callback) or getattr(type(callback), name) is not getattr(base, name)
        for name in _BATCH_HOOKS
    )

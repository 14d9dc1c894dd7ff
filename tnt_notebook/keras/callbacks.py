"""Callbacks on many ranks: which run where, and which model object they see.

Logs handed to callbacks are already global (metric states are reduced inside every train/test
step), so a callback running on every rank takes the same decisions everywhere (EarlyStopping,
ReduceLROnPlateau, ...). Callbacks that only write (checkpoints, progress bars, CSV, TensorBoard)
run on the master rank.
"""

from __future__ import annotations

import os
from typing import Any

import keras

from tnt_notebook import settings
from tnt_notebook.rank import api as ranks

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

"""``tnt.Model``: Tarantella's data-parallel model, on Keras 3.

``tnt.Model(keras_model)`` returns a *view* of the Keras model (:mod:`view`): an object of a
subclass of both ``tnt.Model`` and the model's own class that shares the model's state. So a
``tnt.Model`` is a Keras model (``isinstance(m, keras.Model)``, every Keras attribute and utility
works), and nothing is copied. On more than one rank its ``train_step`` and ``test_step``
(:mod:`steps`) reduce gradients and metric states over all ranks; ``fit``, ``evaluate`` and
``predict`` first prepare the data (:mod:`data`) so that every rank processes its slice of each
global batch. See the README's "Keras wrapper" section for the decisions.
"""

from __future__ import annotations

import contextlib
import enum
import warnings
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tnt_notebook import settings
from tnt_notebook.keras import (
    allreduce_op,
    backup,
    compat,
    data,
    predictions,
    replicas,
    reproducible,
    saving,
    synchronized_moments,
    timeline_recorder,
    view,
)
from tnt_notebook.keras import callbacks as tnt_callbacks
from tnt_notebook.keras.compression import Compression
from tnt_notebook.keras.replicas import ReplicaDivergenceError
from tnt_notebook.keras.steps import Steps
from tnt_notebook.rank import api as ranks
from tnt_notebook.rank import progress_publisher as progress

__all__ = ["NO_YAML", "Model", "ParallelStrategy", "ReplicaDivergenceError", "Sequential"]


class ParallelStrategy(enum.Enum):
    """How a model is parallelized; only data parallelism exists (as in Tarantella's API)."""

    DATA = "data"


NO_YAML = (
    "Keras 3 removed YAML model configs (loading YAML could run arbitrary code): use "
    "model.to_json() and tnt.models.model_from_json(json_string) instead"
)


def _check_optimizer(optimizer: Any) -> None:
    name = optimizer.lower() if isinstance(optimizer, str) else None
    if isinstance(optimizer, compat.UNSUPPORTED_OPTIMIZERS) or name in (
        compat.UNSUPPORTED_OPTIMIZER_NAMES
    ):
        raise ValueError(
            "tnt.Model does not support the Ftrl optimizer "
            f"({optimizer!r}); use SGD, Adam, RMSprop, Adagrad, ..."
        )


def _chunks(wanted: bool | None, chunk_size: int | None) -> reproducible.Chunks | None:
    """``tnt.Model(reproducible=, chunk_size=)``: how the model cuts its global batches, None for
    the default mode (``reproducible`` None: ``TNT_REPRODUCIBLE``)."""
    if wanted is None:
        wanted = settings.REPRODUCIBLE.read()
    if not wanted:
        if chunk_size is not None:
            raise ValueError("chunk_size is the reproducible mode's: give reproducible=True too")
        return None
    return reproducible.Chunks(
        reproducible.DEFAULT_CHUNK_SIZE if chunk_size is None else chunk_size
    )


class Model(Steps, saving.SavesOnRanks, keras.Model):
    """Tarantella's ``tnt.Model(keras_model)``: trains ``keras_model`` data-parallel on all ranks.

    The result is a Keras model of ``keras_model``'s own class that shares its layers, weights
    and state (nothing is copied); train through it. ``tnt.Model(inputs, outputs)`` builds a
    functional model first, as ``keras.Model`` does. Batch sizes are global: every rank processes
    its slice of each batch, gradients and metrics are reduced over all ranks, and ``fit``,
    ``evaluate`` and ``predict`` return what serial Keras returns.

    ``compression=tnt.Compression.fp16`` (or ``bf16``) sends the gradients in 16 bits, for steps
    that wait on a slow link between hosts (see :mod:`tnt_notebook.keras.compression`).
    ``reproducible=True`` trains to the same bits on any number of ranks, in chunks of
    ``chunk_size`` samples (see :mod:`tnt_notebook.keras.reproducible`).
    """

    _tnt_base: type | None = None  # the Keras class of the wrapped model (set on views)
    parallel_strategy = ParallelStrategy.DATA

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls._tnt_base is not None:  # tnt.Sequential(layers), or Keras re-creating a view
            model = cls._tnt_base(*args, **kwargs)
            wrapped = view.view_of(model, cls)
            wrapped._tnt.keras_model = model
            return wrapped
        compression = chunks = None
        if args and isinstance(args[0], keras.Model):
            model, rest = args[0], list(args[1:])
            strategy = rest.pop(0) if rest else kwargs.pop("parallel_strategy", None)
            compression = kwargs.pop("compression", None)
            chunks = _chunks(kwargs.pop("reproducible", None), kwargs.pop("chunk_size", None))
            if rest or kwargs:
                raise TypeError(
                    "tnt.Model(model, parallel_strategy=ParallelStrategy.DATA, compression=None, "
                    f"reproducible=None, chunk_size=None) takes no other arguments, got "
                    f"{[*rest, *kwargs]}"
                )
            if ParallelStrategy(strategy or ParallelStrategy.DATA) is not ParallelStrategy.DATA:
                raise NotImplementedError("only ParallelStrategy.DATA is supported")
            if compression is not None:
                compression = Compression.of(compression)
        elif compat.functional_arguments(args, kwargs):
            model = keras.Model(*args, **kwargs)
        else:
            got = type(args[0]).__name__ if args else "nothing"
            raise TypeError(f"tnt.Model wraps a keras.Model: tnt.Model(keras_model), got {got}")
        if isinstance(model, Model):
            wrapped = model
        else:
            wrapped = view.view_of(model, view.view_class(Model, type(model)))
        if wrapped._tnt.keras_model is None:
            wrapped._tnt.keras_model = model
        cut = chunks if chunks is not None else wrapped._tnt.reproducible
        if cut is not None and (compression or wrapped._tnt.compression) is not Compression.none:
            raise ValueError(
                "tnt.Model(reproducible=True) sends gradients as exact integers: it takes no "
                f"compression, got {compression or wrapped._tnt.compression}"
            )
        changed = False
        if compression is not None and compression is not wrapped._tnt.compression:
            wrapped._tnt.compression, changed = compression, True
        if chunks is not None and chunks != wrapped._tnt.reproducible:
            reproducible.check_model(wrapped)
            wrapped._tnt.reproducible, changed = chunks, True
        if not changed and wrapped is model:
            return wrapped
        if getattr(wrapped, "compiled", False):  # (its steps are traced again, with ours)
            wrapped._tnt_after_compile()
        return wrapped

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: ``__new__`` made this object a view of an existing Keras model."""

    @property
    def _tnt(self) -> view.State:
        return view.state_of(self)

    def _tnt_chunk(self) -> int:
        """Samples per chunk of the reproducible mode (1: the default mode's any cut)."""
        return 1 if self._tnt.reproducible is None else self._tnt.reproducible.size

    def _tnt_plain(self) -> keras.Model:
        """The wrapped model as plain Keras: for serializing, and for the callbacks that run on
        the master rank alone (whose saves must not be collective)."""
        return view.plain(self)

    @property
    def model(self) -> keras.Model:
        """Tarantella's ``tnt_model.model``: the wrapped Keras model itself (it shares every
        weight and setting with this one; training it directly is serial). A ``model`` attribute
        of the wrapped model's own comes first."""
        own = self.__dict__.get("model")
        return own if own is not None else self._tnt.keras_model

    @model.setter
    def model(self, value: Any) -> None:
        keras.Model.__setattr__(self, "model", value)

    def __repr__(self) -> str:
        return f"<tnt.Model {type(self).__name__} {self.name!r} on {ranks.get_size()} rank(s)>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self._tnt.in_step and compat.gradient_tape_active():
            raise NotImplementedError(
                "tnt.Model under a tf.GradientTape of your own (a custom training loop): its "
                "gradients would not be reduced across ranks. Use tnt.Model.fit (a train_step of "
                "the model's own works too), or train the Keras model in your loop with "
                "optimizer = tnt.distributed_optimizer(optimizer)."
            )
        return super().__call__(*args, **kwargs)

    def train_on_batch(
        self, x: Any, y: Any = None, sample_weight: Any = None, class_weight: Any = None,
        return_dict: bool = False,
    ) -> Any:  # fmt: skip
        """Keras's train_on_batch on a global batch: each rank trains on its slice of it (every
        rank passes the same batch), and the update is serial Keras's."""
        self._tnt_begin_on_batch("train_on_batch", x, y, sample_weight)
        self._tnt_slice_in_steps(train=True)
        with allreduce_op.collective_call("train_on_batch"):
            logs = super().train_on_batch(x, y, sample_weight, class_weight, return_dict)
        self._tnt_apply_pending()
        return logs

    def test_on_batch(
        self, x: Any, y: Any = None, sample_weight: Any = None, return_dict: bool = False
    ) -> Any:
        """Keras's test_on_batch on a global batch: each rank evaluates its slice of it, and the
        metrics are serial Keras's."""
        self._tnt_begin_on_batch("test_on_batch", x, y, sample_weight)
        self._tnt_slice_in_steps(test=True)
        with allreduce_op.collective_call("test_on_batch"):
            return super().test_on_batch(x, y, sample_weight, return_dict)

    def _tnt_begin_on_batch(self, what: str, x: Any, y: Any, sample_weight: Any) -> None:
        """Before a step on one batch: the op, the model built from the batch, the same weights
        on every rank, no update pending."""
        self._tnt_check_compiled(what)
        allreduce_op.prepare()
        spec = tf.nest.map_structure(
            lambda a: tf.TensorSpec(np.shape(a), tf.as_dtype(np.asarray(a).dtype)),
            (x, y, sample_weight),
        )
        compat.build_from_spec(self, spec, targets=True)
        if not self._tnt.weights_synced:
            self._tnt_sync_weights()
        self._tnt_apply_pending()

    # -- compile ------------------------------------------------------------------------------
    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Keras's compile (or the model's own); rejects Ftrl and disables XLA (it cannot compile
        the reduction)."""
        jit = kwargs.pop("jit_compile", "auto")
        if jit is True:
            warnings.warn(
                "tnt.Model: jit_compile=True is ignored; XLA cannot compile the gradient reduction "
                "(a collective op outside XLA), so training runs as a regular tf.function.",
                stacklevel=2,
            )
        if not self._tnt_overrides("compile"):
            _check_optimizer(kwargs.get("optimizer", args[0] if args else "rmsprop"))
        super().compile(*args, **kwargs)
        self._tnt_after_compile()

    def _tnt_after_compile(self) -> None:
        _check_optimizer(self.optimizer)
        compat.set_jit_compile(self, False)
        compat.reset_step_functions(self)

    def _tnt_check_compiled(self, what: str) -> None:
        if not getattr(self, "compiled", False):
            raise RuntimeError(f"You must call compile() before {what}().")
        _check_optimizer(self.optimizer)

    # -- weights, architecture ----------------------------------------------------------------
    def _tnt_sync_weights(self) -> None:
        """Make every rank start from the master rank's weights."""
        if ranks.get_size() > 1:
            weights = ranks.broadcast(self.get_weights() if ranks.is_master_rank() else None)
            if not ranks.is_master_rank():
                super().set_weights(weights)
        self._tnt.weights_synced = True

    def _tnt_ready(self, dataset: tf.data.Dataset, targets: bool = True) -> None:
        """Build the model (and with ``targets`` its compiled metrics, losses and optimizer) from
        the data's element spec, reading nothing from the data (a resumed fit must find its data
        as the uninterrupted one did), and start every rank from the same weights. A model with a
        train_step of its own may have no call() to build it from: its parts are built as Keras's
        custom-step examples build them, before fit, and its optimizers in its first step (alike
        on every rank)."""
        if not self._tnt_overrides("train_step"):
            compat.build_from_spec(self, dataset.element_spec, targets)
        if not self._tnt.weights_synced:
            self._tnt_sync_weights()

    def set_weights(self, weights: Any) -> None:
        """Set weights (call on all ranks); the master rank's values then reach every rank."""
        super().set_weights(weights)
        self._tnt_sync_weights()

    def get_config(self) -> dict:
        return self._tnt_plain().get_config()

    def to_json(self, **kwargs: Any) -> str:
        return self._tnt_plain().to_json(**kwargs)

    def to_yaml(self, **kwargs: Any) -> str:
        """Tarantella's ``to_yaml``: Keras 3 has no YAML configs."""
        raise NotImplementedError(NO_YAML)

    @classmethod
    def from_config(cls, config: dict, custom_objects: Any = None) -> Model:
        """A new tnt.Model of the architecture in ``config`` (``get_config()``'s dict)."""
        return Model(compat.model_from_config(config, custom_objects, cls._tnt_base))

    # -- training / inference -----------------------------------------------------------------
    def fit(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        epochs: int = 1,
        verbose: Any = "auto",
        callbacks: Any = None,
        validation_split: float = 0.0,
        validation_data: Any = None,
        shuffle: bool | str = True,
        class_weight: Any = None,
        sample_weight: Any = None,
        initial_epoch: int = 0,
        steps_per_epoch: int | None = None,
        validation_steps: int | None = None,
        validation_batch_size: int | None = None,
        validation_freq: int = 1,
        tnt_micro_batch_size: int | None = None,
        tnt_validation_micro_batch_size: int | None = None,
        tnt_distribute_dataset: bool = True,
        tnt_distribute_validation_dataset: bool = True,
    ) -> keras.callbacks.History:
        """Keras's fit with global batches split over ranks; returns the (global) History.

        A ``keras.callbacks.BackupAndRestore`` among the callbacks backs up on the master rank and
        resumes exactly (:mod:`tnt_notebook.keras.backup`)."""
        self._tnt_check_compiled("fit")
        callbacks, training_backup = backup.take_backup_callback(callbacks)
        allreduce_op.prepare()
        if validation_split and validation_data is None:
            (x, y, sample_weight), validation_data = data.split_off_validation(
                x, y, sample_weight, validation_split
            )
        train = data.prepare(
            x, y, sample_weight, batch_size, shuffle=shuffle, micro_batch=tnt_micro_batch_size,
            distribute_data=tnt_distribute_dataset, what="batch", in_step=True,
            fresh=training_backup is not None, chunk=self._tnt_chunk(),
        )  # fmt: skip
        if class_weight is not None:  # per sample, so weighting micro-batches equals serial
            train.dataset = data.with_class_weights(train.dataset, class_weight)
        val = None
        if validation_data is not None:
            *inputs, val_batch_size = data.validation_inputs(
                validation_data, validation_batch_size, train.global_batch_size or batch_size
            )
            val = data.prepare(
                *inputs, val_batch_size, shuffle=False,
                micro_batch=tnt_validation_micro_batch_size,
                distribute_data=tnt_distribute_validation_dataset, what="validation batch",
                in_step=True, chunk=self._tnt_chunk(),
            )  # fmt: skip
        synchronized_moments.warn_if_noisy(self, train.global_batch_size, tnt_micro_batch_size)
        self._tnt_ready(train.dataset)
        resume_at = 0
        if training_backup is not None:
            initial_epoch, resume_at = backup.resume(
                training_backup, self, train.dataset, initial_epoch, steps_per_epoch
            )
            callbacks = [training_backup, *callbacks, training_backup.history]
        cbs, verbose = tnt_callbacks.for_this_rank(
            callbacks, verbose, "fit", train, epochs=epochs, steps=steps_per_epoch
        )
        if settings.CHECK_REPLICAS.read() == "epoch":
            cbs = [*cbs, replicas.EpochCheck()]
        cbs = timeline_recorder.added_to(self._tnt_steps_for_fit(cbs, train, val))
        with (
            allreduce_op.collective_call("fit"),
            progress.flushed_on_error(cbs),
            backup.skipping_trained_steps(self, resume_at),
            self._tnt_discarding_pending(),
        ):
            history = super().fit(
                train.dataset,
                epochs=epochs,
                verbose=verbose,
                callbacks=cbs,
                validation_data=None if val is None else val.dataset,
                initial_epoch=initial_epoch,
                steps_per_epoch=steps_per_epoch,
                validation_steps=validation_steps,
                validation_freq=validation_freq,
                shuffle=False,  # the prepared dataset is already shuffled (alike on every rank)
            )
        replicas.finish_fit(self)
        return history if training_backup is None else training_backup.history  # (all epochs)

    def _tnt_steps_for_fit(
        self, cbs: list, train: data.Prepared, val: data.Prepared | None
    ) -> list:
        """Before a fit traces its steps: whether their batches are global, and whether they defer
        their updates (then applied before the callbacks that read weights)."""
        self._tnt.validation_slices = None if val is None else val.global_batches
        self._tnt_slice_in_steps(train=train.global_batches, test=self._tnt.validation_slices)
        self._tnt_defer_updates()
        if self._tnt.deferred is not None:
            each_batch = any(tnt_callbacks.may_read_weights_between_steps(cb) for cb in cbs)
            cbs = [tnt_callbacks.ApplyPending(each_batch), *cbs]
        return cbs

    @contextlib.contextmanager
    def _tnt_discarding_pending(self) -> Iterator[None]:
        """A fit that fails leaves no update pending (its collectives are abandoned)."""
        try:
            yield
        except BaseException:
            if self._tnt.deferred is not None:
                self._tnt.deferred.discard()
            raise

    def _tnt_begin_inference(
        self, mode, x, y, sample_weight, batch_size, verbose, steps, callbacks,
        micro_batch, distribute,
    ) -> tuple[Any, list, Any]:  # fmt: skip
        """What evaluate and predict do first: slice the data, build, sync weights, callbacks."""
        prepared = data.prepare(
            x, y, sample_weight, batch_size, shuffle=False, micro_batch=micro_batch,
            distribute_data=distribute, what="batch", in_step=mode == "evaluate",
            chunk=self._tnt_chunk(),
        )  # fmt: skip
        self._tnt_ready(prepared.dataset, targets=mode == "evaluate")
        cbs, verbose = tnt_callbacks.for_this_rank(callbacks, verbose, mode, prepared, steps=steps)
        return prepared, cbs, verbose

    def evaluate(
        self,
        x: Any = None,
        y: Any = None,
        batch_size: int | None = None,
        verbose: Any = "auto",
        sample_weight: Any = None,
        steps: int | None = None,
        callbacks: Any = None,
        return_dict: bool = False,
        tnt_micro_batch_size: int | None = None,
        tnt_distribute_dataset: bool = True,
        **kwargs: Any,
    ) -> Any:
        """Keras's evaluate on each rank's slice; metrics are global (equal to serial)."""
        if kwargs:  # Keras's fit validating on the dataset we prepared for it
            self._tnt_apply_pending()
            self._tnt_slice_in_steps(test=self._tnt.validation_slices)
            return super().evaluate(
                x, y, batch_size, verbose, sample_weight, steps, callbacks, return_dict, **kwargs
            )
        self._tnt_check_compiled("evaluate")
        allreduce_op.prepare()
        prepared, cbs, verbose = self._tnt_begin_inference(
            "evaluate", x, y, sample_weight, batch_size, verbose, steps, callbacks,
            tnt_micro_batch_size, tnt_distribute_dataset,
        )  # fmt: skip
        self._tnt_slice_in_steps(test=prepared.global_batches)
        with allreduce_op.collective_call("evaluate"), progress.flushed_on_error(cbs):
            return super().evaluate(
                prepared.dataset,
                verbose=verbose,
                steps=steps,
                callbacks=cbs,
                return_dict=return_dict,
            )

    def predict(
        self,
        x: Any,
        batch_size: int | None = None,
        verbose: Any = "auto",
        steps: int | None = None,
        callbacks: Any = None,
        tnt_micro_batch_size: int | None = None,
        tnt_distribute_dataset: bool = True,
    ) -> Any:
        """Predict each rank's slice, then gather: every rank returns all predictions in order.

        With ``tnt_distribute_dataset=False`` each rank predicts (and returns) its own data only.
        """
        prepared, cbs, verbose = self._tnt_begin_inference(
            "predict", x, None, None, batch_size, verbose, steps, callbacks,
            tnt_micro_batch_size, tnt_distribute_dataset,
        )  # fmt: skip
        if not (tnt_distribute_dataset and ranks.get_size() > 1):
            with progress.flushed_on_error(cbs):
                return super().predict(
                    prepared.dataset, verbose=verbose, steps=steps, callbacks=cbs
                )
        sizes = predictions.PredictSizes()
        with predictions.one_step_per_execution(self), progress.flushed_on_error(cbs):
            local = super().predict(
                prepared.dataset, verbose=verbose, steps=steps, callbacks=[*cbs, sizes]
            )
        return predictions.gather_in_order(local, sizes.sizes)


class Sequential(Model, keras.Sequential):
    """Tarantella's ``tnt.Sequential``: ``keras.Sequential`` trained data-parallel (a
    ``tnt.Model``); ``tnt.Model(keras.Sequential(...))`` gives the same."""

    _tnt_base = keras.Sequential


view.register(keras.Sequential, Sequential)

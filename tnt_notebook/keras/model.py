"""``tnt.Model``: Tarantella's data-parallel wrapper around an existing Keras 3 model.

Keras keeps running its own fit/evaluate/predict loops (callbacks, History, validation); we replace
the wrapped model's ``train_step`` / ``test_step`` on more than one rank and prepare the data so
that every rank processes its slice of each global batch. See README "Keras wrapper" for the
decisions.
"""

from __future__ import annotations

import enum
import os
import warnings
import zlib
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tnt_notebook import progress, ranks
from tnt_notebook.keras import allreduce_op, compat, data
from tnt_notebook.keras import callbacks as tnt_callbacks


class ParallelStrategy(enum.Enum):
    """How a model is parallelized; only data parallelism exists (as in Tarantella's API)."""

    DATA = "data"


#: Below this micro-batch size BatchNormalization statistics become noisy (Tarantella's warning).
BATCH_NORM_MIN_MICRO_BATCH = 16


def _check_optimizer(optimizer: Any) -> None:
    name = optimizer.lower() if isinstance(optimizer, str) else None
    if isinstance(optimizer, compat.UNSUPPORTED_OPTIMIZERS) or name in (
        compat.UNSUPPORTED_OPTIMIZER_NAMES
    ):
        raise ValueError(
            "tnt.Model does not support the Ftrl optimizer "
            f"({optimizer!r}); use SGD, Adam, RMSprop, Adagrad, ..."
        )


def rank_path(filepath: Any, rank: int) -> str:
    """Where rank ``rank`` writes with ``tnt_save_all_devices=True``.

    ``{rank}`` in the path is replaced by the rank; otherwise the master rank writes ``filepath``
    and rank r writes ``<name>.rank<r>.<suffixes>`` next to it (``model.keras`` ->
    ``model.rank1.keras``).
    """
    path = os.fspath(filepath)
    if "{rank}" in path:
        return path.format(rank=rank)
    if rank == ranks.get_master_rank():
        return path
    head, base = os.path.split(path)
    stem, dot, rest = base.partition(".")
    return os.path.join(head, f"{stem}.rank{rank}{dot}{rest}")


def _collective_call(fn, master_only: bool) -> Any:
    """Run ``fn`` (on the master only if asked), then let every rank learn whether it failed."""
    error: BaseException | None = None
    result = None
    if not master_only or ranks.is_master_rank():
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised on every rank below
            error = exc
    if ranks.get_size() > 1:
        failures = ranks.allreduce(np.array([error is not None], dtype=np.int32), op="sum")
        if failures[0] and error is None:
            raise RuntimeError("tnt: the operation failed on another rank (see the master's error)")
    if error is not None:
        raise error
    return result


def write_on_ranks(write, filepath: Any, overwrite: bool, all_devices: bool, kwargs: dict) -> None:
    """The master rank writes (every rank, to its rank_path, with all_devices); all ranks learn
    whether the write failed."""
    path = rank_path(filepath, ranks.get_rank()) if all_devices else filepath
    _collective_call(lambda: write(path, overwrite=overwrite, **kwargs), not all_devices)


class _DataParallelSteps:
    """train_step / test_step that reduce gradients and metric states over all ranks.

    Per step: the metric state variables are saved and zeroed, the local batch updates them (so they
    hold exactly this rank's contribution), and ``[n_r, metric deltas]`` plus ``n_r * g`` (in
    reverse variable order: backprop finishes the last layers first) go through the fused allreduce
    (:mod:`allreduce_op`: one op per fusion bucket, in plan order on every rank).
    The applied gradient is ``sum(n_r g_r) / sum(n_r)``, the mean over the global batch; metric
    states become ``saved + global delta``, so every result Keras reads is the exact global value.
    """

    def __init__(self, model: keras.Model):
        self.model = model
        self._reducers: dict[Any, Any] = {}
        # whether the batches are global (then each step slices this rank's micro-batch)
        self.slice_train = False
        self.slice_test = False

    @staticmethod
    def _micro_batch(batch):
        return data.slice_global_batch(batch, ranks.get_rank(), ranks.get_size())

    def _reducer(self, kind: str, specs: list[tuple[tuple[int, ...], Any]]):
        key = (kind, tuple((tuple(s), np.dtype(d).str) for s, d in specs))
        reducer = self._reducers.get(key)
        if reducer is None:  # collective: built during the first trace, which every rank runs
            reducer = self._reducers[key] = ranks.FusedAllreduce(specs)
        return reducer

    def _begin_metrics(self, n):
        """Save and zero the metric states, only once this step's batch exists: when the iterator
        is exhausted (unknown cardinality) the step fails at get_next and must change nothing."""
        mvars = compat.metric_variables(self.model)
        with tf.control_dependencies([n]):
            saved = [tf.identity(v.value) for v in mvars]
        with tf.control_dependencies(saved):
            for v, s in zip(mvars, saved, strict=True):
                v.assign(tf.zeros_like(s))
        return mvars, saved

    @staticmethod
    def _stat_vector(n, mvars) -> tf.Tensor:
        parts = [tf.reshape(tf.cast(n, tf.float32), [1])]
        parts += [tf.reshape(tf.cast(v.value, tf.float32), [-1]) for v in mvars]
        stat = tf.concat(parts, 0)
        return tf.where(n > 0, stat, tf.zeros_like(stat))  # an empty micro-batch adds nothing

    @staticmethod
    def _end_metrics(mvars, saved, stat_global) -> None:
        offset = 1
        for v, s in zip(mvars, saved, strict=True):
            size = int(np.prod(v.shape))
            delta = tf.reshape(stat_global[offset : offset + size], v.shape)
            v.assign(s + tf.cast(delta, v.dtype))
            offset += size

    def train_step(self, data):
        m = self.model
        if self.slice_train:
            data = self._micro_batch(data)
        x, y, sample_weight = compat.unpack_x_y_sample_weight(data)
        n = tf.shape(tf.nest.flatten(x)[0])[0]
        mvars, saved = self._begin_metrics(n)
        with tf.GradientTape() as tape:
            y_pred = compat.call_model(m, x, training=True)
            loss = compat.compute_loss(m, x, y, y_pred, sample_weight, training=True)
            compat.loss_tracker(m).update_state(compat.unscale_loss(loss), sample_weight=n)
            if m.optimizer is not None:
                loss = m.optimizer.scale_loss(loss)
            loss = loss * tf.cast(n, loss.dtype)  # gradients come out as n_r * g_r
        weights = m.trainable_weights
        grads = tape.gradient(loss, weights)
        grads = [
            tf.zeros(w.shape, w.dtype) if g is None else tf.convert_to_tensor(g)
            for g, w in zip(grads, weights, strict=True)
        ]
        grads = tf.cond(n > 0, lambda: grads, lambda: [tf.zeros_like(g) for g in grads])
        m.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        stat = self._stat_vector(n, mvars)
        tensors = [stat, *reversed(grads)]
        reducer = self._reducer(
            "train", [(tuple(t.shape), t.dtype.as_numpy_dtype) for t in tensors]
        )
        reduced = allreduce_op.reduce_buckets(reducer, tensors)
        inv_count = 1.0 / reduced[0][0]
        summed = list(reversed(reduced[1:]))
        m.optimizer.apply_gradients(
            [(g * tf.cast(inv_count, g.dtype), w) for g, w in zip(summed, weights, strict=True)]
        )
        self._end_metrics(mvars, saved, reduced[0])
        return m.get_metrics_result()

    def test_step(self, data):
        m = self.model
        if self.slice_test:
            data = self._micro_batch(data)
        x, y, sample_weight = compat.unpack_x_y_sample_weight(data)
        n = tf.shape(tf.nest.flatten(x)[0])[0]
        mvars, saved = self._begin_metrics(n)
        y_pred = compat.call_model(m, x, training=False)
        loss = compat.compute_loss(m, x, y, y_pred, sample_weight, training=False)
        compat.loss_tracker(m).update_state(compat.unscale_loss(loss), sample_weight=n)
        m.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
        stat = self._stat_vector(n, mvars)
        reducer = self._reducer("test", [(tuple(stat.shape), np.float32)])
        (stat_global,) = allreduce_op.reduce_buckets(reducer, [stat])
        self._end_metrics(mvars, saved, stat_global)
        return m.get_metrics_result()


class _PredictSizes(keras.callbacks.Callback):
    """Records how many rows each local predict batch produced (to put the slices back in order)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def on_predict_batch_end(self, batch, logs=None):
        outputs = (logs or {}).get("outputs")
        self.sizes.append(int(tf.nest.flatten(outputs)[0].shape[0]))


class Model:
    """Wraps (does not copy) a Keras model and trains it data-parallel over all ranks.

    Attributes not defined here (``layers``, ``metrics_names``, ``trainable_weights``,
    ``optimizer``, ``summary``, ``get_config``, ``to_json``, ...) are those of the wrapped Keras
    model; attributes set on the wrapper (``stop_training``, ...) are set on it too.
    """

    _OWN = frozenset({"model", "parallel_strategy"})

    def __init__(
        self, model: Any, parallel_strategy: ParallelStrategy = ParallelStrategy.DATA
    ) -> None:
        if isinstance(model, Model):
            model = model.model
        if not isinstance(model, keras.Model):
            raise TypeError(f"tnt.Model wraps a keras.Model, got {type(model).__name__}")
        if ParallelStrategy(parallel_strategy) is not ParallelStrategy.DATA:
            raise NotImplementedError("only ParallelStrategy.DATA is supported")
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "parallel_strategy", ParallelStrategy.DATA)
        object.__setattr__(self, "_tnt_steps", None)
        object.__setattr__(self, "_tnt_weights_synced", False)
        if getattr(model, "compiled", False):
            self._tnt_after_compile()

    # -- delegation ---------------------------------------------------------------------------
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in self._OWN or name.startswith("_tnt"):
            object.__setattr__(self, name, value)
        else:
            setattr(self.model, name, value)

    def __dir__(self) -> list[str]:
        return sorted(set(super().__dir__()) | set(dir(self.model)))

    def __repr__(self) -> str:
        return f"<tnt.Model wrapping {self.model!r} on {ranks.get_size()} rank(s)>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if compat.gradient_tape_active():
            raise NotImplementedError(
                "tnt.Model does not support custom training loops (tf.GradientTape around the "
                "model): gradients would not be reduced across ranks. Use tnt.Model.fit, or train "
                "the Keras model in a custom loop yourself."
            )
        return self.model(*args, **kwargs)

    def train_on_batch(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(
            "tnt.Model does not support train_on_batch (a custom training loop): use fit()."
        )

    # -- compile ------------------------------------------------------------------------------
    def compile(self, optimizer: Any = "rmsprop", *args: Any, **kwargs: Any) -> None:
        """Keras's compile; rejects Ftrl and disables XLA (it cannot compile the reduction)."""
        _check_optimizer(optimizer)
        jit = kwargs.pop("jit_compile", "auto")
        if jit is True:
            warnings.warn(
                "tnt.Model: jit_compile=True is ignored; XLA cannot compile the gradient reduction "
                "(a collective op outside XLA), so training runs as a regular tf.function.",
                stacklevel=2,
            )
        self.model.compile(optimizer, *args, jit_compile=False, **kwargs)
        self._tnt_after_compile()

    def _tnt_after_compile(self) -> None:
        m = self.model
        _check_optimizer(m.optimizer)
        for step in ("train_step", "test_step"):
            if getattr(type(m), step) is not getattr(keras.Model, step):
                raise NotImplementedError(
                    f"{type(m).__name__} overrides {step} (a custom training loop): tnt.Model "
                    "replaces it to reduce gradients and metrics across ranks. Move the logic "
                    "into call()/compute_loss(), or train the Keras model without tnt.Model."
                )
        compat.set_jit_compile(m, False)
        if ranks.get_size() > 1:
            steps = _DataParallelSteps(m)
            self._tnt_steps = steps
            m.train_step = steps.train_step
            m.test_step = steps.test_step
        compat.reset_step_functions(m)

    def _tnt_slice_in_steps(self, train: bool | None = None, test: bool | None = None) -> None:
        """Tell our steps whether their batches are global; Keras retraces them on a change."""
        steps = self._tnt_steps
        if steps is None:
            return
        old = (steps.slice_train, steps.slice_test)
        if train is not None:
            steps.slice_train = train
        if test is not None:
            steps.slice_test = test
        if (steps.slice_train, steps.slice_test) != old:
            compat.reset_step_functions(self.model)

    def _tnt_check_compiled(self, what: str) -> None:
        if not getattr(self.model, "compiled", False):
            raise RuntimeError(f"You must call compile() before {what}().")
        _check_optimizer(self.model.optimizer)

    # -- weights ------------------------------------------------------------------------------
    def _tnt_sync_weights(self) -> None:
        """Make every rank start from the master rank's weights."""
        if ranks.get_size() > 1:
            weights = ranks.broadcast(self.model.get_weights() if ranks.is_master_rank() else None)
            if not ranks.is_master_rank():
                self.model.set_weights(weights)
        self._tnt_weights_synced = True

    def _tnt_ensure_built(self, dataset: tf.data.Dataset) -> None:
        if self.model.built and self.model.weights:
            return
        for element in dataset.take(1):
            x, _, _ = compat.unpack_x_y_sample_weight(element)
            compat.call_model(self.model, x, training=False)

    def set_weights(self, weights: Any) -> None:
        """Set weights (call on all ranks); the master rank's values are then broadcast."""
        self.model.set_weights(weights)
        self._tnt_sync_weights()

    def load_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """Load on every rank, then broadcast the master rank's weights (identical everywhere)."""
        _collective_call(lambda: self.model.load_weights(filepath, *args, **kwargs), False)
        self._tnt_sync_weights()

    def save(
        self,
        filepath: Any,
        overwrite: bool = True,
        tnt_save_all_devices: bool = False,
        **kwargs: Any,
    ) -> None:
        """Keras's save, on the master rank only unless ``tnt_save_all_devices`` (see rank_path)."""
        write_on_ranks(self.model.save, filepath, overwrite, tnt_save_all_devices, kwargs)

    def save_weights(
        self,
        filepath: Any,
        overwrite: bool = True,
        tnt_save_all_devices: bool = False,
        **kwargs: Any,
    ) -> None:
        """Keras's save_weights, on the master rank only unless ``tnt_save_all_devices``."""
        write_on_ranks(self.model.save_weights, filepath, overwrite, tnt_save_all_devices, kwargs)

    def weights_checksum(self) -> np.ndarray:
        """One crc32 per weight array (bitwise identity check across ranks)."""
        return np.array(
            [zlib.crc32(np.ascontiguousarray(w).tobytes()) for w in self.model.get_weights()],
            dtype=np.float64,
        )

    def _tnt_finish_fit(self) -> None:
        """Average float non-trainable state (BatchNorm statistics), then check identity."""
        if ranks.get_size() == 1:
            return
        nontrainable = [
            v for v in self.model.non_trainable_weights if np.dtype(v.dtype).kind == "f"
        ]
        if nontrainable:
            averaged = ranks.FusedAllreduce(
                [(tuple(v.shape), np.dtype(v.dtype)) for v in nontrainable]
            ).allreduce([np.asarray(v.numpy()) for v in nontrainable], op="average")
            for v, a in zip(nontrainable, averaged, strict=True):
                v.assign(a)
        checksum = self.weights_checksum()
        if checksum.size:
            lo = ranks.allreduce(checksum, op="min")
            hi = ranks.allreduce(checksum, op="max")
            if not np.array_equal(lo, hi):
                warnings.warn(
                    "tnt: weights differed between ranks after fit; broadcast the master's",
                    stacklevel=3,
                )
                self._tnt_sync_weights()

    # -- data ---------------------------------------------------------------------------------
    def _tnt_prepare(
        self,
        x: Any,
        y: Any,
        sample_weight: Any,
        batch_size: int | None,
        *,
        shuffle: bool | str,
        micro_batch: int | None,
        distribute: bool,
        steps: int | None,
        what: str,
        in_step: bool = False,
    ) -> data.Prepared:
        if isinstance(x, tf.data.Dataset):
            if batch_size is not None:
                raise ValueError(
                    "Do not pass batch_size with a tf.data.Dataset: batch the dataset with the "
                    "global batch size instead."
                )
            if y is not None:
                raise ValueError("y must not be given when x is a tf.data.Dataset")
            if distribute:
                return data.distribute(x, micro_batch=micro_batch, what=what, in_step=in_step)
            return data.Prepared(x, None)
        if data.is_array_like(x):
            return data.arrays_to_dataset(
                x,
                y,
                sample_weight,
                batch_size=batch_size,
                shuffle=shuffle,
                distribute_data=distribute,
                micro_batch=micro_batch,
                what=what,
            )
        if y is not None or sample_weight is not None or batch_size is not None:
            raise ValueError(
                f"with x of type {type(x).__name__}, y, sample_weight and batch_size must not be "
                "given: it yields whole (global) batches"
            )
        dataset = data.generator_dataset(x)
        if not distribute:
            return data.Prepared(dataset, None)
        prepared = data.distribute(dataset, micro_batch=micro_batch, what=what, in_step=in_step)
        first = next(iter(dataset.take(1)))
        global_batch = int(tf.shape(tf.nest.flatten(first)[0])[0])
        data.check_batch_sizes(global_batch, micro_batch, ranks.get_size(), what)
        return data.Prepared(prepared.dataset, global_batch, global_batches=prepared.global_batches)

    def _tnt_warn_batch_norm(self, prepared: data.Prepared, micro_batch: int | None) -> None:
        micro = micro_batch
        if micro is None and prepared.global_batch_size is not None:
            micro = prepared.global_batch_size // ranks.get_size()
        if micro is None or micro >= BATCH_NORM_MIN_MICRO_BATCH:
            return
        if any(
            isinstance(layer, compat.BATCH_NORM_LAYERS)
            for layer in compat.flatten_layers(self.model)
        ):
            warnings.warn(
                f"tnt: BatchNormalization with a micro-batch of {micro} samples per rank (< "
                f"{BATCH_NORM_MIN_MICRO_BATCH}): batch statistics are computed per rank and may be "
                "noisy; consider a larger global batch.",
                stacklevel=3,
            )

    def _tnt_callbacks(
        self, callbacks: Any, verbose: Any, mode: str, prepared: data.Prepared, **params: Any
    ) -> tuple[list, Any]:
        """This rank's callbacks and verbosity; the master asks the progress module for a view."""
        cbs = tnt_callbacks.prepare(list(callbacks or []), self)
        if not ranks.is_master_rank() and not os.environ.get("TNT_OUTPUT_ON_ALL_DEVICES"):
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
        """Keras's fit with global batches split over ranks; returns the (global) History."""
        self._tnt_check_compiled("fit")
        allreduce_op.prepare()
        if validation_split and validation_data is None:
            if not data.is_array_like(x):
                raise ValueError("validation_split is only supported for NumPy/tensor inputs")
            (x, y, sample_weight), validation_data = compat.train_validation_split(
                (x, y, sample_weight), validation_split
            )
        train = self._tnt_prepare(
            x,
            y,
            sample_weight,
            batch_size,
            shuffle=shuffle,
            micro_batch=tnt_micro_batch_size,
            distribute=tnt_distribute_dataset,
            steps=steps_per_epoch,
            what="batch",
            in_step=True,
        )
        if class_weight is not None:  # per sample, so weighting micro-batches equals serial
            train.dataset = data.with_class_weights(train.dataset, class_weight)
        val = None
        if validation_data is not None:
            if isinstance(validation_data, tf.data.Dataset):
                vx, vy, vsw = validation_data, None, None
            else:
                vx, vy, vsw = compat.unpack_x_y_sample_weight(tuple(validation_data))
            val = self._tnt_prepare(
                vx,
                vy,
                vsw,
                validation_batch_size
                or (
                    None
                    if isinstance(vx, tf.data.Dataset)
                    else train.global_batch_size or batch_size
                ),
                shuffle=False,
                micro_batch=tnt_validation_micro_batch_size,
                distribute=tnt_distribute_validation_dataset,
                steps=validation_steps,
                what="validation batch",
                in_step=True,
            )
        self._tnt_warn_batch_norm(train, tnt_micro_batch_size)
        self._tnt_ensure_built(train.dataset)
        if not self._tnt_weights_synced:
            self._tnt_sync_weights()
        cbs, verbose = self._tnt_callbacks(
            callbacks,
            verbose,
            "fit",
            train,
            epochs=epochs,
            steps=steps_per_epoch,
        )
        self._tnt_slice_in_steps(
            train=train.global_batches, test=None if val is None else val.global_batches
        )
        with allreduce_op.collective_call("fit"), progress.flushed_on_error(cbs):
            history = self.model.fit(
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
        self._tnt_finish_fit()
        return history

    def _tnt_begin_inference(
        self, mode, x, y, sample_weight, batch_size, verbose, steps, callbacks,
        micro_batch, distribute,
    ) -> tuple[Any, list, Any]:  # fmt: skip
        """What evaluate and predict do first: slice the data, build, sync weights, callbacks."""
        prepared = self._tnt_prepare(
            x,
            y,
            sample_weight,
            batch_size,
            shuffle=False,
            micro_batch=micro_batch,
            distribute=distribute,
            steps=steps,
            what="batch",
            in_step=mode == "evaluate",
        )
        self._tnt_ensure_built(prepared.dataset)
        if not self._tnt_weights_synced:
            self._tnt_sync_weights()
        cbs, verbose = self._tnt_callbacks(callbacks, verbose, mode, prepared, steps=steps)
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
    ) -> Any:
        """Keras's evaluate on each rank's slice; metrics are global (equal to serial)."""
        self._tnt_check_compiled("evaluate")
        allreduce_op.prepare()
        prepared, cbs, verbose = self._tnt_begin_inference(
            "evaluate", x, y, sample_weight, batch_size, verbose, steps, callbacks,
            tnt_micro_batch_size, tnt_distribute_dataset,
        )  # fmt: skip
        self._tnt_slice_in_steps(test=prepared.global_batches)
        with allreduce_op.collective_call("evaluate"), progress.flushed_on_error(cbs):
            return self.model.evaluate(
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
        gather = tnt_distribute_dataset and ranks.get_size() > 1
        sizes = _PredictSizes()
        spe = self.model.steps_per_execution
        if gather and spe != 1:  # one size per global batch is needed to restore the order
            self.model.steps_per_execution = 1
            self.model.predict_function = None
        try:
            with progress.flushed_on_error(cbs):
                local = self.model.predict(
                    prepared.dataset,
                    verbose=verbose,
                    steps=steps,
                    callbacks=[*cbs, sizes] if gather else cbs,
                )
        finally:
            if gather and spe != 1:
                self.model.steps_per_execution = spe
                self.model.predict_function = None
        if not gather:
            return local
        return _gather_in_order(local, sizes.sizes)


def _gather_in_order(local: Any, sizes: list[int]) -> Any:
    """Reassemble the global prediction array from every rank's micro-batch outputs."""
    rank, size = ranks.get_rank(), ranks.get_size()
    counts = np.zeros((len(sizes), size), dtype=np.int64)
    counts[:, rank] = sizes
    counts = ranks.allreduce(counts, op="sum")
    batch_starts = np.concatenate([[0], np.cumsum(counts.sum(axis=1))])
    total = int(batch_starts[-1])
    rows = np.concatenate(
        [
            np.arange(
                batch_starts[b] + counts[b, :rank].sum(),
                batch_starts[b] + counts[b, : rank + 1].sum(),
            )
            for b in range(len(sizes))
        ]
        or [np.zeros(0, dtype=np.int64)]
    ).astype(np.int64)

    def place(arr):
        arr = np.asarray(arr)
        full = np.zeros((total, *arr.shape[1:]), dtype=arr.dtype)
        full[rows] = arr
        return ranks.allreduce(full, op="sum")

    return tf.nest.map_structure(place, local)

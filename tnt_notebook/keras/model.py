"""``tnt.Model``: Tarantella's data-parallel model, on Keras 3.

``tnt.Model(keras_model)`` returns a *view* of the Keras model: an object of a subclass of both
``tnt.Model`` and the model's own class (``Functional``, ``Sequential`` or the user's subclass)
that shares the model's state (its ``__dict__``: layers, weights, optimizer, compiled metrics).
So a ``tnt.Model`` is a Keras model (``isinstance(m, keras.Model)``, every Keras attribute and
utility works), and nothing is copied. On more than one rank its ``train_step`` and
``test_step`` reduce gradients and metric states over all ranks; ``fit``, ``evaluate`` and
``predict`` first prepare the data so that every rank processes its slice of each global batch.
See the README's "Keras wrapper" section for the decisions.
"""

from __future__ import annotations

import contextlib
import enum
import os
import warnings
import zlib
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tnt_notebook import progress, ranks
from tnt_notebook.keras import (
    allreduce_op,
    backup,
    compat,
    data,
    distributed_optimizer,
    global_loss,
    saving,
    sparse_gradients,
    synchronized_moments,
)
from tnt_notebook.keras import callbacks as tnt_callbacks
from tnt_notebook.keras.compression import Compression


class ParallelStrategy(enum.Enum):
    """How a model is parallelized; only data parallelism exists (as in Tarantella's API)."""

    DATA = "data"


NO_YAML = (
    "Keras 3 removed YAML model configs (loading YAML could run arbitrary code): use "
    "model.to_json() and tnt.models.model_from_json(json_string) instead"
)

#: Below this micro-batch size BatchNormalization statistics become noisy (Tarantella's warning).
BATCH_NORM_MIN_MICRO_BATCH = 16


class ReplicaDivergenceError(RuntimeError):
    """The ranks' copies of the model differ: a bug (ours, or state that a layer keeps outside its
    weights' updates), never repaired silently."""


def _check_optimizer(optimizer: Any) -> None:
    name = optimizer.lower() if isinstance(optimizer, str) else None
    if isinstance(optimizer, compat.UNSUPPORTED_OPTIMIZERS) or name in (
        compat.UNSUPPORTED_OPTIMIZER_NAMES
    ):
        raise ValueError(
            "tnt.Model does not support the Ftrl optimizer "
            f"({optimizer!r}); use SGD, Adam, RMSprop, Adagrad, ..."
        )


class _State:
    """What a tnt.Model keeps besides the Keras model's own state (one per wrapped model)."""

    def __init__(self) -> None:
        self.reducers: dict[Any, ranks.FusedAllreduce] = {}
        # whether the batches are global (then each step slices this rank's micro-batch)
        self.slice_train = False
        self.slice_test = False
        self.validation_slices: bool | None = None  # slice_test of the running fit's validation
        self.weights_synced = False
        self.in_step = False  # tracing our own step: calling the model under a tape is ours
        self.compression = Compression.none  # how gradients travel (tnt.Model(compression=))
        self.keras_model: keras.Model | None = None  # the wrapped model (the same state)
        # the gradient buckets that each step leaves to the next (None: each step finishes its own)
        self.deferred: allreduce_op.DeferredReduction | None = None


class _AtomicSaves:
    """Keras's ``save`` and ``save_weights``, each writing a temporary file renamed over the
    target, so that what the master rank's callbacks (ModelCheckpoint) write is whole or absent."""

    def save(self, filepath: Any, overwrite: bool = True, **kwargs: Any) -> None:
        save = super().save
        saving.write_atomically(lambda path: save(path, **kwargs), filepath, overwrite)

    def save_weights(self, filepath: Any, overwrite: bool = True, **kwargs: Any) -> None:
        save_weights = super().save_weights
        saving.write_atomically(lambda path: save_weights(path, **kwargs), filepath, overwrite)


_VIEW_CLASSES: dict[type, type] = {}
_PLAIN_CLASSES: dict[type, type] = {}


def _impersonating(mixin: type, base: type, cache: dict[type, type], **namespace: Any) -> type:
    """A subclass of ``mixin`` and ``base`` under ``base``'s name and module (made once per
    class), so that Keras serializes its objects as ``base``'s and revives them as such."""
    cls = cache.get(base)
    if cls is None:
        namespace |= {"__module__": base.__module__, "__qualname__": base.__qualname__}
        cls = cache[base] = type(base.__name__, (mixin, base), namespace)
        compat.share_registered_name(cls, base)
    return cls


def _view_class(base: type) -> type:
    """The ``tnt.Model`` subclass for Keras model class ``base``."""
    return _impersonating(Model, base, _VIEW_CLASSES, _tnt_base=base, __doc__=Model.__doc__)


def _view_of(model: keras.Model, cls: type | None = None) -> Any:
    """An object of class ``cls`` (default: the view class of ``model``'s class) sharing
    ``model``'s state."""
    cls = cls or _view_class(type(model))
    view = object.__new__(cls)
    object.__setattr__(view, "__dict__", model.__dict__)
    return view


class _StepMetrics:
    """Metric states over all ranks, exact from the first step, however often TensorFlow traces.

    Made after the forward pass, when Keras can build its compiled metrics and losses (it builds
    them lazily, at their first update): every metric state variable is saved and zeroed, so the
    local updates leave exactly this rank's contribution in it. The contributions travel with the
    gradients, summed over the ranks, and each state becomes ``saved + global contribution``. A
    variable created during the step (a metric that user code builds on first use) held zero
    before it (TensorFlow traces the step again after a trace that created variables). Metrics
    that Keras updates once per batch (each output's loss) contribute ``n_r * local / n``, so the
    global batch counts once, as in serial Keras.
    """

    def __init__(self, model: keras.Model, n: tf.Tensor, y: Any = None, y_pred: Any = None):
        if y_pred is not None:  # (a model's own step: it builds what it updates)
            compat.build_compiled_metrics(model, y, y_pred)
        self.model, self.n = model, n
        variables = compat.metric_variables(model)
        with tf.control_dependencies([n]):  # only once this step's batch exists
            saved = [tf.identity(v.value) for v in variables]
        with tf.control_dependencies(saved):
            for v, s in zip(variables, saved, strict=True):
                v.assign(tf.zeros_like(s))
        self.saved = {id(v): s for v, s in zip(variables, saved, strict=True)}
        self.per_batch = (
            set() if y_pred is None else compat.per_batch_metric_variables(model, y_pred)
        )
        self.variables: list = []

    def local_contribution(self) -> tf.Tensor:
        """``[n, every metric state]`` of this rank's micro-batch (zero for an empty one)."""
        self.variables = compat.metric_variables(self.model)
        n = tf.cast(self.n, tf.float32)
        parts = [tf.reshape(n, [1])]
        for v in self.variables:
            value = tf.reshape(tf.cast(v.value, tf.float32), [-1])
            parts.append(value * n if id(v) in self.per_batch else value)
        stat = tf.concat(parts, 0)
        return tf.where(self.n > 0, stat, tf.zeros_like(stat))

    def finish(self, global_contribution: tf.Tensor) -> None:
        offset = 1
        for v in self.variables:
            size = int(np.prod(v.shape))
            delta = tf.reshape(global_contribution[offset : offset + size], v.shape)
            if id(v) in self.per_batch:
                delta = delta / global_contribution[0]
            delta = tf.cast(delta, v.dtype)
            saved = self.saved.get(id(v))
            v.assign(delta if saved is None else saved + delta)
            offset += size


class _PredictSizes(keras.callbacks.Callback):
    """Records how many rows each local predict batch produced (to put the slices back in order)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def on_predict_batch_end(self, batch, logs=None):
        # Keras passes {"outputs": ...}, but flattens a dict of outputs into the logs themselves,
        # and turns an output of one element (one row) into a float
        first = tf.nest.flatten(list((logs or {}).values()))[0]
        self.sizes.append(1 if isinstance(first, float) else int(np.shape(first)[0]))


class _ApplyPending(keras.callbacks.Callback):
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


def _may_read_weights_between_steps(callback: Any) -> bool:
    """Whether ``callback`` hooks into training batches in a way that may read the weights."""
    if isinstance(callback, tnt_callbacks.Callback):  # (Tarantella's wrapper: what it wraps)
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


class _ReplicaCheck(keras.callbacks.Callback):
    """Compares the ranks' trainable weights at every epoch end (``TNT_CHECK_REPLICAS=epoch``)."""

    def on_epoch_end(self, epoch, logs=None):
        self.model._tnt_check_replicas(f"epoch {epoch}", trainable_only=True)


class Model(keras.Model):
    """Tarantella's ``tnt.Model(keras_model)``: trains ``keras_model`` data-parallel on all ranks.

    The result is a Keras model of ``keras_model``'s own class that shares its layers, weights
    and state (nothing is copied); train through it. ``tnt.Model(inputs, outputs)`` builds a
    functional model first, as ``keras.Model`` does. Batch sizes are global: every rank processes
    its slice of each batch, gradients and metrics are reduced over all ranks, and ``fit``,
    ``evaluate`` and ``predict`` return what serial Keras returns.

    ``compression=tnt.Compression.fp16`` (or ``bf16``) sends the gradients in 16 bits, for steps
    that wait on a slow link between hosts (see :mod:`tnt_notebook.keras.compression`).
    """

    _tnt_base: type | None = None  # the Keras class of the wrapped model (set on views)
    parallel_strategy = ParallelStrategy.DATA

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        if cls._tnt_base is not None:  # tnt.Sequential(layers), or Keras re-creating a view
            model = cls._tnt_base(*args, **kwargs)
            view = _view_of(model, cls)
            view._tnt.keras_model = model
            return view
        compression = None
        if args and isinstance(args[0], keras.Model):
            model, rest = args[0], list(args[1:])
            strategy = rest.pop(0) if rest else kwargs.pop("parallel_strategy", None)
            compression = kwargs.pop("compression", None)
            if rest or kwargs:
                raise TypeError(
                    "tnt.Model(model, parallel_strategy=ParallelStrategy.DATA, compression=None) "
                    f"takes no other arguments, got {[*rest, *kwargs]}"
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
        view = model if isinstance(model, Model) else _view_of(model)
        if view._tnt.keras_model is None:
            view._tnt.keras_model = model
        if compression is not None and compression is not view._tnt.compression:
            view._tnt.compression = compression
        elif view is model:
            return view
        if getattr(view, "compiled", False):  # (its steps are traced again, with ours)
            view._tnt_after_compile()
        return view

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Nothing to do: ``__new__`` made this object a view of an existing Keras model."""

    @property
    def _tnt(self) -> _State:
        state = self.__dict__.get("_tnt_state")
        if state is None:  # straight into the shared __dict__: not a Keras-tracked attribute
            state = self.__dict__["_tnt_state"] = _State()
        return state

    def _tnt_plain(self) -> keras.Model:
        """The wrapped model as plain Keras: for serializing, and for the callbacks that run on
        the master rank alone (whose saves must not be collective)."""
        return _view_of(self, _impersonating(_AtomicSaves, self._tnt_base, _PLAIN_CLASSES))

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

    # -- the data-parallel steps ----------------------------------------------------------------
    @contextlib.contextmanager
    def _tnt_tracing_step(self) -> Iterator[None]:
        """Around tracing one of our steps: calling the model under a tape is ours, and random
        draws (dropout, noise) differ between ranks, as they differ between the samples of a
        serial batch (rank 0 draws what serial Keras draws)."""
        state = self._tnt
        outer, state.in_step = state.in_step, True
        try:
            with compat.random_draws_offset(ranks.get_rank()):
                yield
        finally:
            state.in_step = outer

    def _tnt_reducer(self, kind: str, tensors: list) -> ranks.FusedAllreduce:
        return self._tnt_reducer_of(kind, [(tuple(t.shape), t.dtype) for t in tensors])

    def _tnt_reducer_of(self, kind: str, specs: list[tuple[tuple, Any]]) -> ranks.FusedAllreduce:
        specs = [(s, tf.as_dtype(d).as_numpy_dtype) for s, d in specs]
        key = (kind, tuple((s, np.dtype(d).str) for s, d in specs))
        reducer = self._tnt.reducers.get(key)
        if reducer is None:  # collective: made on every rank alike (in fit, or the first trace)
            reducer = self._tnt.reducers[key] = ranks.FusedAllreduce(specs)
        return reducer

    def _tnt_defer_updates(self) -> None:
        """Before a fit's steps are traced: whether they leave their gradient buckets to the next
        step (:class:`allreduce_op.DeferredReduction`), with the variables that carry them over."""
        state = self._tnt
        deferred = None
        if allreduce_op.defers_updates(self) and not self._tnt_overrides("train_step"):
            specs = [
                (tuple(w.shape), state.compression.wire_dtype(tf.as_dtype(w.dtype)))
                for w in reversed(self.trainable_weights)
            ]
            deferred = state.deferred
            if deferred is None or deferred.specs != specs:
                reducer = self._tnt_reducer_of("train", specs)
                deferred = allreduce_op.DeferredReduction(reducer, specs)
            deferred.discard()  # (what a failed fit left is gone with the engine's calls)
        if deferred is not state.deferred:
            state.deferred = deferred
            compat.reset_step_functions(self)

    def _tnt_apply_update(self, reduced: list, divisor: tf.Tensor, slices: Any = None) -> None:
        """The optimizer's step from the reduced gradients (``n_r * g_r`` summed over the ranks,
        on the wire in reverse variable order; ``slices``: the sparse ones gathered as slices, by
        weight index) divided by ``divisor = sum(n_r)`` (an integer, exact in every float
        dtype)."""
        weights, slices = self.trainable_weights, slices or {}
        dense = [w for i, w in enumerate(weights) if i not in slices]
        summed = iter(self._tnt.compression.decompress(list(reversed(reduced)), dense))
        grads = [slices[i] if i in slices else next(summed) for i in range(len(weights))]
        self.optimizer.apply_gradients(
            [(_divided(g, divisor), w) for g, w in zip(grads, weights, strict=True)]
        )

    def _tnt_apply_pending(self) -> None:
        """Apply the update that the last step left pending (before anything reads weights)."""
        if self._tnt.deferred is not None:
            self._tnt.deferred.flush(self._tnt_apply_update)

    def _tnt_local_batch(self, batch: Any, sliced: bool) -> tuple[Any, Any, Any, tf.Tensor]:
        if sliced:
            batch = data.slice_global_batch(batch, ranks.get_rank(), ranks.get_size())
        x, y, sample_weight = compat.unpack_x_y_sample_weight(batch)
        return x, y, sample_weight, tf.shape(tf.nest.flatten(x)[0])[0]

    def train_step(self, data: Any) -> Any:
        """Keras's step on 1 rank. On more: this rank's micro-batch, then ``[n_r, metric
        contributions]`` and ``n_r * g`` (in reverse variable order: backprop finishes the last
        layers first) through the fused allreduce (:mod:`allreduce_op`: one op per fusion bucket,
        in plan order on every rank). The applied gradient is ``sum(n_r g_r) / sum(n_r)``, the
        mean over the global batch, of each loss as Keras normalises it (:mod:`global_loss`).
        Where updates are deferred, the step first applies the one that the previous step left,
        and leaves its own gradients travelling. A model's own ``train_step`` runs on the
        micro-batch with its gradients reduced in ``optimizer.apply`` (:meth:`_tnt_own_step`)."""
        with self._tnt_tracing_step():
            if ranks.get_size() == 1:
                return super().train_step(data)
            if self._tnt_overrides("train_step"):
                return self._tnt_own_step(super().train_step, data, self._tnt.slice_train)
            deferred = self._tnt.deferred
            in_order = allreduce_op.InOrder()
            if deferred is not None:  # (only once this step's batch exists: at the end of the
                # data the step fails in fetching it, and nothing may have been finished then)
                applied = deferred.apply_pending(self._tnt_apply_update, tf.nest.flatten(data))
                in_order.after = [applied]
            x, y, sample_weight, n = self._tnt_local_batch(data, self._tnt.slice_train)
            with tf.GradientTape() as tape:
                with self._tnt_moments_over_ranks(in_order):
                    y_pred = compat.call_model(self, x, training=True)
                metrics = _StepMetrics(self, n, y, y_pred)
                with self._tnt_loss_shares(n, in_order) as shares:
                    loss = compat.compute_loss(self, x, y, y_pred, sample_weight, training=True)
                compat.loss_tracker(self).update_state(compat.unscale_loss(loss), sample_weight=n)
                if compat.scales_loss(self.optimizer):
                    # the global batch's share before backprop, as serial Keras scales it: float16
                    # gradients overflow (and skip steps) exactly where serial Keras's would
                    global_n = shares.global_count()
                    loss = self.optimizer.scale_loss(loss) * tf.cast(n, loss.dtype) / global_n
                else:
                    global_n = None
                    loss = loss * tf.cast(n, loss.dtype)  # gradients come out as n_r * g_r
            weights = self.trainable_weights
            grads = tape.gradient(loss, weights)
            slices = {  # (a step that defers its update reduces every gradient densely)
                i: g
                for i, g in enumerate(grads)
                if deferred is None and sparse_gradients.gathered_as_slices(g, self.optimizer)
            }
            grads = [
                _dense_gradient(g, w, self.optimizer)
                for i, (g, w) in enumerate(zip(grads, weights, strict=True))
                if i not in slices
            ]
            grads = allreduce_op.zeros_unless(n > 0, grads)
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            wire = list(reversed(self._tnt.compression.compress(grads)))
            stat = metrics.local_contribution()
            if deferred is None:
                tensors = [stat, *wire]
                with tf.control_dependencies(in_order.after):
                    reduced = allreduce_op.reduce_buckets(
                        self._tnt_reducer("train", tensors), tensors
                    )
                stat = reduced[0]
                in_order.after = reduced[-1:]
                gathered = {i: sparse_gradients.gather(g, in_order) for i, g in slices.items()}
                self._tnt_apply_update(reduced[1:], _update_divisor(stat, global_n), gathered)
            else:  # the metrics' bucket starts first and finishes in this step
                library = allreduce_op.op_library()
                reducer = self._tnt_reducer("train metrics", [stat])
                (ticket,) = allreduce_op.start_buckets(library, reducer, [stat], in_order.after)
                tickets = allreduce_op.start_buckets(library, deferred.reducer, wire, [ticket])
                (stat,) = allreduce_op.finish_buckets(library, reducer, [ticket], [stat], tickets)
                deferred.keep(wire, tickets, _update_divisor(stat, global_n))
            metrics.finish(stat)
            return self.get_metrics_result()

    def test_step(self, data: Any) -> Any:
        """Keras's step on 1 rank; on more, metric states are reduced as in :meth:`train_step`."""
        with self._tnt_tracing_step():
            if ranks.get_size() == 1:
                return super().test_step(data)
            if self._tnt_overrides("test_step"):
                return self._tnt_own_step(super().test_step, data, self._tnt.slice_test)
            in_order = allreduce_op.InOrder()
            x, y, sample_weight, n = self._tnt_local_batch(data, self._tnt.slice_test)
            y_pred = compat.call_model(self, x, training=False)
            metrics = _StepMetrics(self, n, y, y_pred)
            with self._tnt_loss_shares(n, in_order):
                loss = compat.compute_loss(self, x, y, y_pred, sample_weight, training=False)
            compat.loss_tracker(self).update_state(compat.unscale_loss(loss), sample_weight=n)
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            stat = metrics.local_contribution()
            (stat,) = in_order.sum_over_ranks(self._tnt_reducer("test", [stat]), [stat])
            metrics.finish(stat)
            return self.get_metrics_result()

    def _tnt_overrides(self, method: str) -> bool:
        """Whether the wrapped model's class brings its own ``method`` (``train_step``, ...)."""
        return getattr(self._tnt_base, method) is not getattr(keras.Model, method)

    def _tnt_own_step(self, step: Any, batch: Any, sliced: bool) -> Any:
        """A model's own step on this rank's micro-batch: every ``optimizer.apply`` in it reduces
        its gradients first (:mod:`distributed_optimizer`), Keras's losses are this rank's shares
        of the global ones (:mod:`global_loss`), and the metric states it updates are summed over
        the ranks, those of a ``Mean`` updated once per batch (``tracker.update_state(loss)``)
        weighted ``n_r / N`` so that the global batch counts once. Values it returns that are no
        metric's result are averaged over the global batch."""
        if sliced:
            batch = data.slice_global_batch(batch, ranks.get_rank(), ranks.get_size())
        n = tf.shape(tf.nest.flatten(batch)[0])[0]
        in_order = allreduce_op.InOrder()
        metrics = _StepMetrics(self, n)
        per_batch: list = []
        with (
            distributed_optimizer.reducing_in_apply(n, in_order),
            self._tnt_loss_shares(n, in_order),
            self._tnt_moments_over_ranks(in_order),
            compat.per_batch_means(per_batch.append),
        ):
            logs = _flattened(step(batch))
        metrics.per_batch = {id(v) for m in per_batch for v in m.variables}
        own = {k: v for k, v in logs.items() if k not in self.get_metrics_result()}
        weighted = [tf.reshape(tf.cast(v, tf.float32), [-1]) * tf.cast(n, tf.float32)
                    for v in own.values()]  # fmt: skip
        weighted = [tf.where(n > 0, w, tf.zeros_like(w)) for w in weighted]  # (NaN of no rows)
        local = metrics.local_contribution()
        tensors = [tf.concat([local, *weighted], 0)]
        (stat,) = in_order.sum_over_ranks(self._tnt_reducer("own step", tensors), tensors)
        metrics.finish(stat[: local.shape[0]])
        results = self.get_metrics_result()
        offset = int(local.shape[0])
        for key, value in own.items():
            size = int(np.prod(value.shape))
            mean = stat[offset : offset + size] / stat[0]
            results[key] = tf.cast(tf.reshape(mean, value.shape), value.dtype)
            offset += size
        return {k: results[k] for k in logs}

    def _tnt_loss_shares(self, n: tf.Tensor, in_order: allreduce_op.InOrder) -> Any:
        """Keras's losses as this rank's shares of the global batch's (:mod:`global_loss`)."""
        return global_loss.shares(n, self._tnt_summing("loss normaliser", in_order))

    def _tnt_moments_over_ranks(self, in_order: allreduce_op.InOrder) -> Any:
        """Synchronized BatchNormalization's moments of the global batch
        (:mod:`synchronized_moments`)."""
        return synchronized_moments.over_ranks(self._tnt_summing("batch moments", in_order))

    def _tnt_summing(self, kind: str, in_order: allreduce_op.InOrder) -> Any:
        """``tensor -> tensor`` summed over the ranks, in ``in_order``'s order."""

        def sum_over_ranks(t: tf.Tensor) -> tf.Tensor:
            return in_order.sum_over_ranks(self._tnt_reducer(kind, [t]), [t])[0]

        return sum_over_ranks

    def _tnt_slice_in_steps(self, train: bool | None = None, test: bool | None = None) -> None:
        """Tell our steps whether their batches are global; Keras retraces a step whose slicing
        changed (only that one: a callback's evaluate inside fit leaves fit's train function)."""
        if ranks.get_size() == 1:
            return
        state = self._tnt
        if train is not None and train != state.slice_train:
            state.slice_train = train
            self.train_function = None
        if test is not None and test != state.slice_test:
            state.slice_test = test
            self.test_function = None

    # -- weights, saving, architecture ----------------------------------------------------------
    def _tnt_sync_weights(self) -> None:
        """Make every rank start from the master rank's weights."""
        if ranks.get_size() > 1:
            weights = ranks.broadcast(self.get_weights() if ranks.is_master_rank() else None)
            if not ranks.is_master_rank():
                super().set_weights(weights)
        self._tnt.weights_synced = True

    def _tnt_ensure_built(self, dataset: tf.data.Dataset, targets: bool = True) -> None:
        """Build the model (and with ``targets`` its compiled metrics, losses and optimizer) from
        the data's element spec, reading nothing from the data (a resumed fit must find its data
        as the uninterrupted one did). A model with a train_step of its own may have no call()
        to build it from: its parts are built as Keras's custom-step examples build them, before
        fit, and its optimizers in its first step (alike on every rank)."""
        if not self._tnt_overrides("train_step"):
            compat.build_from_spec(self, dataset.element_spec, targets)

    def set_weights(self, weights: Any) -> None:
        """Set weights (call on all ranks); the master rank's values then reach every rank."""
        super().set_weights(weights)
        self._tnt_sync_weights()

    def load_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """Keras's load_weights on every rank, from the master rank's file (hosts need not share
        a filesystem)."""
        load = super().load_weights
        saving.load_on_ranks(lambda path: load(path, *args, **kwargs), filepath, "load_weights")
        self._tnt.weights_synced = True

    def save(
        self,
        filepath: Any,
        overwrite: bool = True,
        tnt_save_all_devices: bool = False,
        **kwargs: Any,
    ) -> None:
        """Keras's save, by the master rank only (by every rank, to the path each passed, with
        ``tnt_save_all_devices``); the file appears whole or not at all."""
        plain = self._tnt_plain()
        saving.save_on_ranks(
            lambda path: plain.save(path, **kwargs), filepath, "save", overwrite,
            tnt_save_all_devices,
        )  # fmt: skip

    def save_weights(
        self,
        filepath: Any,
        overwrite: bool = True,
        tnt_save_all_devices: bool = False,
        **kwargs: Any,
    ) -> None:
        """Keras's save_weights, written as :meth:`save` writes."""
        plain = self._tnt_plain()
        saving.save_on_ranks(
            lambda path: plain.save_weights(path, **kwargs), filepath, "save_weights", overwrite,
            tnt_save_all_devices,
        )  # fmt: skip

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

    def _tnt_check_replicas(self, when: str, trainable_only: bool = False) -> None:
        """Raise ReplicaDivergenceError naming the ranks and weights that differ from the
        master's (collective)."""
        if ranks.get_size() == 1:
            return
        weights = self.trainable_weights if trainable_only else self.weights
        checksum = np.array(
            [zlib.crc32(np.ascontiguousarray(w.numpy()).tobytes()) for w in weights],
            dtype=np.float64,
        )
        master = ranks.broadcast(checksum)
        differs = np.zeros((ranks.get_size(), len(weights)), dtype=np.int32)
        differs[ranks.get_rank()] = checksum != master
        differs = ranks.allreduce(differs, op="sum")
        if differs.any():
            bad_ranks = np.flatnonzero(differs.any(axis=1)).tolist()
            names = [weights[i].path for i in np.flatnonzero(differs.any(axis=0))]
            raise ReplicaDivergenceError(
                f"tnt: after {when}, the weights of rank(s) {bad_ranks} differ from the master "
                f"rank's in {', '.join(names)}"
            )

    def _tnt_finish_fit(self) -> None:
        """Average the statistics that ranks computed each of their own samples (the moving
        moments of BatchNormalization layers that trained, per rank), then check that all ranks
        hold the same model. Nothing else is touched: frozen weights stay bit for bit."""
        if ranks.get_size() == 1:
            return
        nontrainable = compat.per_rank_statistics(self)
        if nontrainable:
            averaged = ranks.FusedAllreduce(
                [(tuple(v.shape), np.dtype(v.dtype)) for v in nontrainable]
            ).allreduce([np.asarray(v.numpy()) for v in nontrainable], op="average")
            for v, a in zip(nontrainable, averaged, strict=True):
                v.assign(a)
        self._tnt_check_replicas("fit")

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
        fresh: bool = False,
    ) -> data.Prepared:
        if isinstance(x, tf.data.Dataset):
            if batch_size is not None:
                raise ValueError(
                    "Do not pass batch_size with a tf.data.Dataset: batch the dataset with the "
                    "global batch size instead."
                )
            if y is not None:
                raise ValueError("y must not be given when x is a tf.data.Dataset")
            if fresh:  # its own pipeline: every epoch's shuffle drawn anew from the start
                x = data.fresh_copy(x)
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
        shuffled = bool(shuffle) and isinstance(x, keras.utils.PyDataset)
        dataset = data.generator_dataset(x, data.shuffle_seed() if shuffled else None)
        if not distribute:
            return data.Prepared(dataset, None)
        prepared = data.distribute(
            dataset, micro_batch=micro_batch, what=what, in_step=in_step, batched=True
        )
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
            isinstance(layer, compat.BATCH_NORM_LAYERS) and not layer.synchronized
            for layer in compat.flatten_layers(self)
        ):
            warnings.warn(
                f"tnt: BatchNormalization with a micro-batch of {micro} samples per rank (< "
                f"{BATCH_NORM_MIN_MICRO_BATCH}): batch statistics are computed per rank and may be "
                "noisy; consider a larger global batch, or BatchNormalization(synchronized=True) "
                "(the global batch's moments).",
                stacklevel=3,
            )

    def _tnt_callbacks(
        self, callbacks: Any, verbose: Any, mode: str, prepared: data.Prepared, **params: Any
    ) -> tuple[list, Any]:
        """This rank's callbacks and verbosity; the master asks the progress module for a view."""
        cbs = tnt_callbacks.prepare(list(callbacks or []))
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
        """Keras's fit with global batches split over ranks; returns the (global) History.

        A ``keras.callbacks.BackupAndRestore`` among the callbacks backs up on the master rank and
        resumes exactly (:mod:`tnt_notebook.keras.backup`)."""
        self._tnt_check_compiled("fit")
        callbacks, training_backup = backup.take_backup_callback(callbacks)
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
            fresh=training_backup is not None,
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
        if not self._tnt.weights_synced:
            self._tnt_sync_weights()
        resume_at = 0
        if training_backup is not None:
            point = training_backup.restore(self)
            history = training_backup.history = keras.callbacks.History()
            if point is not None:
                history.history = {k: list(v) for k, v in point.history.items()}
                backup.fast_forward(
                    train.dataset,
                    compat.keras_iterators(point.epoch - initial_epoch, steps_per_epoch),
                )
                initial_epoch, resume_at = point.epoch, point.step
            callbacks = [training_backup, *callbacks, history]
        cbs, verbose = self._tnt_callbacks(
            callbacks,
            verbose,
            "fit",
            train,
            epochs=epochs,
            steps=steps_per_epoch,
        )
        if os.environ.get("TNT_CHECK_REPLICAS") == "epoch":
            cbs = [*cbs, _ReplicaCheck()]
        self._tnt.validation_slices = None if val is None else val.global_batches
        self._tnt_slice_in_steps(train=train.global_batches, test=self._tnt.validation_slices)
        self._tnt_defer_updates()
        if self._tnt.deferred is not None:
            each_batch = any(_may_read_weights_between_steps(cb) for cb in cbs)
            cbs = [_ApplyPending(each_batch), *cbs]
        train_function = None
        if resume_at:  # the resumed epoch's steps before the backup are read, not trained on
            train_function = self.make_train_function()
            self.train_function = backup.skipping_steps(train_function, resume_at, self)
        with (
            allreduce_op.collective_call("fit"),
            progress.flushed_on_error(cbs),
            self._tnt_restored(train_function),
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
        if training_backup is not None:  # with the epochs before the backup
            history = training_backup.history
        self._tnt_finish_fit()
        return history

    @contextlib.contextmanager
    def _tnt_discarding_pending(self) -> Iterator[None]:
        """A fit that fails leaves no update pending (its collectives are abandoned)."""
        try:
            yield
        except BaseException:
            if self._tnt.deferred is not None:
                self._tnt.deferred.discard()
            raise

    @contextlib.contextmanager
    def _tnt_restored(self, train_function: Any) -> Iterator[None]:
        """Give Keras's train function back after a resumed fit."""
        try:
            yield
        finally:
            if train_function is not None and self.train_function is not train_function:
                self.train_function = train_function

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
        self._tnt_ensure_built(prepared.dataset, targets=mode == "evaluate")
        if not self._tnt.weights_synced:
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
        gather = tnt_distribute_dataset and ranks.get_size() > 1
        sizes = _PredictSizes()
        spe = self.steps_per_execution
        if gather and spe != 1:  # one size per global batch is needed to restore the order
            self.steps_per_execution = 1
            self.predict_function = None
        try:
            with progress.flushed_on_error(cbs):
                local = super().predict(
                    prepared.dataset,
                    verbose=verbose,
                    steps=steps,
                    callbacks=[*cbs, sizes] if gather else cbs,
                )
        finally:
            if gather and spe != 1:
                self.steps_per_execution = spe
                self.predict_function = None
        if not gather:
            return local
        return _gather_in_order(local, sizes.sizes)


def _dense_gradient(gradient: Any, weight: Any, optimizer: Any) -> tf.Tensor:
    """``gradient`` as a dense tensor of ``weight``'s static shape (zeros where it is None;
    TensorFlow leaves some gradients' shapes unknown, the fusion plan needs them)."""
    if gradient is None:
        return tf.zeros(weight.shape, weight.dtype)
    if sparse_gradients.gathered_as_slices(gradient, optimizer):  # (a deferred update's)
        warnings.warn(
            f"tnt: the gradient of {weight.path} is sparse (an Embedding's): with "
            "TNT_OVERLAP=steps it is reduced over the ranks as a dense tensor, and "
            f"{type(optimizer).__name__} updates from a dense gradient differently than from "
            "serial Keras's sparse one, so training differs from serial Keras (SGD is exact).",
            stacklevel=2,
        )
    gradient = tf.convert_to_tensor(gradient)
    gradient.set_shape(weight.shape)
    return gradient


def _flattened(logs: dict) -> dict:
    """A step's logs with nested dicts (``CompileMetrics.result()``) flattened, as Keras flattens
    them for callbacks and the History."""
    flat = {}
    for key, value in logs.items():
        flat |= _flattened(value) if isinstance(value, dict) else {key: value}
    return flat


def _divided(gradient: Any, divisor: tf.Tensor) -> Any:
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values / tf.cast(divisor, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient / tf.cast(divisor, gradient.dtype)


def _update_divisor(stat: tf.Tensor, global_n: tf.Tensor | None) -> tf.Tensor:
    """What divides the reduced gradients: ``N = stat[0]``, or 1 where the step weighed its loss
    by ``n_r / N`` already (``global_n``)."""
    return tf.ones_like(stat[0]) if global_n is not None else stat[0]


class Sequential(Model, keras.Sequential):
    """Tarantella's ``tnt.Sequential``: ``keras.Sequential`` trained data-parallel (a
    ``tnt.Model``); ``tnt.Model(keras.Sequential(...))`` gives the same."""

    _tnt_base = keras.Sequential


_VIEW_CLASSES[keras.Sequential] = Sequential


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

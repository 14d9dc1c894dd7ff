"""The data-parallel train and test steps of ``tnt.Model``, and their reduction over the ranks.

On one rank a step is Keras's own. On more, each rank computes on its micro-batch and the step
reduces what Keras computes (gradients weighted by the rank's sample count, metric states, the
loss's own normaliser) through the fused allreduce (:mod:`allreduce_op`), so that the update and
the metrics are serial Keras's on the global batch.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tnt_notebook.keras import (
    allreduce_op,
    compat,
    data,
    distributed_optimizer,
    global_loss,
    reproducible,
    sparse_gradients,
    synchronized_moments,
    timeline_recorder,
)
from tnt_notebook.keras.step_metrics import StepMetrics
from tnt_notebook.rank import api as ranks
from tnt_notebook.rank import timeline


class Steps:
    """``tnt.Model``'s ``train_step`` and ``test_step`` (a mixin before the Keras model class, as
    Keras's own trainers are)."""

    @contextlib.contextmanager
    def _tnt_tracing_step(self) -> Iterator[None]:
        """Around tracing one of our steps: calling the model under a tape is ours, and random
        draws (dropout, noise) differ between ranks, as they differ between the samples of a
        serial batch (rank 0 draws what serial Keras draws)."""
        state = self._tnt
        outer, state.in_step = state.in_step, True
        # (reproducible steps draw from each chunk's own stream, whichever rank holds it)
        offset = 0 if state.reproducible is not None else ranks.get_rank()
        try:
            with compat.random_draws_offset(offset):
                yield
        finally:
            state.in_step = outer

    def _tnt_in_order(self) -> allreduce_op.InOrder:
        """A step's order of collectives, reducing as the world agreed, with this model's
        fusion plans."""
        return allreduce_op.InOrder(allreduce_op.prepare(), self._tnt.reducers)

    def _tnt_overrides(self, method: str) -> bool:
        """Whether the wrapped model's class brings its own ``method`` (``train_step``, ...)."""
        return getattr(self._tnt_base, method) is not getattr(keras.Model, method)

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

    def _tnt_defer_updates(self) -> None:
        """Before a fit's steps are traced: whether they leave their gradient buckets to the next
        step (:class:`allreduce_op.DeferredReduction`), with the variables that carry them over."""
        state = self._tnt
        reduction = allreduce_op.prepare()
        deferred = None
        if reduction.defers_updates(self) and not self._tnt_overrides("train_step"):
            specs = [
                (tuple(w.shape), state.compression.wire_dtype(tf.as_dtype(w.dtype)))
                for w in reversed(self.trainable_weights)
            ]
            deferred = state.deferred
            if deferred is None or deferred.specs != specs:
                reducer = allreduce_op.fusion_plan(state.reducers, "train", specs)
                deferred = allreduce_op.DeferredReduction(reduction.library, reducer, specs)
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

    def _tnt_slice(self, batch: Any, chunk: int = 1) -> Any:
        """This rank's micro-batch of a global batch; while a reproducibility report trains on
        the master rank alone (:mod:`reproducibility_report`), all of it there, none elsewhere."""
        rank, size = ranks.get_rank(), ranks.get_size()
        if self._tnt.master_alone:
            rank, size = min(rank, 1), 1  # (rank 1 of 1: the empty slice past the end)
        return data.slice_global_batch(batch, rank, size, chunk)

    def _tnt_local_batch(self, batch: Any, sliced: bool) -> tuple[Any, Any, Any, tf.Tensor]:
        if sliced:
            batch = self._tnt_slice(batch)
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
            if self._tnt.reproducible is not None:
                return reproducible.train_step(self, data, self._tnt.slice_train)
            if ranks.get_size() == 1:
                return super().train_step(data)
            if self._tnt_overrides("train_step"):
                return self._tnt_own_step(super().train_step, data, self._tnt.slice_train)
            deferred = self._tnt.deferred
            in_order = self._tnt_in_order()
            library = in_order.reduction.library
            data = _marked(library, timeline.BATCH_READY, data)
            if deferred is not None:  # (only once this step's batch exists: at the end of the
                # data the step fails in fetching it, and nothing may have been finished then)
                applied = deferred.apply_pending(self._tnt_apply_update, tf.nest.flatten(data))
                in_order.after = [applied]
            x, y, sample_weight, n = self._tnt_local_batch(data, self._tnt.slice_train)
            with tf.GradientTape() as tape:
                with synchronized_moments.over_ranks(in_order.summing("batch moments")):
                    y_pred = compat.call_model(self, x, training=True)
                metrics = StepMetrics(self, n, y, y_pred)
                with global_loss.shares(n, in_order.summing("loss normaliser")) as shares:
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
            grads = in_order.reduction.zeros_unless(n > 0, grads)
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            wire = list(reversed(self._tnt.compression.compress(grads)))
            stat = metrics.local_contribution()
            if deferred is None:
                reduced = in_order.sum_over_ranks("train", [stat, *wire])
                stat = reduced[0]
                gathered = {i: sparse_gradients.gather(g, in_order) for i, g in slices.items()}
                self._tnt_apply_update(reduced[1:], _update_divisor(stat, global_n), gathered)
                timeline_recorder.mark(library, timeline.UPDATED, _updated(weights))
            else:  # the metrics' bucket starts first and finishes in this step
                reducer = in_order.plan("train metrics", [stat])
                (ticket,) = allreduce_op.start_buckets(library, reducer, [stat], in_order.after)
                tickets = allreduce_op.start_buckets(library, deferred.reducer, wire, [ticket])
                (stat,) = allreduce_op.finish_buckets(library, reducer, [ticket], [stat], tickets)
                deferred.keep(wire, tickets, _update_divisor(stat, global_n))
            metrics.finish(stat)
            return self.get_metrics_result()

    def test_step(self, data: Any) -> Any:
        """Keras's step on 1 rank; on more, metric states are reduced as in :meth:`train_step`."""
        with self._tnt_tracing_step():
            if self._tnt.reproducible is not None:
                return reproducible.test_step(self, data, self._tnt.slice_test)
            if ranks.get_size() == 1:
                return super().test_step(data)
            if self._tnt_overrides("test_step"):
                return self._tnt_own_step(super().test_step, data, self._tnt.slice_test)
            in_order = self._tnt_in_order()
            x, y, sample_weight, n = self._tnt_local_batch(data, self._tnt.slice_test)
            y_pred = compat.call_model(self, x, training=False)
            metrics = StepMetrics(self, n, y, y_pred)
            with global_loss.shares(n, in_order.summing("loss normaliser")):
                loss = compat.compute_loss(self, x, y, y_pred, sample_weight, training=False)
            compat.loss_tracker(self).update_state(compat.unscale_loss(loss), sample_weight=n)
            self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)
            stat = metrics.local_contribution()
            (stat,) = in_order.sum_over_ranks("test", [stat])
            metrics.finish(stat)
            return self.get_metrics_result()

    def predict_step(self, data: Any) -> Any:
        """Keras's step (or the model's own); a reproducible model's computes chunk by chunk."""
        if self._tnt.reproducible is not None and not self._tnt_overrides("predict_step"):
            return reproducible.predict_step(self, data)
        return super().predict_step(data)

    def _tnt_own_step(self, step: Any, batch: Any, sliced: bool) -> Any:
        """A model's own step on this rank's micro-batch: every ``optimizer.apply`` in it reduces
        its gradients first (:mod:`distributed_optimizer`), Keras's losses are this rank's shares
        of the global ones (:mod:`global_loss`), and the metric states it updates are summed over
        the ranks, those of a ``Mean`` updated once per batch (``tracker.update_state(loss)``)
        weighted ``n_r / N`` so that the global batch counts once. Values it returns that are no
        metric's result are averaged over the global batch."""
        if sliced:
            batch = self._tnt_slice(batch)
        n = tf.shape(tf.nest.flatten(batch)[0])[0]
        in_order = self._tnt_in_order()
        metrics = StepMetrics(self, n)
        per_batch: list = []
        with (
            distributed_optimizer.reducing_in_apply(n, in_order),
            global_loss.shares(n, in_order.summing("loss normaliser")),
            synchronized_moments.over_ranks(in_order.summing("batch moments")),
            compat.per_batch_means(per_batch.append),
        ):
            logs = _flattened(step(batch))
        metrics.per_batch = {id(v) for m in per_batch for v in m.variables}
        own = {k: v for k, v in logs.items() if k not in self.get_metrics_result()}
        weighted = [tf.reshape(tf.cast(v, tf.float32), [-1]) * tf.cast(n, tf.float32)
                    for v in own.values()]  # fmt: skip
        weighted = [tf.where(n > 0, w, tf.zeros_like(w)) for w in weighted]  # (NaN of no rows)
        local = metrics.local_contribution()
        (stat,) = in_order.sum_over_ranks("own step", [tf.concat([local, *weighted], 0)])
        metrics.finish(stat[: local.shape[0]])
        results = self.get_metrics_result()
        offset = int(local.shape[0])
        for key, value in own.items():
            size = int(np.prod(value.shape))
            mean = stat[offset : offset + size] / stat[0]
            results[key] = tf.cast(tf.reshape(mean, value.shape), value.dtype)
            offset += size
        return {k: results[k] for k in logs}


def _updated(weights: list) -> list:
    """What exists once every weight is updated: the weights read after their updates, or, where
    they live on a GPU, one element of each added there into a scalar (the mark, a CPU op, then
    takes one number instead of a copy of the model each step)."""
    values = [w.value for w in weights]
    if not any("GPU" in v.device for v in values):
        return values
    firsts = [tf.reduce_sum(tf.cast(tf.reshape(v, [-1])[:1], tf.float32)) for v in values]
    return [tf.add_n(firsts)]


def _marked(library: Any, label: int, batch: Any) -> Any:
    """``batch``, its first tensor passed through the timeline's mark ``label``."""
    flat = tf.nest.flatten(batch)
    flat[:1] = timeline_recorder.mark(library, label, flat[:1])
    return tf.nest.pack_sequence_as(batch, flat)


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

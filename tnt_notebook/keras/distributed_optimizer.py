"""Gradients reduced inside ``optimizer.apply``, as Tarantella's and Horovod's distributed
optimizers reduce them: for a model's own ``train_step`` (GANs, VAEs: any number of optimizers,
each reducing its own gradients) and for custom training loops.

In a step of ``tnt.Model`` each rank's gradients are weighted by its sample count: the
update is ``sum(n_r g_r) / sum(n_r)``, the mean over the global batch also when micro-batches are
uneven. A custom loop's :func:`distributed_optimizer` weighs every rank alike (the mean of the
ranks' gradients): its micro-batches should be equal.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import keras
import tensorflow as tf

from tnt_notebook.keras import allreduce_op, compat, sparse_gradients
from tnt_notebook.rank import api as ranks


def reduce_gradients(
    optimizer: Any, grads: list, variables: list, n: Any, in_order: allreduce_op.InOrder
) -> list:
    """``sum(n_r g_r) / sum(n_r)`` over the ranks for each gradient (None stays None; sparse
    ones as :mod:`sparse_gradients` says)."""
    slices = {i for i, g in enumerate(grads) if sparse_gradients.gathered_as_slices(g, optimizer)}
    present = [i for i, g in enumerate(grads) if g is not None and i not in slices]
    count = tf.reshape(tf.cast(n, tf.float32), [1])
    weighted = []
    for i in present:
        dense = tf.convert_to_tensor(grads[i])
        dense.set_shape(variables[i].shape)
        weighted.append(dense * tf.cast(count[0], dense.dtype))
    tensors = [count, *weighted]
    summed = in_order.sum_over_ranks("optimizer.apply", tensors)
    out = list(grads)
    for i, g in zip(present, summed[1:], strict=True):
        out[i] = g / tf.cast(summed[0][0], g.dtype)
    for i in sorted(slices):
        weighted = tf.IndexedSlices(grads[i].values * tf.cast(count[0], grads[i].values.dtype),
                                    grads[i].indices, grads[i].dense_shape)  # fmt: skip
        gathered = sparse_gradients.gather(weighted, in_order)
        total = tf.cast(summed[0][0], gathered.values.dtype)
        out[i] = tf.IndexedSlices(gathered.values / total, gathered.indices, gathered.dense_shape)
    return out


class _Reducing:
    """What one step (or a distributed optimizer) reduces with; ``active`` while an ``apply``
    that already reduced runs (a LossScaleOptimizer applies through its inner optimizer)."""

    def __init__(self, n: Any, in_order: allreduce_op.InOrder):
        self.n, self.in_order, self.active = n, in_order, False

    def apply(self, keras_apply: Any, optimizer: Any, grads: Any, variables: Any) -> Any:
        if self.active:
            return keras_apply(optimizer, grads, variables)
        grads = list(grads)
        known = list(variables) if variables is not None else compat.optimizer_variables(optimizer)
        self.active = True
        try:
            grads = reduce_gradients(optimizer, grads, known, self.n, self.in_order)
            return keras_apply(optimizer, grads, variables)
        finally:
            self.active = False


@contextlib.contextmanager
def reducing_in_apply(n: Any, in_order: allreduce_op.InOrder) -> Iterator[None]:
    """While a model's own step traces: every optimizer's ``apply`` (and ``apply_gradients``)
    first reduces its gradients over the ranks, weighted by ``n``, this rank's samples."""
    reducing = _Reducing(n, in_order)
    with compat.optimizer_apply_wrapped(reducing.apply):
        yield


@functools.cache
def _loop_order() -> allreduce_op.InOrder:
    """The collectives of every distributed optimizer, in the order a loop's step applies them."""
    return allreduce_op.InOrder(allreduce_op.prepare(), {})


def distributed_optimizer(optimizer: keras.optimizers.Optimizer) -> keras.optimizers.Optimizer:
    """``optimizer``, whose ``apply`` and ``apply_gradients`` first average the gradients over all
    ranks: the one line a custom training loop (``tf.GradientTape``) needs. Call it on every rank;
    every rank must then apply its gradients in the same order."""
    if ranks.get_size() > 1:
        loop_order = _loop_order()
        reducing = _Reducing(1, loop_order)
        keras_apply = type(optimizer).apply

        def apply(grads: Any, trainable_variables: Any = None) -> Any:
            loop_order.forget_other_graphs()
            return reducing.apply(keras_apply, optimizer, grads, trainable_variables)

        object.__setattr__(optimizer, "apply", apply)
    return optimizer

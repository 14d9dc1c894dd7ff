"""Sparse gradients (an ``Embedding``'s ``tf.IndexedSlices``) reduced as slices.

Keras's optimizers other than SGD update from a sparse gradient differently than from its dense
sum: Adam, RMSprop and Adagrad square each slice, so rows that occur twice in a batch count as two
slices, not as one summed row. To give them what serial Keras gives them, every rank's slices are
gathered in rank order (as Horovod does with ``sparse_as_dense=False``): the global batch's
slices, in its order, since each rank holds a contiguous part of it. That costs three collectives
of the slices' own size through ``tf.numpy_function`` (their count differs per rank and step).
SGD (with or without momentum) updates from the dense sum exactly as from the slices, so there
sparse gradients join the dense fusion buckets, which are cheaper.
"""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tnt_notebook.keras import allreduce_op
from tnt_notebook.rank import api as ranks


def gathered_as_slices(gradient: Any, optimizer: Any) -> bool:
    """Whether ``gradient`` is reduced as slices for ``optimizer`` (else densely)."""
    inner = getattr(optimizer, "inner_optimizer", optimizer)  # (a LossScaleOptimizer's)
    return isinstance(gradient, tf.IndexedSlices) and not isinstance(inner, keras.optimizers.SGD)


def _concatenated(indices: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every rank's ``(indices, values)``, concatenated in rank order (every rank calls it)."""
    rank = ranks.get_rank()
    counts = np.zeros(ranks.get_size(), dtype=np.int64)
    counts[rank] = len(indices)
    counts = ranks.allreduce(counts, op="sum")
    start, total = int(counts[:rank].sum()), int(counts.sum())
    rows = slice(start, start + len(indices))
    all_indices = np.zeros(total, dtype=np.int64)
    all_indices[rows] = indices
    all_values = np.zeros((total, *values.shape[1:]), dtype=values.dtype)
    all_values[rows] = values  # (adding zeros leaves every value's bits as they were)
    return ranks.allreduce(all_indices, op="sum"), ranks.allreduce(all_values, op="sum")


def gather(slices: tf.IndexedSlices, in_order: allreduce_op.InOrder) -> tf.IndexedSlices:
    """The slices of every rank, in rank order, after ``in_order``'s collectives."""
    values = tf.convert_to_tensor(slices.values)
    with tf.control_dependencies(in_order.after):
        indices, gathered = tf.numpy_function(
            _concatenated,
            [tf.cast(slices.indices, tf.int64), values],
            Tout=[tf.int64, values.dtype],
            stateful=True,
            name="tnt_gather_slices",
        )
    indices.set_shape([None])
    gathered.set_shape([None, *values.shape[1:]])
    in_order.after = [indices, gathered]
    return tf.IndexedSlices(gathered, indices, slices.dense_shape)

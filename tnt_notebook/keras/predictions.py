"""``predict`` on many ranks: each rank's outputs of its micro-batches, put back in global order."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tnt_notebook.rank import api as ranks


class PredictSizes(keras.callbacks.Callback):
    """Records how many rows each local predict batch produced (to put the slices back in order)."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []

    def on_predict_batch_end(self, batch, logs=None):
        # Keras passes {"outputs": ...}, but flattens a dict of outputs into the logs themselves,
        # and turns an output of one element (one row) into a float
        first = tf.nest.flatten(list((logs or {}).values()))[0]
        self.sizes.append(1 if isinstance(first, float) else int(np.shape(first)[0]))


@contextlib.contextmanager
def one_step_per_execution(model: keras.Model) -> Iterator[None]:
    """One batch per call of Keras's predict function: :class:`PredictSizes` needs the size of
    every global batch's slice to restore the order."""
    steps_per_execution = model.steps_per_execution
    if steps_per_execution == 1:
        yield
        return
    model.steps_per_execution = 1
    model.predict_function = None
    try:
        yield
    finally:
        model.steps_per_execution = steps_per_execution
        model.predict_function = None


def gather_in_order(local: Any, sizes: list[int]) -> Any:
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

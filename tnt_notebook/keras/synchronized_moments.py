"""``BatchNormalization(synchronized=True)``: the batch's moments over all ranks.

Keras 3's switch for global batch statistics reduces the batch's sum, sum of squares and count
over the replicas of a ``tf.distribute`` strategy. Inside a step of ``tnt.Model`` the same three
sums travel through the engine instead (one small collective per layer, in the forward pass), and
the backward pass reduces their gradients likewise, so a model using it trains as serial Keras
does on the global batch. Layers without the switch keep their per-rank moments, as in Tarantella
(with a warning where micro-batches are small).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from tnt_notebook.keras import compat
from tnt_notebook.rank import api as ranks

#: Below this micro-batch size BatchNormalization statistics become noisy (Tarantella's warning).
BATCH_NORM_MIN_MICRO_BATCH = 16

#: ``sum_over_ranks(tensor) -> tensor``: a collective the step runs in order on every rank.
SumOverRanks = Callable[[tf.Tensor], tf.Tensor]


def _summed(local: tf.Tensor, sum_over_ranks: SumOverRanks) -> tf.Tensor:
    """``local`` summed over the ranks; its gradient likewise (every rank's loss depends on the
    sum, so each rank's part receives the gradient of all of them)."""

    @tf.custom_gradient
    def summed(t: tf.Tensor) -> Any:
        return sum_over_ranks(t), sum_over_ranks

    return summed(local)


def moments_over_ranks(sum_over_ranks: SumOverRanks) -> Callable[..., Any]:
    """Keras's synchronized moments (``E[x]`` and ``E[x^2] - E[x]^2``) of the global batch."""

    def moments(x: tf.Tensor, axes: Any, keepdims: bool) -> tuple[tf.Tensor, tf.Tensor]:
        parts = [
            tf.reduce_sum(x, axis=axes, keepdims=True),
            tf.reduce_sum(tf.square(x), axis=axes, keepdims=True),
            tf.reduce_sum(tf.ones_like(x), axis=axes, keepdims=True),
        ]
        shape = parts[0].shape
        total = _summed(tf.concat([tf.reshape(p, [-1]) for p in parts], 0), sum_over_ranks)
        y_sum, y_squared_sum, count = (tf.reshape(t, shape) for t in tf.split(total, 3))
        mean = tf.math.divide_no_nan(y_sum, count)
        variance = tf.maximum(tf.math.divide_no_nan(y_squared_sum, count) - tf.square(mean), 0.0)
        if not keepdims:
            mean, variance = tf.squeeze(mean, axes), tf.squeeze(variance, axes)
        return mean, variance

    return moments


@contextlib.contextmanager
def over_ranks(sum_over_ranks: SumOverRanks) -> Iterator[None]:
    """While a training step traces: synchronized BatchNormalization layers take the moments of
    the global batch."""
    with compat.synchronized_moments(moments_over_ranks(sum_over_ranks)):
        yield


def warn_if_noisy(model: keras.Model, global_batch: int | None, micro_batch: int | None) -> None:
    """Warn (as Tarantella does) where BatchNormalization layers without the switch would take
    their moments of fewer than :data:`BATCH_NORM_MIN_MICRO_BATCH` samples per rank."""
    micro = micro_batch
    if micro is None and global_batch is not None:
        micro = global_batch // ranks.get_size()
    if micro is None or micro >= BATCH_NORM_MIN_MICRO_BATCH:
        return
    if any(
        isinstance(layer, compat.BATCH_NORM_LAYERS) and not layer.synchronized
        for layer in compat.flatten_layers(model)
    ):
        warnings.warn(
            f"tnt: BatchNormalization with a micro-batch of {micro} samples per rank (< "
            f"{BATCH_NORM_MIN_MICRO_BATCH}): batch statistics are computed per rank and may be "
            "noisy; consider a larger global batch, or BatchNormalization(synchronized=True) "
            "(the global batch's moments).",
            stacklevel=3,
        )

"""Each rank's share of the loss that serial Keras computes on the global batch.

A data-parallel step backpropagates ``n_r / N`` times this rank's loss (``n_r`` its samples, ``N``
the global batch's), so that the reduced gradient is serial Keras's. That weighting is exact for a
loss that Keras divides by the batch's element count (a plain mean). For the others it is not:
``reduction="sum"`` divides by nothing, a masked mean by the count of unmasked elements and
``"mean_with_sample_weight"`` by the sum of the weights, each over the *global* batch. Here every
Keras loss reduction of a step is rewritten so that the rank's value, weighted ``n_r / N``, sums
over the ranks to serial Keras's value: ``value * (d_r * N) / (D * n_r)``, with ``d_r`` the
divisor Keras used on this rank (``compat.loss_divisor``) and ``D`` its sum over the ranks
(a sum: ``value * N / n_r``).
Losses that need it cost the step one small collective each (``[n_r, d_r]``, or ``n_r``), before
backprop.

Regularisation losses and ``add_loss`` terms are taken as Keras takes them: means over the batch
(activity regularisers are divided by the batch size) or constants, which the same weighting
leaves exact. A ``compute_loss`` that a model overrides is weighted as a per-sample mean.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import tensorflow as tf

from tnt_notebook.keras import compat

#: ``sum_over_ranks(tensor) -> tensor``: a collective that the step runs in order on every rank.
SumOverRanks = Callable[[tf.Tensor], tf.Tensor]


class LossShares:
    """Within one step's trace: this rank's share of the global loss, and ``N`` when needed."""

    def __init__(self, n: tf.Tensor, sum_over_ranks: SumOverRanks):
        self.n = tf.cast(n, tf.float32)
        self._sum_over_ranks = sum_over_ranks
        self._global_n: tf.Tensor | None = None

    def _reduced(self, values: list) -> tf.Tensor:
        summed = self._sum_over_ranks(tf.stack(values))
        if self._global_n is None:
            self._global_n = summed[0]
        return summed

    def global_count(self) -> tf.Tensor:
        """``N``, the global batch's sample count (a collective the first time a step asks)."""
        if self._global_n is None:
            self._reduced([self.n])
        return self._global_n

    def rewrite(self, value: Any, divisor: Any) -> Any:
        """Keras's reduced ``value`` of one loss as this rank's weighted share of the global one."""
        if divisor is compat.PER_ELEMENT:
            return value
        if divisor is compat.UNDIVIDED:
            factor = tf.math.divide_no_nan(self.global_count(), self.n)
        else:
            summed = self._reduced([self.n, tf.cast(divisor, tf.float32)])
            factor = tf.math.divide_no_nan(
                tf.cast(divisor, tf.float32) * summed[0], summed[1] * self.n
            )
        return value * tf.cast(factor, value.dtype)


@contextlib.contextmanager
def shares(n: tf.Tensor, sum_over_ranks: SumOverRanks) -> Iterator[LossShares]:
    """Around a step's ``compute_loss``: Keras's losses come out as this rank's shares."""
    loss_shares = LossShares(n, sum_over_ranks)
    with compat.rewritten_loss_reductions(loss_shares.rewrite):
        yield loss_shares

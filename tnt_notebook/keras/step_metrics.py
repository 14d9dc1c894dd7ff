"""A step's metric states as contributions that add up over the ranks (and over a reproducible
step's chunks)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tnt_notebook.keras import compat


class StepMetrics:
    """Metric states over all ranks, exact from the first step, however often TensorFlow traces.

    Made after the forward pass, when Keras can build its compiled metrics and losses (it builds
    them lazily, at their first update): every metric state variable is saved and zeroed, so the
    local updates leave exactly this rank's contribution in it. The contributions travel with the
    gradients, summed over the ranks, and each state becomes ``saved + global contribution``. A
    variable created during the step (a metric that user code builds on first use) held zero
    before it (TensorFlow traces the step again after a trace that created variables). Metrics
    that Keras updates once per batch (each output's loss) contribute ``n_r * local / n``, so the
    global batch counts once, as in serial Keras. A reproducible step zeroes the states again
    before each chunk (:meth:`zero`) and takes each chunk's contribution apart.
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
        self.variables: list = variables

    @property
    def width(self) -> int:
        """The length of a contribution (of the states known now)."""
        return 1 + sum(int(np.prod(v.shape)) for v in self.variables)

    def zero(self) -> None:
        """Start a contribution afresh (a reproducible step's next chunk)."""
        for v in self.variables:
            v.assign(tf.zeros(v.shape, v.dtype))

    def local_contribution(self, n: tf.Tensor | None = None) -> tf.Tensor:
        """``[n, every metric state]`` of this rank's micro-batch (or of a chunk of ``n``
        samples; zero for no samples)."""
        n = self.n if n is None else n
        self.variables = compat.metric_variables(self.model)
        count = tf.cast(n, tf.float32)
        parts = [tf.reshape(count, [1])]
        for v in self.variables:
            value = tf.reshape(tf.cast(v.value, tf.float32), [-1])
            parts.append(value * count if id(v) in self.per_batch else value)
        stat = tf.concat(parts, 0)
        return tf.where(n > 0, stat, tf.zeros_like(stat))

    def finish(self, global_contribution: tf.Tensor) -> None:
        """Each state becomes what it held before the step plus the global contribution."""
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

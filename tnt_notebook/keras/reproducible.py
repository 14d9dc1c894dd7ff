"""Reproducible training: the same bits on any number of ranks (``tnt.Model(model,
reproducible=True)``, or ``TNT_REPRODUCIBLE=1``).

Each global batch is cut into chunks of ``chunk_size`` samples at the same places whatever the
number of ranks, and every rank takes whole chunks. A rank computes each of its chunks on its own,
as a batch of its own (TensorFlow computes a fixed shape alike everywhere, given the same threads
and ``TF_DETERMINISTIC_OPS``), its random draws (dropout, noise) from the chunk's own stream; it
never adds the chunks' results in floating point. Every chunk's gradient and metric contributions
are added exactly over all chunks of all ranks (values on a grid set by the largest magnitude of
each tensor over all chunks, agreed by a small collective; integers summed by an int64 allreduce,
whose result depends on no order), so the update, the loss and every metric are the same bits for
1 rank or 64, whatever path or transport each collective takes.

The gradient applied is ``sum_c n_c g_c / sum_c n_c``, ``g_c`` the gradient of the loss of chunk
``c`` as Keras computes it on a batch of ``n_c`` samples: serial Keras's gradient on the global
batch up to rounding, for losses that are means over samples. Layers that keep statistics
(``BatchNormalization``) compute them per chunk, as on a batch of the chunk's samples, and their
moving statistics take the mean of the chunks' updates, added exactly. ``predict`` computes chunk
by chunk too. Models with their own ``train_step`` or ``test_step`` are refused with a clear
error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from tnt_notebook.keras import compat
from tnt_notebook.keras.step_metrics import StepMetrics
from tnt_notebook.rank import api as ranks

#: Samples per chunk unless ``tnt.Model(..., chunk_size=)`` says otherwise.
DEFAULT_CHUNK_SIZE = 16
#: Bits each tensor keeps below its largest magnitude over the chunks (float32 has 24).
GRID_BITS = 42
#: An exponent below every float's: the group holds zeros only (or this rank has no chunk).
_NONE = -(1 << 20)
#: The exponent of a group with a non-finite value: its sum is NaN.
_NON_FINITE = 1 << 20
#: A chunk's random stream: the chunk's index in the seed's first word (above the layer's own
#: 32-bit seed, so no two layers' or chunks' streams meet); each step moves the second word on by
#: _STEP_STREAM (room for that many draws of one layer in one chunk).
_CHUNK_STREAM = 1 << 32
_STEP_STREAM = 1 << 16


@dataclass(frozen=True)
class Chunks:
    """How a reproducible model cuts its global batches."""

    size: int

    def __post_init__(self) -> None:
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 1:
            raise ValueError(f"chunk_size must be a positive integer, got {self.size!r}")


def check_model(model: keras.Model) -> None:
    """A clear error for what the reproducible mode does not cover."""
    if model._tnt_overrides("train_step") or model._tnt_overrides("test_step"):
        raise ValueError(
            "tnt.Model(reproducible=True) runs its own steps: a model with its own train_step "
            "or test_step cannot be trained reproducibly"
        )


def train_step(model: keras.Model, batch: Any, sliced: bool) -> dict:
    """One reproducible training step on this rank's chunks (``sliced``: ``batch`` is global)."""
    chunks = model._tnt.reproducible
    if compat.scales_loss(model.optimizer):
        raise ValueError(
            "tnt.Model(reproducible=True) does not support loss scaling (mixed_float16): the "
            "scale's updates would follow the chunks' order"
        )
    x, y, sample_weight, mine = _my_chunks(model, batch, sliced, chunks.size)
    weights = model.trainable_weights
    metrics = _chunk_metrics(model, x, y, mine)
    generators = _seed_generators(model)
    start = [tf.identity(g.state.value) for g in generators]
    statistics = _Statistics(model)

    def one_chunk(j, grads_out, stats_out, moved_out):
        for g, s in zip(generators, start, strict=True):
            g.state.assign(s + tf.constant([_CHUNK_STREAM, 0], tf.int64) * (mine.first + j))
        statistics.rewind()
        xc, yc, wc = _chunk(x, y, sample_weight, j, chunks.size)
        n = tf.shape(tf.nest.flatten(xc)[0])[0]
        metrics.zero()
        with tf.GradientTape() as tape:
            y_pred = compat.call_model(model, xc, training=True)
            loss = compat.compute_loss(model, xc, yc, y_pred, wc, training=True)
            compat.loss_tracker(model).update_state(loss, sample_weight=n)
            scaled = loss * tf.cast(n, loss.dtype)  # gradients come out as n_c * g_c
        grads = tape.gradient(scaled, weights)
        grads = [tf.zeros(w.shape, w.dtype) if g is None else tf.convert_to_tensor(g) for g, w
                 in zip(grads, weights, strict=True)]  # fmt: skip
        model.compute_metrics(xc, yc, y_pred, sample_weight=wc)
        at = tf.cast(j, tf.int32)
        grads_out = [ta.write(at, g) for ta, g in zip(grads_out, grads, strict=True)]
        stats_out = stats_out.write(at, metrics.local_contribution(n))
        return j + 1, grads_out, stats_out, moved_out.write(at, statistics.moved())

    _, grads_ta, stats_ta, moved_ta = tf.while_loop(
        lambda j, *_: j < mine.count,
        one_chunk,
        (
            tf.constant(0, tf.int64),
            [_stack(w.shape, w.dtype) for w in weights],
            _stack([metrics.width], tf.float32),
            _stack([statistics.width], tf.float32),
        ),
    )
    for g, s in zip(generators, start, strict=True):  # one step advances every stream alike
        g.state.assign(s + tf.constant([0, _STEP_STREAM], tf.int64))
    groups = [stats_ta.stack(), moved_ta.stack(), *[t.stack() for t in grads_ta]]
    stats, moved, *grads = exact_sum_over_ranks(model, groups)
    statistics.finish(moved, mine.total)
    n = stats[0]
    model.optimizer.apply_gradients(
        [(g / tf.cast(n, g.dtype), w) for g, w in zip(grads, weights, strict=True)]
    )
    metrics.finish(stats)
    return model.get_metrics_result()


def test_step(model: keras.Model, batch: Any, sliced: bool) -> dict:
    """One reproducible evaluation step: each chunk's metric contributions, added exactly."""
    chunks = model._tnt.reproducible
    x, y, sample_weight, mine = _my_chunks(model, batch, sliced, chunks.size)
    metrics = _chunk_metrics(model, x, y, mine)

    def one_chunk(j, stats_out):
        xc, yc, wc = _chunk(x, y, sample_weight, j, chunks.size)
        n = tf.shape(tf.nest.flatten(xc)[0])[0]
        metrics.zero()
        y_pred = compat.call_model(model, xc, training=False)
        loss = compat.compute_loss(model, xc, yc, y_pred, wc, training=False)
        compat.loss_tracker(model).update_state(loss, sample_weight=n)
        model.compute_metrics(xc, yc, y_pred, sample_weight=wc)
        return j + 1, stats_out.write(tf.cast(j, tf.int32), metrics.local_contribution(n))

    _, stats_ta = tf.while_loop(
        lambda j, _: j < mine.count,
        one_chunk,
        (tf.constant(0, tf.int64), _stack([metrics.width], tf.float32)),
    )
    (stats,) = exact_sum_over_ranks(model, [stats_ta.stack()])
    metrics.finish(stats)
    return model.get_metrics_result()


def predict_step(model: keras.Model, batch: Any) -> Any:
    """The outputs of this rank's slice chunk by chunk, each computed as a batch of its own (a
    sample's output can depend on the shape of the batch it is computed in)."""
    size = model._tnt.reproducible.size
    x, _, _ = compat.unpack_x_y_sample_weight(batch)
    n = tf.shape(tf.nest.flatten(x)[0], out_type=tf.int64)[0]
    structure = compat.call_model(model, _rows(x, 0, 0), training=False)
    outputs = tf.nest.flatten(structure)

    def one_chunk(j, out):
        xc = _rows(x, j * size, (j + 1) * size)
        found = tf.nest.flatten(compat.call_model(model, xc, training=False))
        return j + 1, [ta.write(tf.cast(j, tf.int32), o) for ta, o in zip(out, found, strict=True)]

    _, out = tf.while_loop(
        lambda j, _: j < (n + size - 1) // size,
        one_chunk,
        (tf.constant(0, tf.int64), [_stack(o.shape[1:], o.dtype, rows=True) for o in outputs]),
    )
    return tf.nest.pack_sequence_as(structure, [ta.concat() for ta in out])


class _Statistics:
    """The moving statistics of the ``BatchNormalization`` layers that train: every chunk starts
    from the step's values, and the step moves them by the mean of the chunks' moves (each
    chunk's statistics as those of a batch of its own, the moves added exactly)."""

    def __init__(self, model: keras.Model):
        self.variables = [
            v
            for layer in model._flatten_layers(include_self=False)
            if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable
            for v in (layer.moving_mean, layer.moving_variance)
        ]
        self.start = [tf.identity(v.value) for v in self.variables]
        self.width = sum(int(np.prod(v.shape)) for v in self.variables)

    def rewind(self) -> None:
        for v, s in zip(self.variables, self.start, strict=True):
            v.assign(s)

    def moved(self) -> tf.Tensor:
        """How far this chunk moved every statistic, flat."""
        moves = [tf.reshape(tf.cast(v.value - s, tf.float32), [-1])
                 for v, s in zip(self.variables, self.start, strict=True)]  # fmt: skip
        return tf.concat([*moves, tf.zeros([0], tf.float32)], 0)

    def finish(self, moved: tf.Tensor, chunks: tf.Tensor) -> None:
        offset = 0
        for v, s in zip(self.variables, self.start, strict=True):
            size = int(np.prod(v.shape))
            mean = tf.reshape(moved[offset : offset + size], v.shape) / tf.cast(chunks, tf.float32)
            v.assign(s + tf.cast(mean, v.dtype))
            offset += size


def _chunk_metrics(model: keras.Model, x: Any, y: Any, mine: _MyChunks) -> StepMetrics:
    """The step's metric states, built from a forward pass of no rows (no cost), saved and
    zeroed before the chunks."""
    y_pred = compat.call_model(model, _rows(x, 0, 0), training=False)
    return StepMetrics(model, mine.count, _rows(y, 0, 0), y_pred)


def exact_sum_over_ranks(model: keras.Model, groups: list[tf.Tensor]) -> list[tf.Tensor]:
    """The sum over every chunk of every rank of each group (this rank's chunks stacked on the
    leading axis), the same bits for any number of ranks (see
    :mod:`tnt_notebook.rank.exact_sum`, whose in-graph twin this is)."""
    size, rank = ranks.get_size(), ranks.get_rank()
    in_order = model._tnt_in_order()
    exponents = tf.stack([_exponent(g) for g in groups])  # [G]
    mine = tf.one_hot(rank, size, dtype=tf.int64)[:, None] * (exponents - _NONE)[None, :]
    (agreed,) = in_order.sum_over_ranks("exact sum exponents", [tf.reshape(mine, [-1])])
    exponents = tf.reduce_max(tf.reshape(agreed, [size, len(groups)]), axis=0) + _NONE
    on_grid = [tf.reshape(_on_grid(g, exponents[i]), [-1]) for i, g in enumerate(groups)]
    (summed,) = in_order.sum_over_ranks("exact sum", [tf.concat(on_grid, 0)])
    out, offset = [], 0
    for i, g in enumerate(groups):
        count = int(g.shape[1:].num_elements())
        part = tf.cast(summed[offset : offset + count], tf.float64) * _power_of_two(
            tf.clip_by_value(exponents[i], -1000, 1000) - GRID_BITS
        )
        part = tf.where(exponents[i] >= _NON_FINITE, tf.constant(float("nan"), tf.float64), part)
        out.append(tf.reshape(tf.cast(part, g.dtype), g.shape[1:]))
        offset += count
    return out


def _exponent(group: tf.Tensor) -> tf.Tensor:
    """e with ``max |group| < 2**e`` (frexp's), read from the bits: _NONE for zeros or nothing,
    _NON_FINITE where a value is not finite."""
    values = tf.cast(tf.reshape(group, [-1]), tf.float64)
    largest = tf.reduce_max(tf.concat([tf.abs(values), tf.zeros([1], tf.float64)], 0))
    bits = tf.bitcast(largest, tf.int64)
    e = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, 52), 0x7FF) - 1022
    e = tf.where(largest > 0, e, tf.constant(_NONE, tf.int64))
    return tf.where(tf.math.is_finite(largest), e, tf.constant(_NON_FINITE, tf.int64))


def _power_of_two(k: tf.Tensor) -> tf.Tensor:
    """``2.0**k`` in float64, built from its bits (exact; -1022 <= k <= 1023)."""
    return tf.bitcast(tf.bitwise.left_shift(tf.cast(k, tf.int64) + 1023, 52), tf.float64)


def _on_grid(group: tf.Tensor, exponent: tf.Tensor) -> tf.Tensor:
    """This rank's chunks of one group summed as integers in units of ``2**(exponent -
    GRID_BITS)``: each chunk rounded on its own (so whichever rank holds it), then added
    exactly."""
    usable = tf.logical_and(exponent > _NONE, exponent < _NON_FINITE)
    scale = _power_of_two(tf.where(usable, GRID_BITS - exponent, tf.zeros_like(exponent)))
    values = tf.where(usable, tf.cast(group, tf.float64) * scale, tf.zeros_like(group, tf.float64))
    return tf.reduce_sum(tf.cast(tf.round(values), tf.int64), axis=0)


@dataclass(frozen=True)
class _MyChunks:
    count: tf.Tensor  # this rank's
    first: tf.Tensor  # the global index of this rank's first
    total: tf.Tensor  # over all ranks


def _my_chunks(model: keras.Model, batch: Any, sliced: bool, chunk: int) -> tuple:
    """This rank's samples (whole chunks) and where its chunks lie among all ranks'. Where
    ``batch`` is global this rank slices its chunks; otherwise they came sliced, and one small
    collective tells every rank where its chunks lie."""
    size, rank = ranks.get_size(), ranks.get_rank()
    if sliced and size > 1:
        batch = model._tnt_slice(batch, chunk)
    x, y, sample_weight = compat.unpack_x_y_sample_weight(batch)
    n = tf.shape(tf.nest.flatten(x)[0], out_type=tf.int64)[0]
    count = (n + chunk - 1) // chunk
    counts = tf.one_hot(rank, size, dtype=tf.int64) * count
    (counts,) = model._tnt_in_order().sum_over_ranks("chunks per rank", [counts])
    mine = _MyChunks(count, tf.reduce_sum(counts[:rank]), tf.reduce_sum(counts))
    return x, y, sample_weight, mine


def _chunk(x: Any, y: Any, sample_weight: Any, j: tf.Tensor, chunk: int) -> tuple:
    lo = j * chunk
    return tuple(_rows(part, lo, lo + chunk) for part in (x, y, sample_weight))


def _rows(part: Any, lo: Any, hi: Any) -> Any:
    return tf.nest.map_structure(lambda t: None if t is None else t[lo:hi], part)


def _stack(shape: Any, dtype: Any, rows: bool = False) -> tf.TensorArray:
    """A growing array of one tensor per chunk (``rows``: of a chunk's rows each, to concat)."""
    if rows:
        shape = tf.TensorShape([None]).concatenate(shape)
    return tf.TensorArray(
        dtype, size=0, dynamic_size=True, element_shape=shape, infer_shape=not rows
    )


def _seed_generators(model: keras.Model) -> list:
    """The seed generators of the model's layers (dropout, noise, ...)."""
    found = []
    for layer in model._flatten_layers(include_self=True):
        found += [g for g in getattr(layer, "_seed_generators", []) if g not in found]
    return found

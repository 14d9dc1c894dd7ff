"""Global batches -> per-rank micro-batches.

Every rank sees the same sequence of global batches and keeps the contiguous slice ``[r*n//p,
(r+1)*n//p)`` of each, so the ranks together process every sample exactly once and a rank's sample
count is known from ``n`` alone (the exact global mean needs no padding, also when ``n % p`` is not
0 or the last batch is short).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from tnt_notebook import ranks
from tnt_notebook.keras import compat

#: Fixed shuffle seed used when TensorFlow has no global seed: every rank must shuffle alike.
DEFAULT_SHUFFLE_SEED = 20260421


def micro_batch_bounds(n: int, size: int, rank: int) -> tuple[int, int]:
    """The contiguous slice of a global batch of ``n`` samples that ``rank`` processes."""
    return rank * n // size, (rank + 1) * n // size


def shuffle_seed() -> int:
    """The master rank's choice (collective): TensorFlow's global seed if set, else a fixed default.

    Broadcast, so ranks shuffle alike even when their global seeds differ.
    """
    from tensorflow.python.framework import random_seed

    seed, _ = random_seed.get_seed(None)
    seed = int(seed) if seed is not None else DEFAULT_SHUFFLE_SEED
    return int(ranks.broadcast(seed)) if ranks.get_size() > 1 else seed


@dataclass
class Prepared:
    """A dataset ready for Keras on this rank, and what we learnt about its global batches."""

    dataset: Any
    global_batch_size: int | None
    num_samples: int | None = None
    #: The dataset yields global batches, and the train / test step slices this rank's part.
    global_batches: bool = False

    def __post_init__(self) -> None:
        if ranks.get_size() > 1:
            self.dataset = without_autotune_model(self.dataset)

    def steps(self) -> int | None:
        """Batches per epoch when TensorFlow knows it (for progress displays)."""
        n = int(self.dataset.cardinality())
        return n if n >= 0 else None


def without_autotune_model(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """The dataset with tf.data's autotuning model off, for worlds of more than one rank.

    Keras creates and destroys an iterator per epoch (and per evaluate/predict call); destroying
    one waits for the autotuning model thread, and while the other ranks keep the cores busy that
    wait took 0.3-0.5 s per epoch in our fit benchmark (half the time of a short epoch). Without
    the model, AUTOTUNE parallelism falls back to tf.data's default (all cores) and prefetch
    buffers keep their own tuning.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return dataset.with_options(options)


def slice_global_batch(batch: Any, rank: int, size: int) -> Any:
    """This rank's micro-batch of a global batch (any nest of tensors), in graph ops."""
    n = tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int64)[0]
    lo, hi = rank * n // size, (rank + 1) * n // size
    return tf.nest.map_structure(lambda t: t[lo:hi], batch)


def _slice_batch(rank: int, size: int):
    def slice_elem(*elem):
        out = slice_global_batch(elem, rank, size)
        return out if len(elem) > 1 else out[0]

    return slice_elem


def check_batch_sizes(
    global_batch: int | None, micro_batch: int | None, size: int, what: str = "batch"
) -> None:
    """ValueError for a global batch smaller than the rank count or an inconsistent micro-batch."""
    if micro_batch is not None and (not isinstance(micro_batch, int) or micro_batch <= 0):
        raise ValueError(f"tnt_micro_batch_size must be a positive integer, got {micro_batch!r}")
    if global_batch is None:
        return
    if global_batch < size:
        raise ValueError(
            f"The global {what} size ({global_batch}) is smaller than the number of ranks "
            f"({size}): "
            "every rank needs at least one sample per batch. Use a larger batch size."
        )
    if micro_batch is not None and not (
        global_batch // size <= micro_batch <= -(-global_batch // size)
    ):
        raise ValueError(
            f"tnt_micro_batch_size={micro_batch} is inconsistent with the global {what} size "
            f"{global_batch} on {size} ranks (expected {global_batch // size}"
            + (f" or {-(-global_batch // size)}" if global_batch % size else "")
            + ")."
        )


def distribute(
    dataset: tf.data.Dataset,
    *,
    micro_batch: int | None = None,
    what: str = "batch",
    in_step: bool = False,
) -> Prepared:
    """A batched dataset of global batches -> this rank's micro-batches (shuffles seeded alike).

    With ``in_step`` the dataset keeps yielding global batches and our train / test step slices
    them (:func:`slice_global_batch`): with a ``Dataset.map`` that slices, 2-rank training epochs
    at batch 256 took 5-11 % longer than on data sliced beforehand, with slicing in the step 2-3 %.
    """
    rank, size = ranks.get_rank(), ranks.get_size()
    global_batch, _ = compat.dataset_batch_size(dataset)
    check_batch_sizes(global_batch, micro_batch, size, what)
    if size == 1:
        return Prepared(dataset, global_batch)
    if _shuffles_may_differ(dataset):
        try:
            dataset = compat.seed_unseeded_shuffles(dataset, shuffle_seed(), also_seeded=True)
        except Exception as exc:  # noqa: BLE001 - any serialization failure: explain and go on
            warnings.warn(
                "tnt: the dataset has a shuffle whose seed differs between ranks (or no seed) and "
                f"could not be rebuilt with a common seed ({type(exc).__name__}: {exc}); ranks "
                "may shuffle differently. Set the same seed on every rank "
                "(Dataset.shuffle(seed=)).",
                stacklevel=3,
            )
    if in_step:
        return Prepared(dataset, global_batch, global_batches=True)
    return Prepared(dataset.map(_slice_batch(rank, size)), global_batch)


def _shuffles_may_differ(dataset: tf.data.Dataset) -> bool:
    """True if some shuffle is OS-seeded or seeded differently on some rank (collective)."""
    seeds = compat.shuffle_seeds(dataset)
    if not seeds:
        return False
    flat = np.array(seeds, dtype=np.int64).ravel()
    same = np.array_equal(ranks.allreduce(flat, op="min"), ranks.allreduce(flat, op="max"))
    return not same or any(s == (0, 0) for s in seeds)


def arrays_to_dataset(
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    *,
    batch_size: int | None,
    shuffle: bool | str = False,
    distribute_data: bool = True,
    micro_batch: int | None = None,
    what: str = "batch",
) -> Prepared:
    """NumPy/tensor inputs with a global batch size -> this rank's micro-batches.

    Rows are addressed through a dataset of index batches (shuffled with :func:`shuffle_seed` when
    ``shuffle`` is true, reshuffled every epoch, the same on all ranks); each rank slices its
    indices and gathers only its own rows.
    """
    rank, size = ranks.get_rank(), ranks.get_size()
    if batch_size is None:
        batch_size = 32 if micro_batch is None else micro_batch * size
    if not distribute_data:
        size, rank = 1, 0
    check_batch_sizes(batch_size, micro_batch if distribute_data else None, size, what)
    parts: tuple = (
        (x,) if y is None else ((x, y) if sample_weight is None else (x, y, sample_weight))
    )
    flat = [tf.convert_to_tensor(a) for a in tf.nest.flatten(parts)]
    n = int(flat[0].shape[0])
    index = tf.data.Dataset.range(n)
    if shuffle:
        seed = shuffle_seed()
        if shuffle == "batch":  # shuffle the order of whole batches (Keras shuffles within chunks)
            index = index.batch(batch_size).shuffle(-(-n // batch_size)).unbatch()
        else:
            index = index.shuffle(n)
        # op seeds mix in TensorFlow's global seed, which may differ per rank: pin both seeds
        index = compat.seed_unseeded_shuffles(index, seed, also_seeded=True)
    index = index.batch(batch_size)
    if size > 1:
        index = index.map(_slice_batch(rank, size))

    def gather(idx):
        packed = tf.nest.pack_sequence_as(parts, [tf.gather(t, idx) for t in flat])
        return packed if len(parts) > 1 else packed[0]

    ds = index.map(gather, num_parallel_calls=None).prefetch(tf.data.AUTOTUNE)
    return Prepared(ds, batch_size, n)


def with_class_weights(dataset: tf.data.Dataset, class_weight: dict) -> tf.data.Dataset:
    """``(x, y)`` batches -> ``(x, y, weight of each sample's class)``, as ``fit(class_weight=)``.

    Labels are class ids, or one-hot / probability rows (their argmax), as in Keras; classes
    missing from ``class_weight`` weigh 1.0 (as Keras does for NumPy inputs).
    """
    if not class_weight or any(not isinstance(c, (int, np.integer)) or c < 0 for c in class_weight):
        raise ValueError(
            f"class_weight must map class ids (integers >= 0) to weights, got {class_weight!r}"
        )
    table = tf.constant(
        [float(class_weight.get(c, 1.0)) for c in range(int(max(class_weight)) + 1)], tf.float32
    )

    def add_weights(*elem):
        x, y, sw = compat.unpack_x_y_sample_weight(elem)
        if sw is not None:
            raise ValueError("You cannot `class_weight` and `sample_weight` at the same time.")
        if y is None or tf.nest.is_nested(y):
            raise ValueError("`class_weight` needs a single target array `y` (one model output).")
        if y.shape.rank >= 2:
            classes = tf.cond(
                tf.shape(y)[-1] > 1,
                lambda: tf.argmax(y, axis=-1, output_type=tf.int32),
                lambda: tf.cast(tf.round(y[..., 0]), tf.int32),
            )
        else:
            classes = tf.cast(tf.round(y), tf.int32)
        known = (classes >= 0) & (classes < tf.size(table))
        index = tf.clip_by_value(classes, 0, tf.size(table) - 1)
        return x, y, tf.where(known, tf.gather(table, index), 1.0)

    return dataset.map(add_weights)


def generator_dataset(x: Any) -> tf.data.Dataset:
    """A PyDataset / keras Sequence (indexable, re-read every epoch) or a Python generator or
    iterator (read once: use ``steps_per_epoch``) of global batches, as a tf.data.Dataset.

    Every rank reads the same global batches and keeps its slice; the batches must therefore be
    identical on all ranks (same data, same or no shuffling).
    """
    indexable = hasattr(x, "__getitem__") and hasattr(x, "__len__")
    if indexable:
        first = x[0]

        def gen():
            for i in range(len(x)):
                yield _as_tuple(x[i])
            if hasattr(x, "on_epoch_end"):
                x.on_epoch_end()

    else:
        iterator = iter(x)
        first = next(iterator)

        def gen():
            yield _as_tuple(first)
            for batch in iterator:
                yield _as_tuple(batch)

    spec = tf.nest.map_structure(
        lambda a: tf.TensorSpec((None, *np.shape(a)[1:]), tf.as_dtype(np.asarray(a).dtype)),
        _as_tuple(first),
    )
    dataset = tf.data.Dataset.from_generator(gen, output_signature=spec)
    if indexable:  # a known length spares Keras an extra (exhausted) step call per epoch
        dataset = dataset.apply(tf.data.experimental.assert_cardinality(len(x)))
    return dataset


def _as_tuple(batch: Any) -> Any:
    return tuple(batch) if isinstance(batch, list) else batch


def is_array_like(x: Any) -> bool:
    flat = tf.nest.flatten(x)
    return bool(flat) and all(isinstance(a, (np.ndarray, tf.Tensor, list)) for a in flat)

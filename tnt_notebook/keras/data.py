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

import keras
import numpy as np
import tensorflow as tf

from tnt_notebook.keras import compat
from tnt_notebook.rank import api as ranks

#: Fixed shuffle seed used when TensorFlow has no global seed: every rank must shuffle alike.
DEFAULT_SHUFFLE_SEED = 20260421


def micro_batch_bounds(n: int, size: int, rank: int, chunk: int = 1) -> tuple[int, int]:
    """The contiguous slice of a global batch of ``n`` samples that ``rank`` processes: whole
    chunks of ``chunk`` samples (the reproducible mode's; the last chunk of a batch may be
    short), cut at the same places whatever the number of ranks."""
    chunks = -(-n // chunk)
    return min(rank * chunks // size * chunk, n), min((rank + 1) * chunks // size * chunk, n)


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
    if dataset.options().autotune.enabled is False:
        return dataset  # as it is: a new object kept on it would live until Python's next gc pass

    def make(dataset):
        options = tf.data.Options()
        options.autotune.enabled = False
        return dataset.with_options(options)

    return _derived(dataset, "without_autotune_model", make)


def _derived(dataset: tf.data.Dataset, key: Any, make) -> tf.data.Dataset:
    """``make(dataset)``, made once per dataset object and kept on it (until Python's garbage
    collector frees both), so that every fit, evaluate or predict on the same dataset hands tf.data
    the same object: tf.data optimizes (rewrites, by serializing) a pipeline once per object, at its
    first iterator, and a new object per call cost 0.3-0.4 s a call with 100 MB of data in the
    pipeline (plain Keras pays it once)."""
    kept = dataset.__dict__.setdefault("_tnt_derived", {})
    if key not in kept:
        kept[key] = make(dataset)
    return kept[key]


def slice_global_batch(batch: Any, rank: int, size: int, chunk: int = 1) -> Any:
    """This rank's micro-batch of a global batch (any nest of tensors), in graph ops: the
    slice of :func:`micro_batch_bounds`."""
    n = tf.shape(tf.nest.flatten(batch)[0], out_type=tf.int64)[0]
    chunks = (n + chunk - 1) // chunk
    lo = tf.minimum(rank * chunks // size * chunk, n)
    hi = tf.minimum((rank + 1) * chunks // size * chunk, n)
    return tf.nest.map_structure(lambda t: None if t is None else t[lo:hi], batch)


def _slice_batch(rank: int, size: int, chunk: int):
    def slice_elem(*elem):
        out = slice_global_batch(elem, rank, size, chunk)
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
    batched: bool | None = None,
    chunk: int = 1,
) -> Prepared:
    r"""A dataset of global batches -> this rank's micro-batches (shuffles seeded alike; whole
    ``chunk``\ s each).

    A dataset of single samples (``batched`` False, or found so) with ``micro_batch`` is batched
    here into global batches of ``micro_batch * size`` (Tarantella's ``tnt_micro_batch_size`` on
    an unbatched dataset). With ``in_step`` the dataset keeps yielding global batches and our
    train / test step slices them (:func:`slice_global_batch`): with a ``Dataset.map`` that
    slices, 2-rank training epochs at batch 256 took 5-11 % longer than on data sliced
    beforehand, with slicing in the step 2-3 %.
    """
    rank, size = ranks.get_rank(), ranks.get_size()
    found, global_batch = compat.dataset_batching(dataset)
    check_batch_sizes(global_batch, micro_batch, size, what)
    if micro_batch is not None and not (found if batched is None else batched):
        global_batch = micro_batch * size
        dataset = _derived(dataset, ("batched", global_batch), lambda d: d.batch(global_batch))
    if size == 1:
        return Prepared(dataset, global_batch)
    if _shuffles_may_differ(dataset):
        seed = shuffle_seed()
        try:
            dataset = _derived(
                dataset,
                ("seeded", seed),
                lambda d: compat.seed_unseeded_shuffles(d, seed, also_seeded=True),
            )
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
    sliced = _derived(
        dataset, ("sliced", rank, size, chunk), lambda d: d.map(_slice_batch(rank, size, chunk))
    )
    return Prepared(sliced, global_batch)


def fresh_copy(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """The same pipeline as a new object, whose reshuffling starts again from its first epoch (a
    dataset's shuffles draw each epoch's order from state that lives as long as the object).
    A pipeline with Python state cannot be copied: it is returned as it is, with a warning."""
    try:
        return compat.rebuilt(dataset)
    except Exception as exc:  # noqa: BLE001 - any serialization failure: explain and go on
        warnings.warn(
            f"tnt: the dataset could not be rebuilt as a fresh pipeline ({type(exc).__name__}: "
            f"{exc}); after a resumed fit its shuffles may draw other orders than an "
            "uninterrupted run would have.",
            stacklevel=3,
        )
        return dataset


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
    chunk: int = 1,
) -> Prepared:
    """NumPy/tensor inputs with a global batch size -> this rank's micro-batches (whole chunks
    of ``chunk`` samples).

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
    # (tf.data would stack a list of inputs into one tensor; Keras's own adapter makes tuples)
    x, y, sample_weight = keras.tree.lists_to_tuples((x, y, sample_weight))
    parts: tuple = (
        (x,) if y is None else ((x, y) if sample_weight is None else (x, y, sample_weight))
    )
    flat = [tf.convert_to_tensor(a) for a in tf.nest.flatten(parts)]
    n = int(flat[0].shape[0])
    order = _epoch_order(n, batch_size, shuffle, shuffle_seed() if shuffle else 0)
    index = order.flat_map(lambda rows: _rank_batches(rows, n, batch_size, rank, size, chunk))
    index = index.apply(tf.data.experimental.assert_cardinality(-(-n // batch_size)))

    structure = tf.nest.map_structure(lambda _: None, parts)

    def gather(idx, arrays):
        packed = tf.nest.pack_sequence_as(structure, [tf.gather(t, idx) for t in arrays])
        return packed if len(parts) > 1 else packed[0]

    # The arrays enter as a dataset, not as tensors captured by `gather`: a function's graph is
    # freed only by Python's cyclic garbage collector, and the copies of the previous call's
    # arrays it held made the next call copy into fresh memory (0.35-0.6 s per fit for 100 MB).
    arrays = tf.data.Dataset.from_tensors(tuple(flat)).repeat()
    ds = tf.data.Dataset.zip(index, arrays).map(gather).prefetch(tf.data.AUTOTUNE)
    options = tf.data.Options()
    # tf.data's static optimizations rewrite a pipeline by serializing its graph, the arrays
    # included: the first batch of each fit / evaluate / predict took 0.25-0.45 s for 100 MB of
    # inputs, 20-70 ms without (Keras's own NumPy adapter turns them off for the same reason).
    options.experimental_optimization.apply_default_optimizations = False
    # set here, so that Prepared keeps this pipeline itself (see without_autotune_model)
    options.autotune.enabled = ranks.get_size() == 1
    return Prepared(ds.with_options(options), batch_size, n)


def _epoch_order(n: int, batch_size: int, shuffle: bool | str, seed: int) -> tf.data.Dataset:
    """One vector per iterator (epoch): the order in which the epoch visits the ``n`` rows.

    Shuffled orders are drawn in one op per epoch from ``seed`` and the epoch's own random value,
    so every rank draws the same sequence of orders; a ``Dataset.shuffle`` of the row indices took
    0.6 ms more CPU per batch of 256 (a tenth of a training step here). ``"batch"`` shuffles the
    order of whole batches, a short last one staying last (Keras shuffles the rows within
    batch-sized chunks instead).
    """
    if not shuffle:
        return tf.data.Dataset.from_tensors(tf.range(n, dtype=tf.int64))

    def draw(value):
        stateless_seed = tf.stack([tf.constant(seed, tf.int64), value])
        rows = tf.range(n, dtype=tf.int64)
        if shuffle != "batch":
            return tf.random.experimental.stateless_shuffle(rows, seed=stateless_seed)
        full = n // batch_size * batch_size
        order = tf.random.experimental.stateless_shuffle(
            tf.reshape(rows[:full], [-1, batch_size]), seed=stateless_seed
        )
        return tf.concat([tf.reshape(order, [-1]), rows[full:]], 0)

    return compat.reseeded_each_iteration(seed, 7919).take(1).map(draw)


def _rank_batches(rows: tf.Tensor, n: int, batch_size: int, rank: int, size: int, chunk: int):
    """An epoch's order of the ``n`` rows -> this rank's slice of each global batch of it."""
    full = n // batch_size * batch_size
    lo, hi = micro_batch_bounds(batch_size, size, rank, chunk)
    batches = tf.data.Dataset.from_tensor_slices(
        tf.reshape(rows[:full], [-1, batch_size])[:, lo:hi]
    )
    if n == full:
        return batches
    lo, hi = micro_batch_bounds(n - full, size, rank, chunk)
    return batches.concatenate(tf.data.Dataset.from_tensors(rows[full + lo : full + hi]))


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


def generator_dataset(x: Any, shuffle_seed: int | None = None) -> tf.data.Dataset:
    """A PyDataset / keras Sequence (indexable, re-read every epoch) or a Python generator or
    iterator (read once: use ``steps_per_epoch``) of global batches, as a tf.data.Dataset.

    Every rank reads the same global batches and keeps its slice; the batches must therefore be
    identical on all ranks (same data, same or no shuffling). With ``shuffle_seed`` a PyDataset's
    batches come in a new order every epoch, as ``fit(shuffle=True)`` reads one in serial Keras,
    the same order on every rank (drawn from the seed, not from Python's ``random``).
    """
    indexable = hasattr(x, "__getitem__") and hasattr(x, "__len__")
    if indexable:
        first = x[0]
        orders = None if shuffle_seed is None else np.random.default_rng(shuffle_seed)

        def gen():
            batches = range(len(x)) if orders is None else orders.permutation(len(x))
            for i in batches:
                yield _as_tuple(x[int(i)])
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


def prepare(
    x: Any,
    y: Any,
    sample_weight: Any,
    batch_size: int | None,
    *,
    shuffle: bool | str,
    micro_batch: int | None,
    distribute_data: bool,
    what: str,
    in_step: bool = False,
    fresh: bool = False,
    chunk: int = 1,
) -> Prepared:
    r"""Any input of Keras's fit, evaluate or predict -> this rank's dataset (with ``fresh``, a
    dataset as a new pipeline: see :func:`fresh_copy`; arrays cut in whole ``chunk``\ s)."""
    if isinstance(x, tf.data.Dataset):
        if batch_size is not None:
            raise ValueError(
                "Do not pass batch_size with a tf.data.Dataset: batch the dataset with the "
                "global batch size instead."
            )
        if y is not None:
            raise ValueError("y must not be given when x is a tf.data.Dataset")
        if fresh:  # its own pipeline: every epoch's shuffle drawn anew from the start
            x = fresh_copy(x)
        if distribute_data:
            return distribute(x, micro_batch=micro_batch, what=what, in_step=in_step, chunk=chunk)
        return Prepared(x, None)
    if is_array_like(x):
        return arrays_to_dataset(
            x,
            y,
            sample_weight,
            batch_size=batch_size,
            shuffle=shuffle,
            distribute_data=distribute_data,
            micro_batch=micro_batch,
            what=what,
            chunk=chunk,
        )
    if y is not None or sample_weight is not None or batch_size is not None:
        raise ValueError(
            f"with x of type {type(x).__name__}, y, sample_weight and batch_size must not be "
            "given: it yields whole (global) batches"
        )
    shuffled = bool(shuffle) and isinstance(x, keras.utils.PyDataset)
    dataset = generator_dataset(x, shuffle_seed() if shuffled else None)
    if not distribute_data:
        return Prepared(dataset, None)
    prepared = distribute(
        dataset, micro_batch=micro_batch, what=what, in_step=in_step, batched=True, chunk=chunk
    )
    first = next(iter(dataset.take(1)))
    global_batch = int(tf.shape(tf.nest.flatten(first)[0])[0])
    check_batch_sizes(global_batch, micro_batch, ranks.get_size(), what)
    return Prepared(prepared.dataset, global_batch, global_batches=prepared.global_batches)


def split_off_validation(x: Any, y: Any, sample_weight: Any, split: float) -> tuple[tuple, tuple]:
    """``fit(validation_split=)``: ``(x, y, sample_weight)`` of training and of validation."""
    if not is_array_like(x):
        raise ValueError("validation_split is only supported for NumPy/tensor inputs")
    return compat.train_validation_split((x, y, sample_weight), split)


def validation_inputs(
    validation_data: Any, batch_size: int | None, training_batch_size: int | None
) -> tuple[Any, Any, Any, int | None]:
    """``fit(validation_data=)`` as ``(x, y, sample_weight, batch_size)``: arrays are batched as
    the training data is, unless ``validation_batch_size`` (``batch_size``) is given."""
    if isinstance(validation_data, tf.data.Dataset):
        x, y, sample_weight = validation_data, None, None
    else:
        x, y, sample_weight = compat.unpack_x_y_sample_weight(tuple(validation_data))
    default = None if isinstance(x, tf.data.Dataset) else training_batch_size
    return x, y, sample_weight, batch_size or default

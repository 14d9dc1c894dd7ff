"""Every Keras / TensorFlow version-dependent or private detail the wrapper relies on, in one place.

Written against Keras 3.15 on TensorFlow 2.21 (``keras.src`` internals); when Keras moves a private
name, only this module changes.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf
from keras.src import tree
from keras.src.legacy.saving import saving_utils as _legacy_saving
from keras.src.losses import loss as _loss_module
from keras.src.trainers.data_adapters import array_slicing as _array_slicing
from tensorflow.core.framework import graph_pb2, node_def_pb2
from tensorflow.python.eager import record as _record
from tensorflow.python.ops import gen_experimental_dataset_ops as _gen_exp

unpack_x_y_sample_weight = keras.utils.unpack_x_y_sample_weight

#: Optimizers Tarantella never supported (their per-coordinate state does not average exactly).
UNSUPPORTED_OPTIMIZERS: tuple[type, ...] = (keras.optimizers.Ftrl,)
UNSUPPORTED_OPTIMIZER_NAMES = ("ftrl",)
BATCH_NORM_LAYERS: tuple[type, ...] = (keras.layers.BatchNormalization,)


def call_model(model: keras.Model, x: Any, training: bool) -> Any:
    """Forward pass exactly as Keras's own train/test step does it."""
    if model._call_has_training_arg:
        return model(x, training=training)
    return model(x)


def compute_loss(model: keras.Model, x, y, y_pred, sample_weight, training: bool):
    """The compiled loss (plus regularisation losses) on one batch, as Keras's steps compute it."""
    return model._compute_loss(
        x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=training
    )


def unscale_loss(loss):
    return _loss_module.unscale_loss_for_distribution(loss)


def _optimizer_classes_with_apply() -> list[type]:
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    return [
        cls for cls in (BaseOptimizer, *_all_subclasses(BaseOptimizer)) if "apply" in cls.__dict__
    ]


def _all_subclasses(cls: type) -> list[type]:
    found = []
    for sub in cls.__subclasses__():
        found += [sub, *_all_subclasses(sub)]
    return found


@contextlib.contextmanager
def optimizer_apply_wrapped(wrapper: Callable[..., Any]) -> Iterator[None]:
    """While active, every Keras optimizer's ``apply(grads, trainable_variables)`` (which
    ``apply_gradients`` calls) runs ``wrapper(keras_apply, optimizer, grads, trainable_variables)``
    instead, ``keras_apply`` being the method of the optimizer's class it replaces."""
    originals = {cls: cls.__dict__["apply"] for cls in _optimizer_classes_with_apply()}
    for cls, keras_apply in originals.items():

        def apply(self, grads, trainable_variables=None, _keras_apply=keras_apply):
            return wrapper(_keras_apply, self, grads, trainable_variables)

        cls.apply = apply
    try:
        yield
    finally:
        for cls, keras_apply in originals.items():
            cls.apply = keras_apply


def optimizer_variables(optimizer: Any) -> list:
    """The variables an optimizer was built on (what ``apply(grads)`` without variables means)."""
    return list(optimizer._trainable_variables)


def scales_loss(optimizer: Any) -> bool:
    """Whether ``optimizer.scale_loss`` multiplies the loss (mixed precision's loss scaling, or a
    ``loss_scale_factor``)."""
    return isinstance(optimizer, keras.optimizers.LossScaleOptimizer) or (
        getattr(optimizer, "loss_scale_factor", None) is not None
    )


#: What :func:`loss_divisor` returns for a reduction that divides by the element count.
PER_ELEMENT = "per element"
#: What :func:`loss_divisor` returns for a reduction that divides by nothing (a sum).
UNDIVIDED = "undivided"


def loss_divisor(values, sample_weight, mask, reduction: Any, dtype: Any):
    """What Keras's ``reduce_weighted_values`` divides the weighted sum of ``values`` by on this
    batch (the rules of ``keras.src.losses.loss``): the count of unmasked elements for a masked
    mean; the sum of the (masked) sample weights for ``"mean_with_sample_weight"`` with weights;
    :data:`UNDIVIDED` for ``"sum"``; :data:`PER_ELEMENT` where it divides by the element count
    (proportional to the batch's samples) or does not reduce at all."""
    reduction = _loss_module.standardize_reduction(reduction)
    values = keras.ops.convert_to_tensor(values, dtype=dtype)
    if reduction in (None, "none") or len(values.shape) == 0:
        return PER_ELEMENT
    if reduction == "sum":
        return UNDIVIDED
    weighted = reduction == "mean_with_sample_weight" and sample_weight is not None
    if mask is None and not weighted:
        return PER_ELEMENT
    if reduction in ("mean", "sum_over_batch_size"):
        return keras.ops.sum(keras.ops.cast(mask, values.dtype))
    if sample_weight is not None:
        sample_weight = keras.ops.convert_to_tensor(sample_weight, dtype=dtype)
    if mask is not None:
        mask = keras.ops.convert_to_tensor(mask, dtype=dtype)
    weights = _loss_module.apply_mask(sample_weight, mask, values.dtype, reduction)
    _, weights = _loss_module.squeeze_or_expand_to_same_rank(
        values, keras.ops.cast(weights, values.dtype)
    )
    return keras.ops.sum(weights)


@contextlib.contextmanager
def rewritten_loss_reductions(rewrite: Callable[[Any, Any], Any]) -> Iterator[None]:
    """While active, every Keras ``Loss`` returns ``rewrite(value, divisor)`` instead of its
    reduced ``value`` (``divisor``: :func:`loss_divisor` of the same call)."""
    keras_reduce = _loss_module.reduce_weighted_values

    def reduce(values, sample_weight=None, mask=None, reduction="sum_over_batch_size", dtype=None):
        value = keras_reduce(values, sample_weight, mask, reduction, dtype)
        return rewrite(value, loss_divisor(values, sample_weight, mask, reduction, dtype))

    _loss_module.reduce_weighted_values = reduce
    try:
        yield
    finally:
        _loss_module.reduce_weighted_values = keras_reduce


def loss_tracker(model: keras.Model):
    return model._loss_tracker


def metric_variables(model: keras.Model) -> list:
    """State variables of every metric whose result Keras reports (loss tracker first)."""
    return [v for m in model.metrics for v in m.variables]


def build_compiled_metrics(model: keras.Model, y, y_pred) -> None:
    """Create the compiled metrics' and losses' state now (Keras does it at their first update),
    without updating it."""
    for compiled in (model._compile_metrics, model._compile_loss):
        if compiled is not None and not compiled.built:
            compiled.build(y, y_pred)


def per_batch_metric_variables(model: keras.Model, y_pred) -> set[int]:
    """ids of the metric variables that Keras updates once per batch whatever its size: each
    output's loss (CompileLoss weighs it by the batch's static size, unknown here), so each batch
    counts once."""
    if model._compile_loss is None or tree.flatten(y_pred)[0].shape[0] is not None:
        return set()
    return {id(v) for m in model._compile_loss.metrics for v in m.variables}


@contextlib.contextmanager
def random_draws_offset(offset: int) -> Iterator[None]:
    """While active, every random draw of Keras's TensorFlow backend (dropout, noise layers,
    ``keras.random``) adds ``offset`` to its seed's second word: ranks draw different noise
    while their seed generators advance alike (offset 0 changes nothing: serial Keras's draws)."""
    if offset == 0:
        yield
        return
    from keras.src.backend.tensorflow import random as backend_random

    keras_draw = backend_random.draw_seed

    def draw(seed):
        drawn = keras_draw(seed)
        return drawn + tf.constant([0, offset], dtype=drawn.dtype)

    backend_random.draw_seed = draw
    try:
        yield
    finally:
        backend_random.draw_seed = keras_draw


@contextlib.contextmanager
def synchronized_moments(moments: Callable[..., Any]) -> Iterator[None]:
    """While active, ``BatchNormalization(synchronized=True)`` computes its batch moments as
    ``moments(x, axes, keepdims)`` (where Keras asks its ``tf.distribute`` replicas)."""
    from keras.src.backend.tensorflow import nn as backend_nn

    keras_moments = backend_nn._compute_moments_sync
    backend_nn._compute_moments_sync = moments
    try:
        yield
    finally:
        backend_nn._compute_moments_sync = keras_moments


@contextlib.contextmanager
def per_batch_means(record: Callable[[Any], None]) -> Iterator[None]:
    """While active, ``record(metric)`` for every ``keras.metrics.Mean`` updated with one scalar
    and no weight: a value that counts once per batch, whatever the batch's size (a custom step's
    ``loss_tracker.update_state(loss)``)."""
    from keras.src.metrics import reduction_metrics

    keras_update = reduction_metrics.Mean.update_state

    def update_state(self, values, sample_weight=None):
        if sample_weight is None and len(keras.ops.shape(values)) == 0:
            record(self)
        return keras_update(self, values, sample_weight)

    reduction_metrics.Mean.update_state = update_state
    try:
        yield
    finally:
        reduction_metrics.Mean.update_state = keras_update


def per_rank_statistics(model: keras.Model) -> list:
    """The variables that each rank updates from its own samples in training: the moving moments
    of BatchNormalization layers that train (a frozen one normalises with them, unchanged) and
    are not synchronized (whose moments are the global batch's on every rank)."""
    return [
        v
        for layer in flatten_layers(model)
        if isinstance(layer, BATCH_NORM_LAYERS) and layer.trainable and not layer.synchronized
        for v in (layer.moving_mean, layer.moving_variance)
    ]


def share_registered_name(cls: type, base: type) -> None:
    """Let Keras serialize objects of ``cls`` under ``base``'s registered name."""
    from keras.src.saving import object_registration

    name = object_registration.GLOBAL_CUSTOM_NAMES.get(base)
    if name is not None:
        object_registration.GLOBAL_CUSTOM_NAMES[cls] = name


def functional_arguments(args: tuple, kwargs: dict) -> bool:
    """Whether ``keras.Model(*args, **kwargs)`` builds a functional model (inputs, outputs)."""
    from keras.src.models.model import functional_init_arguments

    return functional_init_arguments(args, kwargs)


def flatten_layers(model: keras.Model) -> list:
    return list(model._flatten_layers(include_self=False))


def reset_step_functions(model: keras.Model) -> None:
    """Drop Keras's cached tf.functions so the next fit/evaluate traces our step."""
    model.train_function = None
    model.test_function = None
    model.predict_function = None


def set_jit_compile(model: keras.Model, value: bool) -> None:
    model._jit_compile = value


def gradient_tape_active() -> bool:
    """True while a tf.GradientTape may be recording (a custom training loop)."""
    return bool(_record.could_possibly_record())


def model_from_config(config: dict, custom_objects=None, cls: type | None = None) -> keras.Model:
    """A new Keras model from ``get_config()``'s dict (of a model of class ``cls`` if known), a
    Keras 3 serialized config (with "module") or a tf.keras-style {"class_name", "config"}."""
    if not isinstance(config, dict):
        raise TypeError(f"a model config is a dict, got {type(config).__name__}")
    config = copy.deepcopy(config)  # Keras consumes parts of the dict it revives
    if "class_name" in config and "config" in config:
        if "module" in config:
            return keras.saving.deserialize_keras_object(config, custom_objects=custom_objects)
        return _legacy_saving.model_from_config(config, custom_objects=custom_objects)
    if cls is None:
        if {"input_layers", "output_layers", "layers"} <= config.keys():
            cls = keras.Model
        elif "layers" in config:
            cls = keras.Sequential
        else:
            raise TypeError(
                "this config names no layers, so it is not a Functional or Sequential model's "
                "(a subclassed model's get_config()): rebuild it with YourModel.from_config(config)"
                " and wrap that in tnt.Model"
            )
    return cls.from_config(config, custom_objects=custom_objects)


def train_validation_split(arrays, validation_split: float):
    return _array_slicing.train_validation_split(arrays, validation_split=validation_split)


_BATCH_OPS = ("_BatchDataset", "_PaddedBatchDataset", "_ParallelBatchDataset")
#: Ops that yield batches of a size not known here.
_OTHER_BATCHING_OPS = (
    "_RebatchDataset",
    "_GroupByWindowDataset",
    "_DenseToSparseBatchDataset",
    "_MapAndBatchDataset",
)


def dataset_batching(dataset: tf.data.Dataset) -> tuple[bool, int | None]:
    """(whether the dataset yields batches, their static size if known), from the last batching
    or unbatching op in its chain; a chain without either yields single samples."""
    ds = dataset
    for _ in range(1000):
        if ds is None:
            return False, None
        name = type(ds).__name__
        if name in _BATCH_OPS:
            try:
                return True, int(tf.get_static_value(ds._batch_size))
            except TypeError:
                return True, None
        if name in _OTHER_BATCHING_OPS:
            return True, None
        if name == "_UnbatchDataset":
            return False, None
        ds = getattr(ds, "_input_dataset", None)
    return True, None


def shuffle_seeds(dataset: tf.data.Dataset) -> list[tuple[int, int]]:
    """(seed, seed2) of every shuffle in the dataset chain; (0, 0) means seeded by the OS."""
    seeds = []
    ds = dataset
    while ds is not None:
        if type(ds).__name__ == "_ShuffleDataset":
            seed, seed2 = (tf.get_static_value(ds._seed), tf.get_static_value(ds._seed2))
            seeds.append((int(seed or 0), int(seed2 or 0)))
        ds = getattr(ds, "_input_dataset", None)
    return seeds


def seed_unseeded_shuffles(
    dataset: tf.data.Dataset, seed: int, *, also_seeded: bool = False
) -> tf.data.Dataset:
    """Rebuild the dataset graph with every unseeded shuffle given a fixed seed.

    An unseeded ``shuffle`` draws its seed from the OS, so ranks would cut their micro-batches out
    of differently shuffled global batches. We serialize the dataset graph, replace each unseeded
    ShuffleDataset(V2/V3) node by a seeded ShuffleDataset node (which keeps
    ``reshuffle_each_iteration``: a new, still rank-identical order every epoch) and rebuild it.
    ``also_seeded`` reseeds every shuffle (TensorFlow mixes its global seed into op seeds, so an op
    seed alone is not rank-independent). Raises if the graph cannot be serialized (Python state).
    """
    policy = tf.data.experimental.ExternalStatePolicy.FAIL
    graph = graph_pb2.GraphDef()
    graph.ParseFromString(dataset._as_serialized_graph(external_state_policy=policy).numpy())
    nodes = {n.name: n for n in graph.node}
    new_nodes = []
    for k, node in enumerate(list(graph.node)):
        if node.op not in ("ShuffleDataset", "ShuffleDatasetV2", "ShuffleDatasetV3"):
            continue
        if node.op == "ShuffleDatasetV2":  # (input, buffer_size, seed_generator): always unseeded
            seeds = [0, 0]
        else:
            seeds = [_const_int(nodes[name.split(":")[0]]) for name in node.input[2:4]]
        if any(seeds) and not also_seeded:
            continue
        names = []
        for j, value in enumerate((seed, seed + 7919 * (k + 1))):
            c = node_def_pb2.NodeDef()
            c.name = f"tnt_shuffle_seed_{k}_{j}"
            c.op = "Const"
            c.attr["dtype"].type = tf.int64.as_datatype_enum
            c.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(value, dtype=tf.int64))
            new_nodes.append(c)
            names.append(c.name)
        inputs = [node.input[0], node.input[1], *names]
        controls = [i for i in node.input if i.startswith("^")]
        del node.input[:]
        node.input.extend(inputs + controls)
        node.op = "ShuffleDataset"
    graph.node.extend(new_nodes)
    return _from_graph(graph.SerializeToString(), dataset.element_spec)


def rebuilt(dataset: tf.data.Dataset) -> tf.data.Dataset:
    """The dataset rebuilt from its serialized graph: a new pipeline with new state."""
    policy = tf.data.experimental.ExternalStatePolicy.FAIL
    return _from_graph(
        dataset._as_serialized_graph(external_state_policy=policy), dataset.element_spec
    )


def _from_graph(serialized: Any, element_spec: Any) -> tf.data.Dataset:
    variant = _gen_exp.dataset_from_graph(serialized)
    return tf.data.experimental.from_variant(variant, element_spec)


def keras_iterators(epochs: int, steps_per_epoch: int | None) -> int | None:
    """How many iterators of its dataset Keras's fit makes in ``epochs`` whole epochs: one as
    each epoch starts and one as it ends (for the next epoch, which then makes its own) when
    ``steps_per_epoch`` is not given; None with it (epochs then share an iterator)."""
    return 2 * epochs if steps_per_epoch is None else None


def build_from_spec(model: keras.Model, element_spec: Any, targets: bool) -> None:
    """Build ``model`` from the shapes of its data as Keras does under a distribution strategy
    (with ``targets``, also its compiled metrics and losses and its optimizer)."""
    if targets and model.compiled:
        model._symbolic_build(data_batch=element_spec)
        return
    if all(layer.built for layer in model._flatten_layers()):
        return
    x, _, _ = unpack_x_y_sample_weight(element_spec)
    symbolic = tf.nest.map_structure(
        lambda s: keras.KerasTensor(s.shape, keras.backend.standardize_dtype(s.dtype)), x
    )
    keras.src.backend.compute_output_spec(model, symbolic, training=False)


def reseeded_each_iteration(seed: int, seed2: int) -> tf.data.Dataset:
    """An endless dataset of random int64 values that starts afresh, differently, with every
    iterator (epoch), from exactly these two seeds: ``Dataset.random`` mixes TensorFlow's global
    seed (which may differ per rank) into them."""
    variant = _gen_exp.random_dataset_v2(
        seed=seed,
        seed2=seed2,
        seed_generator=tf.raw_ops.DummySeedGenerator(),
        rerandomize_each_iteration=True,
        output_types=[tf.int64],
        output_shapes=[[]],
    )
    return tf.data.experimental.from_variant(variant, tf.TensorSpec([], tf.int64))


def _const_int(node) -> int:
    if node.op != "Const":
        return 1  # not a literal: treat as seeded, leave it alone
    return int(tf.make_ndarray(node.attr["value"].tensor))

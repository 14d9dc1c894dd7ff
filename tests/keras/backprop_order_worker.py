"""Runs on every rank of a world of pseudo-nodes (gradient buckets in two halves) and writes
rank<r>.json. By default: fits LeNet-5 once, traces its training step and counts, for each
bucket's start in the step's order (with TNT_OVERLAP=steps the metrics' bucket first), the
convolutions' gradient ops (what only the last bucket needs) that run after it. With
TNT_TEST_LAYERS=1: fits models whose steps hold stateful ops and variables of their own
(BatchNormalization, Dropout, Embedding, LSTM), in float32 and fp16, and reports their losses
and weights."""

from __future__ import annotations

import json
import os

import keras
import numpy as np
import tensorflow as tf

import tnt_notebook as tnt
from tnt_notebook.keras import allreduce_op

CONVOLUTION_GRADIENTS = {"Conv2DBackpropFilter", "Conv2DBackpropInput"}


def lenet5() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(6, 5, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(16, 5, activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Flatten(),
            keras.layers.Dense(120, activation="relu"),
            keras.layers.Dense(84, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def descendants(graph: tf.Graph, op: tf.Operation) -> set:
    children: dict = {}
    for node in graph.get_operations():
        for parent in [t.op for t in node.inputs] + list(node.control_inputs):
            children.setdefault(parent, []).append(node)
    found, stack = set(), [op]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def conv_batchnorm_dropout() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((16, 16, 3)),
            keras.layers.Conv2D(8, 3),
            keras.layers.BatchNormalization(),
            keras.layers.ReLU(),
            keras.layers.Dropout(0.2, seed=1),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dropout(0.3, seed=2),
            keras.layers.Dense(10),
        ]
    )


def embedding_lstm() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((12,), dtype="int32"),
            keras.layers.Embedding(500, 32),
            keras.layers.LSTM(32),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def fit_layers() -> dict:
    rng = np.random.default_rng(0)
    inputs = {
        "conv_batchnorm_dropout": rng.normal(size=(96, 16, 16, 3)).astype("float32"),
        "embedding_lstm": rng.integers(0, 500, size=(96, 12)).astype("int32"),
    }
    y = rng.integers(0, 10, size=96)
    results = {}
    for make in (conv_batchnorm_dropout, embedding_lstm):
        for compression in (None, "fp16"):
            model = tnt.Model(make(), compression=compression)
            model.compile(
                optimizer=keras.optimizers.Adam(1e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
            x = inputs[make.__name__]
            history = model.fit(x, y, batch_size=32, epochs=2, validation_split=0.25, verbose=0)
            weights = np.concatenate([w.ravel() for w in model.get_weights()]).astype("float64")
            results[f"{make.__name__}_{compression}"] = {
                "losses": history.history["loss"] + history.history["val_loss"],
                "weights_sum": float(weights.sum()),
                "weights_abs": float(np.abs(weights).sum()),
            }
    return results


def main(out: str) -> None:
    if os.environ.get("TNT_TEST_LAYERS"):
        layers = fit_layers()
        with open(f"{out}/rank{tnt.get_rank()}.json", "w") as f:
            json.dump({"in_halves": allreduce_op.prepare().in_halves, "layers": layers}, f)
        return
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, size=64)
    model = tnt.Model(lenet5(), compression=os.environ.get("TNT_TEST_COMPRESSION") or None)
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    spec = (tf.TensorSpec((None, 28, 28, 1), tf.float32), tf.TensorSpec((None,), tf.int64))
    graph = tf.function(model.train_step).get_concrete_function(spec).graph
    starts = [op for op in graph.get_operations() if op.type == "TntAllreduceStart"]
    convolutions = [op for op in graph.get_operations() if op.type in CONVOLUTION_GRADIENTS]
    later = {start: descendants(graph, start) for start in starts}
    starts.sort(key=lambda start: -len(later[start].intersection(starts)))  # in the step's order
    after = [len(later[start].intersection(convolutions)) for start in starts]
    with open(f"{out}/rank{tnt.get_rank()}.json", "w") as f:
        json.dump(
            {
                "in_halves": allreduce_op.prepare().in_halves,
                "convolution_gradients": len(convolutions),
                "after_each_start": after,
            },
            f,
        )

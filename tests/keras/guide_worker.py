"""Runs on every rank: the calls of Tarantella's guide as the guide writes them, each compared with
serial Keras trained by the master rank from the same weights on the same data.

Writes rank<r>.json: per guide section, the largest relative difference from serial Keras (or
what the section checks instead).
"""

from __future__ import annotations

import json

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import tnt_notebook as tnt

SEED = 42
DIGITS = load_digits()
X = (DIGITS.images / 16.0).astype("float32")[..., None][:480]
Y = DIGITS.target.astype("int64")[:480]
X_TRAIN, Y_TRAIN, X_TEST, Y_TEST = X[:384], Y[:384], X[384:], Y[384:]


def lenet5():
    """The guide's quick-start model, sized for 8x8 digits."""
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(6, 3, padding="same", activation="relu"),
            keras.layers.MaxPooling2D(2),
            keras.layers.Conv2D(16, 3, padding="same", activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def quick_start_compile(model):
    model.compile(
        optimizer=keras.optimizers.SGD(learning_rate=0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[keras.metrics.SparseCategoricalAccuracy()],
    )


def rel(a, b) -> float:
    """Largest relative difference between two nests of numbers."""
    fa, fb = tf.nest.flatten(a), tf.nest.flatten(b)
    assert len(fa) == len(fb), (a, b)
    return max(
        (abs(float(p) - float(q)) / max(1.0, abs(float(q))) for p, q in zip(fa, fb, strict=True)),
        default=0.0,
    )


def compare(train_serial, train_tnt) -> float:
    """Both ``train(model)`` functions, serial on the master only, from the same weights; returns
    the largest relative difference of their results (History, evaluate, predict...)."""
    keras.utils.set_random_seed(SEED)
    start = lenet5().get_weights()
    serial = None
    if tnt.is_master_rank():
        keras.utils.set_random_seed(SEED)
        ref = lenet5()
        ref.set_weights(start)
        quick_start_compile(ref)
        serial = train_serial(ref)
    serial = tnt.broadcast(serial)
    keras.utils.set_random_seed(SEED)
    model = tnt.Model(lenet5())
    model.set_weights(start)
    quick_start_compile(model)
    return rel(train_tnt(model), serial)


def batched(x, y, batch, shuffle=False):
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle:
        ds = ds.shuffle(len(x), seed=SEED)
    return ds.batch(batch)


def quick_start():
    """Shuffled, batched datasets with the global batch size; fit, then evaluate."""

    def train(model):
        history = model.fit(batched(X_TRAIN, Y_TRAIN, 64, shuffle=True), epochs=2, verbose=0)
        return [history.history, model.evaluate(batched(X_TEST, Y_TEST, 32), verbose=0)]

    return compare(train, train)


def micro_batch_size_on_unbatched_data():
    """fit/evaluate/predict(unbatched data, tnt_micro_batch_size=m): global batches of m * size."""
    m = 8
    unbatched_train = tf.data.Dataset.from_tensor_slices((X_TRAIN, Y_TRAIN))
    unbatched_test = tf.data.Dataset.from_tensor_slices((X_TEST, Y_TEST))

    def serial(model):
        b = m * tnt.get_size()
        history = model.fit(unbatched_train.batch(b), epochs=2, verbose=0)
        return [
            history.history,
            model.evaluate(unbatched_test.batch(b), verbose=0),
            model.predict(unbatched_test.map(lambda x, y: x).batch(b), verbose=0).tolist(),
        ]

    def distributed(model):
        history = model.fit(unbatched_train, epochs=2, verbose=0, tnt_micro_batch_size=m)
        return [
            history.history,
            model.evaluate(unbatched_test, verbose=0, tnt_micro_batch_size=m),
            model.predict(
                unbatched_test.map(lambda x, y: x), verbose=0, tnt_micro_batch_size=m
            ).tolist(),
        ]

    return compare(serial, distributed)


def micro_batch_size_consistent_with_batched_data():
    """A dataset batched globally, and tnt_micro_batch_size equal to its share per rank."""
    m = 8
    b = m * tnt.get_size()

    def serial(model):
        return model.fit(batched(X_TRAIN, Y_TRAIN, b), epochs=2, verbose=0).history

    def distributed(model):
        history = model.fit(
            batched(X_TRAIN, Y_TRAIN, b), epochs=2, verbose=0, tnt_micro_batch_size=m
        )
        return history.history

    return compare(serial, distributed)


def validation_micro_batch_size():
    """fit(..., validation_data=unbatched, tnt_validation_micro_batch_size=m)."""
    m = 8

    def serial(model):
        val = batched(X_TEST, Y_TEST, m * tnt.get_size())
        return model.fit(
            batched(X_TRAIN, Y_TRAIN, 48), validation_data=val, epochs=2, verbose=0
        ).history

    def distributed(model):
        val = tf.data.Dataset.from_tensor_slices((X_TEST, Y_TEST))
        return model.fit(
            batched(X_TRAIN, Y_TRAIN, 48),
            validation_data=val,
            epochs=2,
            verbose=0,
            tnt_validation_micro_batch_size=m,
        ).history

    return compare(serial, distributed)


def manually_distributed_datasets():
    """tnt_distribute_dataset=False and tnt_distribute_validation_dataset=False: each rank brings
    its own shard; serial Keras sees the shards of each step together."""
    size, rank, m = tnt.get_size(), tnt.get_rank(), 8

    def shard(x, y, r):  # rank r's rows of every global batch of m * size
        rows = np.concatenate(
            [np.arange(s + r * m, s + (r + 1) * m) for s in range(0, len(x), m * size)]
        )
        return x[rows], y[rows]

    def serial(model):
        val = batched(X_TEST, Y_TEST, m * size)
        return model.fit(
            batched(X_TRAIN, Y_TRAIN, m * size), validation_data=val, epochs=2, verbose=0
        ).history

    def distributed(model):
        return model.fit(
            batched(*shard(X_TRAIN, Y_TRAIN, rank), m),
            validation_data=batched(*shard(X_TEST, Y_TEST, rank), m),
            epochs=2,
            verbose=0,
            tnt_distribute_dataset=False,
            tnt_distribute_validation_dataset=False,
        ).history

    return compare(serial, distributed)


def short_last_batch_kept():
    """drop_remainder=False: every sample counts, the short last batch too (as in serial Keras)."""

    def train(model):
        return model.fit(batched(X_TRAIN[:380], Y_TRAIN[:380], 64), epochs=2, verbose=0).history

    return compare(train, train)


def history_callback_on_the_master_rank_only():
    """The guide's ``callbacks=[history_callback] if tnt.is_master_rank() else []``."""

    def serial(model):
        history = keras.callbacks.History()
        model.fit(batched(X_TRAIN, Y_TRAIN, 64), epochs=2, verbose=0, callbacks=[history])
        return history.history

    def distributed(model):
        history = keras.callbacks.History()
        model.fit(
            batched(X_TRAIN, Y_TRAIN, 64),
            epochs=2,
            verbose=0,
            callbacks=[history] if tnt.is_master_rank() else [],
        )
        return tnt.broadcast(history.history)  # the master's, on every rank

    return compare(serial, distributed)


def main(out: str) -> None:
    tnt.init()  # the guide's first call; a second one changes nothing
    tnt.init()
    sections = {
        "quick_start": quick_start,
        "micro_batch_size_on_unbatched_data": micro_batch_size_on_unbatched_data,
        "micro_batch_size_consistent_with_batched_data": (
            micro_batch_size_consistent_with_batched_data
        ),
        "validation_micro_batch_size": validation_micro_batch_size,
        "manually_distributed_datasets": manually_distributed_datasets,
        "short_last_batch_kept": short_last_batch_kept,
        "history_callback_on_the_master_rank_only": history_callback_on_the_master_rank_only,
    }
    results = {name: run() for name, run in sections.items()}
    with open(f"{out}/rank{tnt.get_rank()}.json", "w") as f:
        json.dump({"size": tnt.get_size(), "results": results}, f)

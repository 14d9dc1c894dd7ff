"""Runs on every rank of an mpiexec world: LeNet-5 with dropout, Adam and a learning-rate
schedule trained reproducibly (tnt.Model(reproducible=True)) on shuffled arrays and on a shuffled
tf.data pipeline, 3 epochs with validation, then evaluated; what the bits came to, per rank.

Imported by test_reproducible.py's mpiexec snippet (not a test module itself).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import tnt_notebook as tnt

SAMPLES, BATCH, CHUNK = 400, 96, 16  # the last batch of an epoch (16) is one chunk


def lenet() -> keras.Model:
    keras.utils.set_random_seed(1)
    return keras.Sequential([
        keras.Input((12, 12, 1)),
        keras.layers.Conv2D(6, 3, activation="relu"),
        keras.layers.MaxPooling2D(),
        keras.layers.Conv2D(16, 3, activation="relu"),
        keras.layers.Flatten(),
        keras.layers.Dropout(0.3),
        keras.layers.Dense(32, activation="relu"),
        keras.layers.Dense(10),
    ])  # fmt: skip


def digest(arrays) -> str:
    return hashlib.sha256(b"".join(np.asarray(a).tobytes() for a in arrays)).hexdigest()


def train(inputs: str) -> dict:
    x = np.random.default_rng(0).standard_normal((SAMPLES, 12, 12, 1)).astype("float32")
    y = np.random.default_rng(1).integers(0, 10, SAMPLES)
    model = tnt.Model(lenet(), reproducible=True, chunk_size=CHUNK)
    schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, 5, 0.9)
    model.compile(
        keras.optimizers.Adam(schedule),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    if inputs == "arrays":
        history = model.fit(
            x, y, batch_size=BATCH, epochs=3, shuffle=True, verbose=0,
            validation_data=(x[:100], y[:100]),
        )  # fmt: skip
    else:
        data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(SAMPLES, seed=3).batch(BATCH)
        history = model.fit(data, epochs=3, verbose=0)
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    return {
        "weights": digest(model.get_weights()),
        "history": digest(np.array(v, np.float64) for v in history.history.values()),
        "evaluate": digest([np.array(evaluated, np.float64)]),
        "loss": history.history["loss"],
    }


def main(out: str) -> None:
    result = {"rank": tnt.get_rank(), "arrays": train("arrays"), "dataset": train("dataset")}
    (Path(out) / f"rank{tnt.get_rank()}.json").write_text(json.dumps(result))

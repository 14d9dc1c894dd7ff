"""Runs on every rank of an mpiexec world: LeNet-5 with dropout, Adam and a learning-rate
schedule trained reproducibly (tnt.Model(reproducible=True)) on shuffled arrays and on a shuffled
tf.data pipeline, 3 epochs with validation, then evaluated and predicting; a small net with
BatchNormalization; tnt.reproducibility_report in both modes; with REPRODUCIBLE_INTERRUPT=DIR a
fit interrupted mid-epoch after a backup in DIR, with REPRODUCIBLE_RESUME=DIR the same fit resumed
from DIR (on another number of ranks). What the bits came to, per rank.

Imported by test_reproducible.py's mpiexec snippet (not a test module itself).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf

import tnt_notebook as tnt
from tests.keras.interruptions import Interrupt

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


def data() -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).standard_normal((SAMPLES, 12, 12, 1)).astype("float32")
    return x, np.random.default_rng(1).integers(0, 10, SAMPLES)


def compiled(model: keras.Model) -> keras.Model:
    schedule = keras.optimizers.schedules.ExponentialDecay(1e-2, 5, 0.9)
    model.compile(
        keras.optimizers.Adam(schedule),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def train(inputs: str, callbacks: tuple = ()) -> dict:
    x, y = data()
    model = compiled(tnt.Model(lenet(), reproducible=True, chunk_size=CHUNK))
    if inputs == "arrays":
        history = model.fit(
            x, y, batch_size=BATCH, epochs=3, shuffle=True, verbose=0,
            validation_data=(x[:100], y[:100]), callbacks=list(callbacks),
        )  # fmt: skip
        predicted = model.predict(x, batch_size=BATCH, verbose=0)
    else:
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(SAMPLES, seed=3).batch(BATCH)
        history = model.fit(dataset, epochs=3, verbose=0)
        predicted = model.predict(tf.data.Dataset.from_tensor_slices(x).batch(BATCH), verbose=0)
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0)
    return {
        "weights": digest(model.get_weights()),
        "history": digest(np.array(v, np.float64) for v in history.history.values()),
        "evaluate": digest([np.array(evaluated, np.float64)]),
        "predict": digest([predicted]),
        "loss": history.history["loss"],
    }


def train_normalized() -> dict:
    """Per-chunk batch statistics, moving statistics from the chunks' mean move."""
    x, y = data()
    keras.utils.set_random_seed(2)
    net = keras.Sequential([
        keras.Input((12, 12, 1)),
        keras.layers.Conv2D(4, 3),
        keras.layers.BatchNormalization(),
        keras.layers.ReLU(),
        keras.layers.Flatten(),
        keras.layers.Dense(10),
    ])  # fmt: skip
    model = compiled(tnt.Model(net, reproducible=True, chunk_size=CHUNK))
    history = model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    return {
        "weights": digest(model.get_weights()),
        "history": digest(np.array(v, np.float64) for v in history.history.values()),
        "moved": bool(np.any(model.layers[1].moving_mean.numpy() != 0)),
    }


def report(noise: bool) -> dict:
    """The report on LeNet-5, or on LeNet-5 with noise drawn from TensorFlow's own random stream
    (not a Keras seed generator: each rank's own), which the report must find."""
    x, y = data()
    net = lenet()
    if noise:
        net.add(keras.layers.Lambda(lambda t: t + tf.random.normal(tf.shape(t), stddev=0.1)))
    model = compiled(tnt.Model(net, reproducible=True))
    model.fit(x[:BATCH], y[:BATCH], batch_size=BATCH, verbose=0)  # (a state to put back)
    before = digest(v.numpy() for v in model.variables + model.optimizer.variables)
    found = tnt.reproducibility_report(model, x, y, batch_size=BATCH, steps=2)
    after = digest(v.numpy() for v in model.variables + model.optimizer.variables)
    return {**found, "restored": before == after}


def resumable(backup_dir: str, interrupt: bool) -> dict:
    """The arrays' fit with a backup every 2 steps, failed on purpose in the second epoch on
    every rank (``interrupt``), or resumed."""
    backup = keras.callbacks.BackupAndRestore(backup_dir, save_freq=2)
    if not interrupt:
        return train("arrays", (backup,))
    try:
        train("arrays", (backup, Interrupt(1, 2)))
    except RuntimeError as e:
        assert "interrupted on purpose" in str(e), e
    return {}


def main(out: str) -> None:
    result = {
        "rank": tnt.get_rank(),
        "arrays": train("arrays"),
        "dataset": train("dataset"),
        "normalized": train_normalized(),
        "report": report(noise=False),
        "noisy_report": report(noise=True),
    }
    if "REPRODUCIBLE_INTERRUPT" in os.environ:
        resumable(os.environ["REPRODUCIBLE_INTERRUPT"], interrupt=True)
    if "REPRODUCIBLE_RESUME" in os.environ:
        result["resumed"] = resumable(os.environ["REPRODUCIBLE_RESUME"], interrupt=False)
    (Path(out) / f"rank{tnt.get_rank()}.json").write_text(json.dumps(result))

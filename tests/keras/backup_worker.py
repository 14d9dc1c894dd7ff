"""Runs on every rank, each in a mount namespace of its own where TNT_PRIVATE_DIR is a private tmpfs
(hosts without a shared filesystem): BackupAndRestore and the checkpointing callbacks.

Each scenario trains once without interruption and once interrupted (a callback on the last rank
raises mid-training) and then rerun, as a user reruns the cell; rank<r>.json in the shared
output directory records how far the resumed run is from the uninterrupted one.
"""

from __future__ import annotations

import csv
import json
import os

import keras
import numpy as np
import tensorflow as tf

import tnt_notebook as tnt
from tests.keras.interruptions import Interrupt

RANK, SIZE = tnt.get_rank(), tnt.get_size()
PRIVATE = os.environ["TNT_PRIVATE_DIR"]
RNG = np.random.default_rng(0)
X = RNG.normal(size=(120, 6)).astype("float32")
Y = (X[:, 0] - X[:, 1] > 0).astype("int64")
EPOCHS, BATCH = 4, 16  # 8 steps per epoch, the last one short


def model(dropout: bool):
    keras.utils.set_random_seed(5)
    layers = [keras.Input((6,)), keras.layers.Dense(12, activation="relu")]
    if dropout:
        layers.append(keras.layers.Dropout(0.3, seed=9))
    return keras.Sequential([*layers, keras.layers.Dense(2)])


def compiled(optimizer: str, dropout: bool):
    m = tnt.Model(model(dropout))
    if optimizer == "adam_schedule":
        schedule = keras.optimizers.schedules.ExponentialDecay(0.02, decay_steps=5, decay_rate=0.7)
        opt = keras.optimizers.Adam(learning_rate=schedule)
    else:
        opt = keras.optimizers.SGD(learning_rate=0.05, momentum=0.9)
    m.compile(
        optimizer=opt,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return m


def fit(m, inputs: str, callbacks: list, validation: bool):
    kwargs = {"epochs": EPOCHS, "verbose": 0, "callbacks": callbacks}
    if validation:
        kwargs["validation_data"] = (X[:40], Y[:40])
    if inputs == "arrays":
        return m.fit(X, Y, batch_size=BATCH, shuffle=True, **kwargs)
    ds = tf.data.Dataset.from_tensor_slices((X, Y)).shuffle(120, seed=3).batch(BATCH)
    return m.fit(ds, **kwargs)


def state(m) -> list[np.ndarray]:
    return [np.asarray(v.numpy()) for v in [*m.variables, *m.optimizer.variables]]


def compare(ref_model, ref_history, got_model, got_history) -> dict:
    ref, got = state(ref_model), state(got_model)
    keys = set(ref_history) | set(got_history)
    history = max(
        (
            abs(a - b) / max(1.0, abs(b))
            for k in keys
            for a, b in zip(got_history.get(k, []), ref_history.get(k, []), strict=False)
        ),
        default=0.0,
    )
    return {
        "state_abs": max(
            float(np.max(np.abs(a - b), initial=0.0)) for a, b in zip(got, ref, strict=True)
        ),
        "history_rel": history,
        "history_lengths": sorted({len(v) for v in got_history.values()}),
        "same_keys": set(ref_history) == set(got_history),
    }


SCENARIOS = {  # optimizer, inputs, save_freq, where the last rank fails, dropout + validation
    "sgd_momentum/epoch/arrays": ("sgd_momentum", "arrays", "epoch", (2, 1), False),
    "adam_schedule/2_batches/tf.data": ("adam_schedule", "tf.data", 2, (1, 2), False),
    "sgd_momentum/3_batches/arrays/dropout_validation": ("sgd_momentum", "arrays", 3, (2, 6), True),
}


def resumed(name, optimizer, inputs, save_freq, at, extras) -> dict:
    backup_dir = f"{PRIVATE}/{name.replace('/', '_')}"
    ref = compiled(optimizer, extras)
    ref_history = fit(
        ref, inputs, [keras.callbacks.BackupAndRestore(f"{backup_dir}_ref", save_freq)], extras
    ).history
    m = compiled(optimizer, extras)
    backup = keras.callbacks.BackupAndRestore(backup_dir, save_freq)
    try:
        fit(m, inputs, [backup, Interrupt(*at, rank=SIZE - 1)], extras)
        interrupted = "no"
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        interrupted = type(exc).__name__
    backup_files = sorted(os.listdir(backup_dir)) if os.path.isdir(backup_dir) else []
    history = fit(m, inputs, [backup], extras).history
    return {
        "interrupted": interrupted,
        "backup_files": backup_files,
        "left_after_success": os.path.exists(backup_dir),
        **compare(ref, ref_history, m, history),
    }


def corrupt_latest(double_checkpoint: bool) -> dict:
    """A damaged latest backup is never taken: the previous one is, or a clear error."""
    backup_dir = f"{PRIVATE}/corrupt_{double_checkpoint}"
    ref = compiled("sgd_momentum", False)
    ref_history = fit(ref, "arrays", [], False).history
    m = compiled("sgd_momentum", False)
    backup = keras.callbacks.BackupAndRestore(backup_dir, double_checkpoint=double_checkpoint)
    try:
        fit(m, "arrays", [backup, Interrupt(3, 0, rank=SIZE - 1)], False)
    except Exception:  # noqa: BLE001 - the interruption
        pass
    if tnt.is_master_rank():  # cut short, as a crash in the middle of writing would
        latest = f"{backup_dir}/tnt-backup.npz"
        with open(latest, "r+b") as f:
            f.truncate(os.path.getsize(latest) // 2)
    try:
        history = fit(m, "arrays", [backup], False).history
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return {"error": [type(exc).__name__, str(exc)]}
    return compare(ref, ref_history, m, history)


def checkpoints() -> dict:
    """Every file-writing callback writes once, from the master rank, files that load."""
    d = f"{PRIVATE}/checkpoints"
    os.makedirs(d, exist_ok=True)
    m = compiled("sgd_momentum", False)
    callbacks = [
        keras.callbacks.ModelCheckpoint(f"{d}/epoch{{epoch}}.keras"),
        keras.callbacks.ModelCheckpoint(f"{d}/w{{epoch}}.weights.h5", save_weights_only=True),
        keras.callbacks.ModelCheckpoint(f"{d}/batch.keras", save_freq=3),
        keras.callbacks.ModelCheckpoint(
            f"{d}/best.weights.h5", save_weights_only=True, save_best_only=True, monitor="loss"
        ),
        keras.callbacks.CSVLogger(f"{d}/log.csv"),
        keras.callbacks.TensorBoard(f"{d}/tb"),
    ]
    fit(m, "arrays", callbacks, False)
    files = sorted(os.listdir(d))
    loads = {}
    if RANK == 0:
        final = m.get_weights()
        last = keras.models.load_model(f"{d}/epoch{EPOCHS}.keras")
        weights = model(False)
        weights.load_weights(f"{d}/w{EPOCHS}.weights.h5")
        loads = {
            "last_epoch_model": all(
                np.array_equal(a, b) for a, b in zip(last.get_weights(), final, strict=True)
            ),
            "last_epoch_weights": all(
                np.array_equal(a, b) for a, b in zip(weights.get_weights(), final, strict=True)
            ),
            "batch_model": len(keras.models.load_model(f"{d}/batch.keras").get_weights()),
            "csv_rows": len(list(csv.DictReader(open(f"{d}/log.csv")))),
        }
    return {
        "files": files,
        "loads": loads,
        "no_temporary_files": not any(".tnt-" in f for f in files),
    }


def main(out: str) -> None:
    results = {name: resumed(name, *args) for name, args in SCENARIOS.items()}
    results["corrupt_with_previous"] = corrupt_latest(True)
    results["corrupt_alone"] = corrupt_latest(False)
    results["checkpoints"] = checkpoints()
    with open(f"{out}/rank{RANK}.json", "w") as f:
        json.dump(results, f)

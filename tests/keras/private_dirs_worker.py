"""Runs on every rank, each in a mount namespace of its own where TNT_PRIVATE_DIR is a private
tmpfs: the same path names a different directory on every rank, as on hosts without a shared
filesystem. Writes rank<r>.json into the (shared) output directory."""

from __future__ import annotations

import json
import os

import keras
import numpy as np

import tnt_notebook as tnt

X = np.random.default_rng(1).normal(size=(32, 4)).astype("float32")
Y = (X[:, 0] > 0).astype("int64")


def compiled():
    m = tnt.Model(keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)]))
    m.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def same(a, b) -> bool:
    return all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))


def main(out: str) -> None:
    private = os.environ["TNT_PRIVATE_DIR"]
    m = compiled()
    m.fit(X, Y, batch_size=8, epochs=1, verbose=0)
    m.save(f"{private}/model.keras", tnt_save_all_devices=True)
    m.save_weights(f"{private}/model.weights.h5", tnt_save_all_devices=True)
    tnt.models.save_model(m, f"{private}/api.keras", tnt_save_all_devices=True)
    all_devices = sorted(os.listdir(private))
    m.save(f"{private}/master.keras")
    m.save_weights(f"{private}/master.weights.h5")
    loaded = tnt.models.load_model(f"{private}/master.keras")  # the other ranks lack the file
    fresh = compiled()
    fresh(X[:1])
    fresh.load_weights(f"{private}/master.weights.h5")
    expected = m.get_weights()
    result = {
        "all_devices_files": all_devices,
        "master_file_here": os.path.exists(f"{private}/master.keras"),
        "loaded_equal": same(loaded.get_weights(), expected),
        "load_weights_equal": same(fresh.get_weights(), expected),
        "own_copy_loads": same(
            tnt.models.load_model(f"{private}/model.keras").get_weights(), expected
        ),
    }
    with open(f"{out}/rank{tnt.get_rank()}.json", "w") as f:
        json.dump(result, f)

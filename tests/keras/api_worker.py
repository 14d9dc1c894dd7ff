"""Runs on every rank: saving/loading, weight broadcasts, the models API, shuffling, bad input.

Writes rank<r>.json into the output directory; test_api.py asserts on it.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import warnings

import keras
import numpy as np
import tensorflow as tf

import tnt_notebook as tnt
from tnt_notebook.keras import data

RANK, SIZE = tnt.get_rank(), tnt.get_size()
X = np.random.default_rng(0).normal(size=(64, 5)).astype("float32")
Y = (X[:, 0] > 0).astype("int64")


def sequential(batch_norm=False):
    layers = [keras.Input((5,)), keras.layers.Dense(8, activation="relu")]
    if batch_norm:
        layers.append(keras.layers.BatchNormalization())
    return keras.Sequential([*layers, keras.layers.Dense(2)])


def compiled(model=None, optimizer="sgd", **kwargs):
    m = tnt.Model(model or sequential())
    m.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **kwargs,
    )
    return m


def same(a, b) -> bool:
    return len(a) == len(b) and all(np.array_equal(p, q) for p, q in zip(a, b, strict=True))


def error_of(fn) -> list:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        return [type(exc).__name__, str(exc)]
    return ["no error", ""]


def arrays_left_to_gc(shuffle: bool) -> int:
    """Copies of NumPy inputs that outlive their pipeline until a gc pass (the next fit's copy
    then lands in fresh memory): count them among what a gc pass would free."""
    x = np.arange(4096 * 16, dtype=np.float32).reshape(4096, 16)
    gc.collect()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        prepared = data.arrays_to_dataset(x, x[:, 0], batch_size=64, shuffle=shuffle)
        next(iter(prepared.dataset))
        del prepared
        gc.collect()
        return sum(type(o).__name__ == "EagerTensor" and o.shape == x.shape for o in gc.garbage)
    finally:
        gc.garbage.clear()
        gc.set_debug(0)
        gc.enable()


def main(out: str) -> None:
    res: dict = {}
    keras.utils.set_random_seed(RANK)  # different initial weights on every rank on purpose

    # -- weights are broadcast from the master before training and after set_weights --------
    m = compiled()
    before = [w.tolist() for w in m.get_weights()]
    m.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    res["initial_broadcast"] = {"own_weights_before": before}
    res["after_fit"] = [w.tolist() for w in m.get_weights()]
    m.set_weights([np.full_like(w, RANK + 1) for w in m.get_weights()])
    res["set_weights"] = float(np.mean([np.mean(w) for w in m.get_weights()]))

    # -- delegation of Keras attributes ----------------------------------------------------
    res["attributes"] = {
        "layers": len(m.layers),
        "metrics_names": m.metrics_names,
        "trainable_weights": len(m.trainable_weights),
        "optimizer": type(m.optimizer).__name__,
        "config_layers": len(m.get_config()["layers"]),
        "json_is_model": json.loads(m.to_json())["class_name"],
        "call_shape": list(m(X[:3]).shape),
    }

    # -- saving: master only unless tnt_save_all_devices -------------------------------------
    m = compiled()
    m.fit(X, Y, batch_size=16, epochs=2, verbose=0)
    final = m.get_weights()
    m.save(f"{out}/only_rank{RANK}.keras")
    m.save(f"{out}/model.keras")
    m.save(f"{out}/all.keras", tnt_save_all_devices=True)
    tnt.models.save_model(m, f"{out}/models_api_rank{RANK}.keras")
    m.save_weights(f"{out}/w_rank{RANK}.weights.h5")
    m.save_weights(f"{out}/w.weights.h5")
    res["saved"] = {
        "only_mine": os.path.exists(f"{out}/only_rank{RANK}.keras"),
        "models_api_mine": os.path.exists(f"{out}/models_api_rank{RANK}.keras"),
        "weights_mine": os.path.exists(f"{out}/w_rank{RANK}.weights.h5"),
        "all_devices_mine": os.path.exists(
            f"{out}/all.keras" if RANK == 0 else f"{out}/all.rank{RANK}.keras"
        ),
        "shared_visible": os.path.exists(f"{out}/model.keras"),
    }
    loaded = tnt.models.load_model(f"{out}/model.keras")
    uncompiled = tnt.models.load_model(f"{out}/model.keras", compile=False)
    res["load_model"] = {
        "type": type(loaded).__module__ + "." + type(loaded).__name__,
        "compiled": bool(loaded.compiled),
        "optimizer": type(loaded.optimizer).__name__,
        "weights_equal": same(loaded.get_weights(), final),
        "evaluate_equal": bool(
            np.allclose(
                loaded.evaluate(X, Y, batch_size=16, verbose=0),
                m.evaluate(X, Y, batch_size=16, verbose=0),
                rtol=1e-6,
            )
        ),
        "uncompiled": bool(getattr(uncompiled, "compiled", False)),
        "uncompiled_type": type(uncompiled).__name__,
    }
    fresh = compiled()
    fresh.load_weights(f"{out}/w.weights.h5")
    res["load_weights_equal"] = same(fresh.get_weights(), final)
    # -- the models API returns tnt.Model ---------------------------------------------------
    res["models_api"] = {
        "from_config": type(
            tnt.models.model_from_config({"class_name": "Sequential", "config": m.get_config()})
        ).__name__,
        "from_json": type(tnt.models.model_from_json(m.to_json())).__name__,
        "clone": type(tnt.models.clone_model(m)).__name__,
        "clone_layers": len(tnt.models.clone_model(m).layers),
    }

    # -- unseeded shuffles shuffle alike on every rank ---------------------------------------
    ds = tf.data.Dataset.range(40).shuffle(40).batch(8)
    prepared = data.distribute(ds)
    epochs = [[b.numpy().tolist() for b in prepared.dataset] for _ in range(2)]
    res["shuffle"] = {"epochs": epochs, "global_batch": prepared.global_batch_size}
    arrays = data.arrays_to_dataset(np.arange(40), batch_size=8, shuffle=True)
    res["shuffle_arrays"] = [[b.numpy().tolist() for b in arrays.dataset] for _ in range(2)]
    chunks = data.arrays_to_dataset(np.arange(42), batch_size=8, shuffle="batch")
    res["shuffle_batches"] = [[b.numpy().tolist() for b in chunks.dataset] for _ in range(4)]
    res["autotune_model"] = [p.dataset.options().autotune.enabled for p in (prepared, arrays)]
    res["arrays_left_to_gc"] = [arrays_left_to_gc(shuffle) for shuffle in (False, True)]
    res["same_object_again"] = [  # a list, not all(...): every rank runs every (collective) call
        data.distribute(again, in_step=step).dataset is data.distribute(again, in_step=step).dataset
        for again in (
            tf.data.Dataset.range(16).batch(4),
            tf.data.Dataset.range(16).shuffle(16).batch(4),
        )
        for step in (True, False)
    ]

    # -- bad input: a clear exception on every rank, before training -------------------------
    res["errors"] = {
        "batch_smaller_than_ranks": error_of(
            lambda: compiled().fit(X, Y, batch_size=SIZE - 1, epochs=1, verbose=0)
        ),
        "dataset_batch_smaller_than_ranks": error_of(
            lambda: compiled().fit(
                tf.data.Dataset.from_tensor_slices((X, Y)).batch(SIZE - 1), verbose=0
            )
        ),
        "inconsistent_micro_batch": error_of(
            lambda: compiled().fit(X, Y, batch_size=16, tnt_micro_batch_size=3, epochs=1, verbose=0)
        ),
        "inconsistent_validation_micro_batch": error_of(
            lambda: compiled().fit(
                X,
                Y,
                batch_size=16,
                validation_data=(X, Y),
                tnt_validation_micro_batch_size=5,
                epochs=1,
                verbose=0,
            )
        ),
        "class_and_sample_weight": error_of(
            lambda: compiled().fit(
                X, Y, batch_size=16, sample_weight=np.ones(len(X)), class_weight={0: 2.0}
            )
        ),
        "ftrl_object": error_of(lambda: compiled(optimizer=keras.optimizers.Ftrl())),
        "ftrl_name": error_of(lambda: compiled(optimizer="ftrl")),
        "train_on_batch": error_of(lambda: compiled().train_on_batch(X, Y)),
        "gradient_tape": error_of(lambda: _tape(compiled())),
        "custom_train_step": error_of(lambda: compiled(CustomStep([keras.layers.Dense(2)]))),
    }
    ok = compiled()
    res["consistent_micro_batch"] = error_of(
        lambda: ok.fit(X, Y, batch_size=16, tnt_micro_batch_size=16 // SIZE, epochs=1, verbose=0)
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(sequential(batch_norm=True)).fit(X, Y, batch_size=8, epochs=1, verbose=0)
        compiled(jit_compile=True)
    res["warnings"] = [str(w.message) for w in caught if "tnt" in str(w.message)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(sequential(batch_norm=True)).fit(X, Y, batch_size=32 * SIZE, epochs=1, verbose=0)
    res["warnings_large_micro_batch"] = [
        str(w.message) for w in caught if "BatchNormalization" in str(w.message)
    ]

    # BatchNormalization statistics are per rank during fit and averaged at its end
    bn = compiled(sequential(batch_norm=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bn.fit(X, Y, batch_size=64, epochs=2, verbose=0)
    res["batch_norm_checksum"] = [float(c) for c in bn.weights_checksum()]

    # validation data the user already split per rank (tnt_distribute_validation_dataset=False)
    vx, vy = X[RANK * 32 : (RANK + 1) * 32], Y[RANK * 32 : (RANK + 1) * 32]
    v = compiled()
    hist = v.fit(
        X,
        Y,
        batch_size=16,
        epochs=1,
        verbose=0,
        validation_data=(vx, vy),
        validation_batch_size=8,
        tnt_distribute_validation_dataset=False,
    )
    global_eval = v.evaluate(X[:64], Y[:64], batch_size=16, verbose=0, return_dict=True)
    res["per_rank_validation"] = {
        "val_loss": hist.history["val_loss"][-1],
        "evaluate_loss": global_eval["loss"],
    }

    # tf.data global batches are sliced inside the step, per-rank ones are not; one model
    # switching between the two must retrace its steps each time
    def batches(a, b, n):
        return tf.data.Dataset.from_tensor_slices((a, b)).batch(n)

    d = compiled()
    d.evaluate(batches(X[:64], Y[:64], 16), verbose=0)  # a test step that slices
    hist = d.fit(
        batches(X, Y, 16),
        epochs=1,
        verbose=0,
        validation_data=batches(vx, vy, 8),
        tnt_distribute_validation_dataset=False,
    )
    mine = d.evaluate(batches(vx, vy, 8), verbose=0, return_dict=True, tnt_distribute_dataset=False)
    whole = d.evaluate(batches(X[:64], Y[:64], 16), verbose=0, return_dict=True)
    res["slicing_modes"] = {
        "val_loss": hist.history["val_loss"][-1],
        "global_evaluate": whole["loss"],
        "per_rank_evaluate": mine["loss"],
    }

    with open(f"{out}/rank{RANK}.json", "w") as f:
        json.dump(res, f)


class CustomStep(keras.Sequential):
    def train_step(self, data):
        return super().train_step(data)


def _tape(model):
    with tf.GradientTape():
        model(X[:2])


if __name__ == "__main__":
    from worker_util import run_or_abort

    run_or_abort(main, sys.argv[1])

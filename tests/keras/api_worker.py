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


def functional():
    return keras.Model(*io_tensors())


def io_tensors():
    inp = keras.Input((5,))
    return inp, keras.layers.Dense(2)(keras.layers.Dense(8, activation="relu")(inp))


@keras.saving.register_keras_serializable(package="tnt_tests")
class Subclassed(keras.Model):
    def __init__(self, units=8, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.hidden = keras.layers.Dense(units, activation="relu")
        self.out = keras.layers.Dense(2)

    def call(self, x):
        return self.out(self.hidden(x))

    def get_config(self):
        return {**super().get_config(), "units": self.units}


MODELS = {"functional": functional, "sequential": sequential, "subclassed": Subclassed}


def describe(model, reference) -> dict:
    """What a restored model is, and whether it computes what ``reference`` computes once it has
    its weights (compiled alike if it is not)."""
    if not model.weights:
        model(X[:2])
    if not model.compiled:
        model.compile(
            optimizer="sgd",
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    same_weights = same(model.get_weights(), reference.get_weights())
    model.set_weights(reference.get_weights())
    return {
        "tnt_model": isinstance(model, tnt.Model) and isinstance(model, keras.Model),
        "class": type(model).__name__,
        "same_weights_as_saved": same_weights,
        "evaluate_equal": bool(
            np.allclose(
                model.evaluate(X, Y, batch_size=16, verbose=0),
                reference.evaluate(X, Y, batch_size=16, verbose=0),
                rtol=1e-6,
            )
        ),
    }


def model_api(kind: str, make, out: str) -> dict:
    """Every save/load/architecture/weights call of Tarantella's guide on one kind of model."""
    m = compiled(make())
    m.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    m.save(f"{out}/{kind}.keras")
    tnt.models.save_model(m, f"{out}/{kind}_api.keras")
    m.save_weights(f"{out}/{kind}.weights.h5")
    config = m.get_config()
    r = {
        "load_model": describe(tnt.models.load_model(f"{out}/{kind}.keras"), m),
        "load_model_saved_by_models_api": describe(
            tnt.models.load_model(f"{out}/{kind}_api.keras"), m
        ),
        "load_model_uncompiled_then_compiled": describe(
            tnt.models.load_model(f"{out}/{kind}.keras", compile=False), m
        ),
        "loaded_compiled": bool(tnt.models.load_model(f"{out}/{kind}.keras").compiled),
        "from_config_of_its_class": describe(m.from_config(config), m),
        "model_from_json": describe(tnt.models.model_from_json(m.to_json()), m),
        "clone_model": describe(tnt.models.clone_model(m), m),
    }
    if kind == "subclassed":  # its config names no layers: a clear error, and the way out
        r["model_from_config"] = error_of(lambda: tnt.models.model_from_config(config))
    else:  # the guide's example: restore the architecture, then the weights
        r["model_from_config"] = describe(tnt.models.model_from_config(config), m)
        r["tnt_Model_from_config"] = describe(tnt.Model.from_config(config), m)
        r["keras_style_config"] = describe(
            tnt.models.model_from_config({"class_name": type(m).__name__, "config": config}), m
        )
    fresh = compiled(make())
    fresh(X[:2])  # a subclassed model must be built before it loads weights, as in Keras
    fresh.load_weights(f"{out}/{kind}.weights.h5")
    r["load_weights"] = same(fresh.get_weights(), m.get_weights())
    return r


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
    res: dict = {"rank": RANK}
    keras.utils.set_random_seed(RANK)  # different initial weights on every rank on purpose

    # -- weights are broadcast from the master before training and after set_weights --------
    m = compiled()
    before = [w.tolist() for w in m.get_weights()]
    seen = Snapshot()
    m.fit(X, Y, batch_size=16, epochs=1, verbose=0, callbacks=[seen])
    res["initial_broadcast"] = {"own_weights_before": before, "at_train_begin": seen.begin}
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

    # -- a tnt.Model is a Keras model ---------------------------------------------------------
    seq = tnt.Sequential([keras.Input((5,)), keras.layers.Dense(8), keras.layers.Dense(2)])
    res["is_keras_model"] = {
        "tnt_model": isinstance(m, keras.Model) and isinstance(m, keras.Sequential),
        "tnt_sequential": isinstance(seq, tnt.Model) and isinstance(seq, keras.Sequential),
        "wrapping_sequential_gives_tnt_sequential": isinstance(
            tnt.Model(sequential()), tnt.Sequential
        ),
        "functional_arguments": isinstance(tnt.Model(*io_tensors()), tnt.Model),
        "strategy_argument": isinstance(
            tnt.Model(sequential(), parallel_strategy=tnt.ParallelStrategy.DATA), tnt.Model
        ),
        "class_name": type(tnt.Model(functional())).__name__,
    }

    # -- the guide's model API on Functional, Sequential and subclassed models -------------------
    res["model_api"] = {kind: model_api(kind, make, out) for kind, make in MODELS.items()}
    res["yaml"] = [error_of(lambda: m.to_yaml()), error_of(lambda: tnt.models.model_from_yaml(""))]

    # -- saving: master only, or every rank to the path it passed; atomically ---------------------
    m = compiled()
    m.fit(X, Y, batch_size=16, epochs=1, verbose=0)
    m.save(f"{out}/only_rank{RANK}.keras")
    tnt.models.save_model(m, f"{out}/models_api_rank{RANK}.keras")
    m.save_weights(f"{out}/w_rank{RANK}.weights.h5")
    m.save(f"{out}/all_rank{RANK}.keras", tnt_save_all_devices=True)
    tnt.models.save_model(m, f"{out}/all_api_rank{RANK}.keras", tnt_save_all_devices=True)
    m.save_weights(f"{out}/all_w_rank{RANK}.weights.h5", tnt_save_all_devices=True)
    m.save(f"{out}/shared.keras")
    res["saved"] = {
        "only_mine": os.path.exists(f"{out}/only_rank{RANK}.keras"),
        "models_api_mine": os.path.exists(f"{out}/models_api_rank{RANK}.keras"),
        "weights_mine": os.path.exists(f"{out}/w_rank{RANK}.weights.h5"),
        "all_devices_mine": all(
            os.path.exists(f"{out}/{name}")
            for name in (
                f"all_rank{RANK}.keras",
                f"all_api_rank{RANK}.keras",
                f"all_w_rank{RANK}.weights.h5",
            )
        ),
        "shared_visible": os.path.exists(f"{out}/shared.keras"),
    }
    res["errors_on_ranks"] = {
        "master_fails": error_of(lambda: m.save(f"{out}/missing/dir/x.keras")),
        "rank1_fails": error_of(
            lambda: m.save(
                f"{out}/fine{RANK}.keras" if RANK != 1 else f"{out}/missing/x.keras",
                tnt_save_all_devices=True,
            )
        ),
        "no_overwrite": error_of(lambda: m.save(f"{out}/shared.keras", overwrite=False)),
    }
    tnt.barrier()
    res["temporary_files_left"] = sorted(p for p in os.listdir(out) if p.startswith(".tnt-"))
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
        "gradient_tape": error_of(lambda: _tape(compiled())),
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
    seen = Snapshot()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bn.fit(X, Y, batch_size=64, epochs=2, verbose=0, callbacks=[seen])
    res["batch_norm"] = {
        "at_train_end": seen.end,
        "after_fit": [w.numpy().tolist() for w in bn.non_trainable_weights],
    }

    # ranks whose models drift apart are a bug: fit says so, naming them, and repairs nothing
    # (the drifting weight first, in the middle and last of the model's weights)
    res["divergence"], res["divergence_counts"] = {}, {}
    for where, layers in {
        "first": [RankCounter(), keras.layers.Dense(2)],
        "middle": [keras.layers.Dense(3), RankCounter(), keras.layers.Dense(2)],
        "last": [keras.layers.Dense(2), RankCounter()],
    }.items():
        drifting = compiled(keras.Sequential([keras.Input((5,)), *layers]))
        fit = lambda m=drifting: m.fit(X, Y, batch_size=16, epochs=1, verbose=0)  # noqa: E731
        res["divergence"][where] = error_of(fit)
        res["divergence_counts"][where] = [int(w) for w in drifting.non_trainable_weights]

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


class Snapshot(keras.callbacks.Callback):
    """The weights when training begins, and the non-trainable ones when Keras's loop ends."""

    def on_train_begin(self, logs=None):
        self.begin = [w.tolist() for w in self.model.get_weights()]

    def on_train_end(self, logs=None):
        self.end = [w.numpy().tolist() for w in self.model.non_trainable_weights]


class RankCounter(keras.layers.Layer):
    """Counts training calls by rank + 1: a state that differs between ranks."""

    def build(self, shape):
        self.count = self.add_weight(shape=(), dtype="int64", initializer="zeros", trainable=False)

    def call(self, x, training=False):
        if training:
            self.count.assign_add(RANK + 1)
        return x


def _tape(model):
    with tf.GradientTape():
        model(X[:2])


if __name__ == "__main__":
    from tests.keras.worker_util import run_or_abort

    run_or_abort(main, sys.argv[1])

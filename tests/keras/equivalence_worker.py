"""Runs on every rank of an mpiexec world: trains each scenario with tnt.Model and compares it with
plain serial Keras from the same initial weights (run once for the test module, or in the same
process), and writes the differences.

Imported by test_equivalence.py's mpiexec snippet (not a test module itself).
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import warnings
import zlib
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from sklearn.datasets import load_digits

import tnt_notebook as tnt
from tnt_notebook.keras import allreduce_op
from tnt_notebook.rank import api as ranks

EPOCHS = 3
#: Unequal class weights; class 2 left out weighs 1.0 (Keras's tf.data path needs every class).
CLASS_WEIGHT = {0: 0.5, 1: 2.0}
CLASS_WEIGHT_ALL = {0: 0.5, 1: 2.0, 2: 1.5}


def dense_data(n: int, features: int = 8, classes: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    w = rng.normal(size=(features, classes))
    y = np.argmax(x @ w + 0.5 * rng.normal(size=(n, classes)), axis=1).astype("int64")
    return x, y


def digits(n: int):
    d = load_digits()
    x = (d.images[:n] / 16.0).astype("float32")[..., None]
    return x, d.target[:n].astype("int64")


def functional_dense(features=8, classes=3):
    inp = keras.Input((features,))
    h = keras.layers.Dense(16, activation="relu")(inp)
    h = keras.layers.Dense(12, activation="tanh")(h)
    return keras.Model(inp, keras.layers.Dense(classes)(h))


def sequential_dense(features=8, classes=3):
    return keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(16, activation="relu"),
            keras.layers.Dense(classes),
        ]
    )


def lenet():
    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Conv2D(6, 3, padding="same", activation="relu"),
            keras.layers.AveragePooling2D(2),
            keras.layers.Conv2D(16, 3, activation="relu"),
            keras.layers.Flatten(),
            keras.layers.Dense(32, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


class Subclassed(keras.Model):
    def __init__(self, classes=3):
        super().__init__()
        self.hidden = keras.layers.Dense(16, activation="relu")
        self.out = keras.layers.Dense(classes)

    def call(self, x):
        return self.out(self.hidden(x))


def compile_(model, opt, steps_per_execution=1):
    model.compile(
        optimizer=opt(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=steps_per_execution,
    )


class Scenario:
    """A model, its optimizer, and `run(model, wrapped)`: what the scenario does with the model
    (fit, evaluate, predict), serial Keras's (wrapped False) or a tnt.Model's."""

    def __init__(self, make, opt, sample, run, steps_per_execution=1):
        self.make, self.opt, self.sample, self.run = make, opt, sample, run
        self.steps_per_execution = steps_per_execution

    def model(self, wrapped: bool):
        """The same initial weights and optimizer either way; the tnt.Model may run several steps
        per tf.function call (the serial result is the same)."""
        keras.utils.set_random_seed(7)
        model = self.make()
        model(self.sample)
        if not wrapped:
            compile_(model, self.opt)
            return model
        model = tnt.Model(model, compression=os.environ.get("TNT_TEST_COMPRESSION") or None)
        compile_(model, self.opt, self.steps_per_execution)
        return model

    def serial_outcome(self) -> dict:
        return self.run(self.model(wrapped=False), False)


def outcome(model, history, evaluated, predicted, callbacks=()) -> dict:
    """What a run ends with (and what its callbacks saw)."""
    out = {
        "history": history.history,
        "weights": model.get_weights(),
        "evaluate": evaluated,
        "predict": predicted,
    }
    for cb in callbacks:
        if isinstance(cb, WeightsEachBatch):
            out["seen"] = cb.seen
        if isinstance(cb, PendingEachBatch):
            out["pending"] = cb.pending
    return out


def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b) / (np.abs(b) + 1e-6))) if a.size else 0.0


def compare(ref: dict, out: dict, model) -> dict:
    """The differences of a tnt.Model's outcome (`out`) to serial Keras's (`ref`)."""
    h_ref, h_tnt = ref["history"], out["history"]
    assert set(h_ref) == set(h_tnt), (h_ref, h_tnt)
    weights = out["weights"]
    result = {
        "history_keys": sorted(h_tnt),
        "epochs": len(next(iter(h_tnt.values()))),
        "history_rel": max(rel(h_tnt[k], h_ref[k]) for k in h_ref),
        "weights_abs": max(
            float(np.max(np.abs(a - b))) for a, b in zip(weights, ref["weights"], strict=True)
        ),
        "evaluate_rel": rel(out["evaluate"], ref["evaluate"]),
        "predict_abs": float(np.max(np.abs(out["predict"] - ref["predict"]))),
        "predict_shape": list(out["predict"].shape),
        "checksum": [zlib.crc32(np.ascontiguousarray(w).tobytes()) for w in weights],
        # what the gradient buckets of fit carried (the first tensor: the metric states)
        "gradient_dtypes": sorted(
            {
                np.dtype(d).name
                for kind, specs in model._tnt.reducers
                if kind == "train"  # (with the metric states in front unless steps defer)
                for _, d in (specs if model._tnt.deferred else specs[1:])
            }
        ),
    }
    if "seen" in out:
        result["batch_weights_abs"] = max(
            float(np.max(np.abs(u - v)))
            for seen_a, seen_b in zip(ref["seen"], out["seen"], strict=True)
            for u, v in zip(seen_a, seen_b, strict=True)
        )
    if "pending" in out:
        result["pending_at_batch_end"] = out["pending"]
    return result


def against_serial(name: str, scenario: Scenario) -> dict:
    """Runs `scenario` with a tnt.Model and compares it to serial Keras's outcome, which is read
    from $TNT_TEST_SERIAL_OUTCOMES (written once for a test module by write_serial_outcomes:
    the ranks of a world need not compute it each) or computed here."""
    stored = os.environ.get("TNT_TEST_SERIAL_OUTCOMES")
    if stored:
        ref = pickle.loads(Path(stored, f"{name}.pkl").read_bytes())
    else:
        ref = scenario.serial_outcome()
    model = scenario.model(wrapped=True)
    return compare(ref, scenario.run(model, True), model)


def write_serial_outcomes(outdir: str) -> None:
    """Serial Keras's outcome of every scenario, one pickle each (a plain process, no MPI)."""
    for name, scenario in {**scenarios(), **pending_update_scenarios()}.items():
        Path(outdir, f"{name}.pkl").write_bytes(pickle.dumps(scenario.serial_outcome()))


class WeightsEachBatch(keras.callbacks.Callback):
    """Reads the weights after every step, as a checkpoint every few batches would."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def on_train_batch_end(self, batch, logs=None):
        self.seen.append(self.model.get_weights())


class PendingEachBatch(keras.callbacks.Callback):
    """Records after every step whether its update is still pending; reads no weights."""

    reads_weights_each_batch = False

    def __init__(self):
        super().__init__()
        self.pending = []

    def on_train_batch_end(self, batch, logs=None):
        deferred = getattr(self.model, "_tnt", None) and self.model._tnt.deferred
        self.pending.append(bool(deferred and deferred.pending.numpy()))


def run_arrays(
    make,
    opt,
    x,
    y,
    batch,
    *,
    validation_data=None,
    class_weight=None,
    steps_per_execution=1,
    callbacks=list,
):
    def run(model, wrapped):
        cbs = callbacks()
        history = model.fit(
            x,
            y,
            batch_size=batch,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            validation_data=validation_data,
            class_weight=class_weight,
            callbacks=cbs,
        )
        return outcome(
            model,
            history,
            model.evaluate(x, y, batch_size=batch, verbose=0),
            model.predict(x, batch_size=batch, verbose=0),
            cbs,
        )

    return Scenario(make, opt, x[:2], run, steps_per_execution)


def run_dataset(make, opt, make_ds, x, batch, *, per_rank=False):
    """fit/evaluate/predict on tf.data datasets of global batches (fresh dataset per consumer)."""

    def run(model, wrapped):
        if not wrapped:
            history = model.fit(make_ds(), epochs=EPOCHS, verbose=0)
        elif per_rank:  # the user hands each rank its own slice: tnt_distribute_dataset=False
            r, p = tnt.get_rank(), tnt.get_size()

            def mine(a, b):
                n = tf.shape(a)[0]
                return a[r * n // p : (r + 1) * n // p], b[r * n // p : (r + 1) * n // p]

            history = model.fit(
                make_ds().map(mine), epochs=EPOCHS, verbose=0, tnt_distribute_dataset=False
            )
        else:
            history = model.fit(make_ds(), epochs=EPOCHS, verbose=0, tnt_micro_batch_size=None)
        plain = tf.data.Dataset.from_tensor_slices(x).batch(batch)
        return outcome(
            model, history, model.evaluate(make_ds(), verbose=0), model.predict(plain, verbose=0)
        )

    return Scenario(make, opt, x[:2], run)


class Batches(keras.utils.PyDataset):
    """A PyDataset of global batches (Keras reads it by index)."""

    def __init__(self, x, y, batch):
        super().__init__()
        self.x, self.y, self.batch = x, y, batch

    def __len__(self):
        return -(-len(self.x) // self.batch)

    def __getitem__(self, i):
        s = slice(i * self.batch, (i + 1) * self.batch)
        return self.x[s], self.y[s]


def run_inputs(make, opt, make_input, x, batch, *, class_weight=None):
    """fit/evaluate on inputs Keras reads without a known length (fresh input per consumer)."""

    def run(model, wrapped):
        history = model.fit(
            make_input(), epochs=EPOCHS, verbose=0, class_weight=class_weight, shuffle=False
        )
        return outcome(
            model,
            history,
            model.evaluate(make_input(), verbose=0),
            model.predict(x, batch_size=batch, verbose=0),
        )

    return Scenario(make, opt, x[:2], run)


def scenarios():
    xd, yd = dense_data(103)
    xe, ye = dense_data(101, seed=1)
    xv, yv = dense_data(37, seed=2)
    xg, yg = digits(240)

    def digits_ds():
        ds = tf.data.Dataset.from_tensor_slices((xg, yg))
        return ds.shuffle(240, seed=5).batch(32)

    return {
        # batch 20: divisible by 2 not 3; 103 samples: short last batch of 3
        "dense_sgd": run_arrays(functional_dense, lambda: keras.optimizers.SGD(0.1), xd, yd, 20),
        # LeNet-like conv net on sklearn digits, shuffled tf.data pipeline, momentum
        "lenet_sgd_momentum_dataset": run_dataset(
            lenet, lambda: keras.optimizers.SGD(0.05, momentum=0.9), digits_ds, xg, 32
        ),
        "sequential_nesterov_validation": run_arrays(
            sequential_dense,
            lambda: keras.optimizers.SGD(0.05, momentum=0.9, nesterov=True),
            xd,
            yd,
            16,
            validation_data=(xv, yv),
        ),
        # 4 steps per tf.function call: bucket results are reused only once TensorFlow let go
        "subclassed_adam_4_steps_per_execution": run_arrays(
            Subclassed, lambda: keras.optimizers.Adam(0.01), xd, yd, 24, steps_per_execution=4
        ),
        "rmsprop_batch_21_class_weight": run_arrays(
            functional_dense,
            lambda: keras.optimizers.RMSprop(0.01),
            xd,
            yd,
            21,
            class_weight=CLASS_WEIGHT,
        ),
        # 101 samples, batch 20: the last global batch has 1 sample (empty micro-batches)
        "adagrad_single_sample_last_batch": run_arrays(
            functional_dense, lambda: keras.optimizers.Adagrad(0.1), xe, ye, 20
        ),
        "unknown_cardinality_dataset_class_weight": run_inputs(
            functional_dense,
            lambda: keras.optimizers.SGD(0.1, momentum=0.5),
            lambda: (
                tf.data.Dataset.from_tensor_slices((xd, yd)).batch(20).filter(lambda a, b: True)
            ),
            xd,
            20,
            class_weight=CLASS_WEIGHT_ALL,
        ),
        "pydataset_input": run_inputs(
            sequential_dense,
            lambda: keras.optimizers.Adam(0.01),
            lambda: Batches(xd, yd, 24),
            xd,
            24,
        ),
        "per_rank_dataset_micro_batches": run_dataset(
            sequential_dense,
            lambda: keras.optimizers.SGD(0.1),
            lambda: tf.data.Dataset.from_tensor_slices((xd, yd)).batch(20),
            xd,
            20,
            per_rank=True,
        ),
    }


def pending_update_scenarios():
    """Run only when asked: across nodes with TNT_OVERLAP=steps, steps that leave their update to
    the next, and a callback that reads the weights between steps (the update is applied before
    it runs)."""
    xd, yd = dense_data(103)
    xv, yv = dense_data(37, seed=2)
    return {
        "pending_updates_between_steps": run_arrays(
            functional_dense,
            lambda: keras.optimizers.SGD(0.1, momentum=0.9),
            xd,
            yd,
            20,
            validation_data=(xv, yv),
            callbacks=lambda: [PendingEachBatch()],
        ),
        "batch_callback_sees_serial_weights": run_arrays(
            functional_dense,
            lambda: keras.optimizers.Adam(0.01),
            xd,
            yd,
            20,
            callbacks=lambda: [WeightsEachBatch(), PendingEachBatch()],
        ),
    }


def summary_on_ranks(names: tuple[str, ...], tol: float) -> str:
    """Runs the scenarios `names` on every rank of a cluster (a collective); returns "RESULT
    <every difference to serial Keras within tol> <weights bitwise equal on every rank> <worst>"."""
    results = [against_serial(name, scenarios()[name]) for name in names]
    keys = ("history_rel", "weights_abs", "evaluate_rel", "predict_abs")
    worst = max(v[k] for v in results for k in keys)
    sums = np.array([v["checksum"][0] for v in results], "int64")
    same = bool((tnt.allreduce(sums, "max") == tnt.allreduce(sums, "min")).all())
    return f"RESULT {worst < tol} {same} {worst}"


def main(outdir: str) -> None:
    # the ranks listed in FALLBACK_RANKS reduce through the fallback, the others through the op
    if str(tnt.get_rank()) in os.environ.get("FALLBACK_RANKS", "").split(","):
        os.environ["TNT_TF_OP"] = "0"
    if str(tnt.get_rank()) in os.environ.get("NO_OVERLAP_RANKS", "").split(","):
        os.environ["TNT_OVERLAP"] = "0"
    if str(tnt.get_rank()) in os.environ.get("ACROSS_STEPS_RANKS", "").split(","):
        os.environ["TNT_OVERLAP"] = "steps"
    # the tf.numpy_function fallback reduces through reduce_bucket(reuse=True); the op does not
    python_reductions = 0
    reduce_bucket = ranks.FusedAllreduce.reduce_bucket

    def counting(self, *args, **kwargs):
        nonlocal python_reductions
        python_reductions += bool(kwargs.get("reuse"))
        return reduce_bucket(self, *args, **kwargs)

    ranks.FusedAllreduce.reduce_bucket = counting
    results = {}
    chosen = os.environ.get("TNT_TEST_SCENARIOS", "").split(",")  # default: all of scenarios()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for name, scenario in scenarios().items():
            if chosen == [""] or name in chosen:
                results[name] = against_serial(name, scenario)
        for name, scenario in pending_update_scenarios().items():
            if name in chosen:
                results[name] = against_serial(name, scenario)
    with open(f"{outdir}/rank{tnt.get_rank()}.json", "w") as f:
        json.dump(
            {
                "size": tnt.get_size(),
                "results": results,
                "op_library": allreduce_op.op_library() is not None,
                "python_reductions": python_reductions,
                "warnings": [str(w.message) for w in caught if str(w.message).startswith("tnt:")],
                "transport": ranks.engine_info()["transport"],
                "num_nodes": ranks.engine_info()["num_nodes"],
                "in_halves": allreduce_op.prepare().in_halves,
                "across_steps": allreduce_op.prepare().across_steps,
                "posting_sites": ranks.current_engine().posting_sites,
            },
            f,
        )


if __name__ == "__main__":
    from tests.keras.worker_util import run_or_abort

    run_or_abort(main, sys.argv[1])

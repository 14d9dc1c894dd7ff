"""Runs on every rank: compiled metrics in every form, with every optimizer kind, through fit
(train and validation) and evaluate (before and after fit), on arrays and tf.data, against serial
Keras trained in the same process from the same weights.

Writes rank<r>.json: per configuration the largest relative difference of every log that
callbacks, History and evaluate see, and which log it was.
"""

from __future__ import annotations

import json

import keras
import numpy as np
import tensorflow as tf

import tnt_notebook as tnt

N, N_VAL, BATCH, EPOCHS = 48, 32, 17, 2  # micro-batches of 8 and 9 samples, or 5, 6 and 6
RNG = np.random.default_rng(0)
X = RNG.normal(size=(N + N_VAL, 6)).astype("float32")
Y = np.argmax(X[:, :3] + 0.3 * RNG.normal(size=(N + N_VAL, 3)), axis=1).astype("int64")
W = RNG.uniform(0.2, 2.0, size=N + N_VAL).astype("float32")

OPTIMIZERS = {
    "sgd": lambda: keras.optimizers.SGD(learning_rate=0.05),
    "momentum": lambda: keras.optimizers.SGD(learning_rate=0.05, momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(learning_rate=0.01),
}


class PredictedClassZero(keras.metrics.Metric):
    """A user's Metric subclass with state of its own: the share of samples predicted as class 0."""

    def __init__(self, name="predicted_zero", **kwargs):
        super().__init__(name=name, **kwargs)
        self.hits = self.add_variable((), initializer="zeros", name="hits")
        self.seen = self.add_variable((), initializer="zeros", name="seen")

    def update_state(self, y_true, y_pred, sample_weight=None):
        zero = tf.cast(tf.argmax(y_pred, axis=-1) == 0, "float32")
        self.hits.assign_add(tf.reduce_sum(zero))
        self.seen.assign_add(tf.cast(tf.size(zero), "float32"))

    def result(self):
        return self.hits / tf.maximum(self.seen, 1.0)


def largest_logit(y_true, y_pred):
    """A plain function as metric (Keras wraps it in a mean)."""
    return tf.reduce_max(y_pred, axis=-1)


FORMS = {  # compile arguments (made afresh for every model), and whether samples are weighted
    "string": (lambda: {"metrics": ["accuracy"]}, False),
    "object": (lambda: {"metrics": [keras.metrics.SparseCategoricalAccuracy()]}, False),
    "subclass": (lambda: {"metrics": [PredictedClassZero()]}, False),
    "function": (lambda: {"metrics": [largest_logit]}, False),
    "weighted": (
        lambda: {"weighted_metrics": [keras.metrics.SparseCategoricalAccuracy(name="w_acc")]},
        True,
    ),
}


def single_output():
    return keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(3)]
    )


def two_outputs():
    inp = keras.Input((6,))
    h = keras.layers.Dense(8, activation="relu")(inp)
    cls = keras.layers.Dense(3, name="cls")(h)
    reg = keras.layers.Dense(1, name="reg")(h)
    return keras.Model(inp, {"cls": cls, "reg": reg})


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
MULTI = {  # per-output metrics as a dict and as a list (Keras also tracks each output's loss)
    "outputs_dict": lambda: {
        "loss": {"cls": LOSS, "reg": "mse"},
        "metrics": {"cls": [keras.metrics.SparseCategoricalAccuracy()], "reg": ["mae"]},
    },
    "outputs_list": lambda: {
        "loss": [LOSS, "mse"],
        "metrics": [
            [keras.metrics.SparseCategoricalAccuracy()],
            [keras.metrics.MeanSquaredError()],
        ],
    },
}


class Recorder(keras.callbacks.Callback):
    """Every log a callback receives, in order."""

    def __init__(self):
        super().__init__()
        self.logs: list[tuple[str, dict]] = []

    def _keep(self, hook, logs):
        self.logs.append((hook, {k: float(v) for k, v in (logs or {}).items()}))

    def on_train_batch_end(self, batch, logs=None):
        self._keep("train_batch", logs)

    def on_test_batch_end(self, batch, logs=None):
        self._keep("test_batch", logs)

    def on_epoch_end(self, epoch, logs=None):
        self._keep("epoch", logs)


def targets(multi: bool, rows: slice):
    y = Y[rows]
    return {"cls": y, "reg": X[rows, :1]} if multi else y


def inputs(kind: str, multi: bool, weighted: bool, rows: slice) -> dict:
    """fit/evaluate arguments for the given rows as arrays or as a batched tf.data.Dataset."""
    x, y = X[rows], targets(multi, rows)
    sw = W[rows] if weighted else None
    if kind == "arrays":
        return {"x": x, "y": y, "sample_weight": sw, "batch_size": BATCH}
    parts = (x, y) if sw is None else (x, y, sw)
    return {"x": tf.data.Dataset.from_tensor_slices(parts).batch(BATCH)}


def run(model, compile_args, optimizer, kind, multi, weighted) -> dict:
    model.compile(optimizer=optimizer(), **{"loss": LOSS, **compile_args})
    train, val = slice(0, N), slice(N, N + N_VAL)
    before = model.evaluate(**inputs(kind, multi, weighted, val), verbose=0, return_dict=True)
    recorder = Recorder()
    fit_args = inputs(kind, multi, weighted, train)
    validation = inputs(kind, multi, weighted, val)
    if kind == "arrays":
        validation = (validation["x"], validation["y"], validation["sample_weight"])
        fit_args["shuffle"] = False
    else:
        validation = validation["x"]
    history = model.fit(
        **fit_args, epochs=EPOCHS, validation_data=validation, callbacks=[recorder], verbose=0
    )
    after = model.evaluate(**inputs(kind, multi, weighted, val), verbose=0, return_dict=True)
    return {
        "evaluate_before": before,
        "history": history.history,
        "callback_logs": recorder.logs,
        "evaluate_after": after,
    }


def flatten(result: dict) -> dict[str, float]:
    flat = {}
    for what in ("evaluate_before", "evaluate_after"):
        flat.update({f"{what}/{k}": v for k, v in result[what].items()})
    for k, values in result["history"].items():
        flat.update({f"history/{k}/{i}": v for i, v in enumerate(values)})
    for i, (hook, logs) in enumerate(result["callback_logs"]):
        flat.update({f"callback/{i}:{hook}/{k}": v for k, v in logs.items()})
    return flat


def compare(ref: dict, got: dict) -> dict:
    a, b = flatten(ref), flatten(got)
    if a.keys() != b.keys():
        return {"rel": float("inf"), "where": f"keys differ: {sorted(a.keys() ^ b.keys())[:5]}"}
    worst, where = 0.0, ""
    for k, v in a.items():
        rel = abs(b[k] - v) / max(1.0, abs(v))
        if rel > worst:
            worst, where = rel, f"{k}: serial {v!r}, tnt {b[k]!r}"
    return {"rel": worst, "where": where, "logs": len(a)}


def configurations(first_kind: int):
    """Every optimizer x metric form, on arrays and tf.data in turn (starting with kind
    ``first_kind``: two worlds starting apart run every combination once), and the per-output
    metrics."""
    kinds = ("arrays", "tf.data")
    for k, (opt, (form, (args, weighted))) in enumerate(
        (opt, item) for opt in OPTIMIZERS for item in FORMS.items()
    ):
        kind = kinds[(k + first_kind) % 2]
        yield f"{opt}/{form}/{kind}", single_output, args, opt, kind, False, weighted
    for name, args in MULTI.items():
        yield f"sgd/{name}/tf.data", two_outputs, args, "sgd", "tf.data", True, False


def main(out: str) -> None:
    """Each optimizer x form on one input kind: arrays first on 2 ranks, tf.data first on 3."""
    results = {}
    for name, make, args, opt, kind, multi, weighted in configurations(tnt.get_size() % 2):
        keras.utils.set_random_seed(11)
        ref = make()
        start = [w.copy() for w in ref.get_weights()]
        serial = None  # trained by the master rank alone, for everyone
        if tnt.is_master_rank():
            serial = run(ref, args(), OPTIMIZERS[opt], kind, multi, weighted)
        serial = tnt.broadcast(serial)
        model = make()
        model.set_weights(start)
        distributed = run(tnt.Model(model), args(), OPTIMIZERS[opt], kind, multi, weighted)
        results[name] = compare(serial, distributed)
    with open(f"{out}/rank{tnt.get_rank()}.json", "w") as f:
        json.dump({"size": tnt.get_size(), "results": results}, f)

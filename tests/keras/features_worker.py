"""Runs on every rank of an mpiexec world: each Keras training feature of FEATURES trained with
plain serial Keras and with tnt.Model in this same process (same seed, data and initial weights),
and the differences written per feature.

Imported by test_keras_features.py's mpiexec snippet (not a test module itself).
"""

from __future__ import annotations

import json
import math
import os
import traceback
import zlib

import keras
import numpy as np
import tensorflow as tf

import tnt_notebook as tnt

EPOCHS = 2
BATCH = 12  # global; 50 samples: a last batch of 2 (empty micro-batches on 3 ranks)
N = 50
#: rtol and atol of every comparison (float32); a feature may name its own.
TOL = (1e-5, 1e-6)
FP16_TOL = (2e-2, 2e-3)
FEATURES: dict = {}


def feature(tol=TOL, ranks_differ: bool = False):
    """Registers ``fn(wrap) -> outcome``: ``wrap`` is ``lambda m: m`` for serial Keras and
    ``tnt.Model`` for the distributed run. ``ranks_differ``: what the outcome holds is compared
    between the ranks, not with serial Keras (random draws)."""

    def register(fn):
        FEATURES[fn.__name__] = (fn, tol, ranks_differ)
        return fn

    return register


# -- data and models ----------------------------------------------------------------------------
def dense_data(n=N, features=6, classes=3, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    y = np.argmax(x @ rng.normal(size=(features, classes)), axis=1).astype("int64")
    return x, y


def regression_data(n=N, features=6, seed=1):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, features)).astype("float32")
    return x, (x @ rng.normal(size=(features, 2))).astype("float32")


def sequence_data(n=N, length=7, vocab=20, seed=2):
    """Rows of different lengths padded with 0, a label per time step."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, length + 1, size=n)
    x = np.zeros((n, length), dtype="int64")
    for i, k in enumerate(lengths):
        x[i, :k] = rng.integers(1, vocab, size=k)
    return x, (x % 3).astype("int64")


def mlp(features=6, out=3, **dense):
    keras.utils.set_random_seed(11)
    return keras.Sequential(
        [keras.Input((features,)), keras.layers.Dense(8, activation="tanh", **dense),
         keras.layers.Dense(out)]
    )  # fmt: skip


def classifier(model, opt=None, **kwargs):
    model.compile(
        optimizer=opt or keras.optimizers.SGD(0.1),
        loss=kwargs.pop("loss", keras.losses.SparseCategoricalCrossentropy(from_logits=True)),
        metrics=kwargs.pop("metrics", ["accuracy"]),
        **kwargs,
    )
    return model


def outcome(model, history=None, **more) -> dict:
    out = {f"w{i}": w for i, w in enumerate(model.get_weights())}
    if history is not None:
        out |= {f"history.{k}": v for k, v in history.history.items()}
    for name, value in more.items():
        if isinstance(value, dict):
            out |= {f"{name}.{k}": v for k, v in value.items()}
        elif isinstance(value, list | tuple):
            out |= {f"{name}.{i}": v for i, v in enumerate(value)}
        else:
            out[name] = value
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


def fit_and_evaluate(model, x, y, **fit):
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False, **fit)
    evaluated = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    return outcome(model, history, evaluate=evaluated, predict=model.predict(x, verbose=0))


# -- features that serial Keras users bring -----------------------------------------------------
@feature()
def mean_loss_arrays(wrap):
    x, y = dense_data()
    return fit_and_evaluate(classifier(wrap(mlp())), x, y)


@feature()
def sum_reduction_loss(wrap):
    x, y = regression_data()
    model = wrap(mlp(out=2))
    model.compile(keras.optimizers.SGD(0.002), keras.losses.MeanSquaredError(reduction="sum"))
    return fit_and_evaluate(model, x, y)


@feature()
def weighted_mean_loss_with_sample_weight(wrap):
    x, y = dense_data()
    weights = np.linspace(0.1, 3.0, N).astype("float32")
    model = wrap(mlp())
    loss = keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="mean_with_sample_weight"
    )
    classifier(model, loss=loss, weighted_metrics=["accuracy"])
    history = model.fit(x, y, sample_weight=weights, batch_size=BATCH, epochs=EPOCHS, verbose=0,
                        shuffle=False)  # fmt: skip
    evaluated = model.evaluate(x, y, sample_weight=weights, batch_size=BATCH, verbose=0,
                               return_dict=True)  # fmt: skip
    return outcome(model, history, evaluate=evaluated)


@feature()
def masked_sequence_loss(wrap):
    x, y = sequence_data()
    keras.utils.set_random_seed(3)
    model = wrap(keras.Sequential([
        keras.Input((7,), dtype="int64"),
        keras.layers.Embedding(20, 5, mask_zero=True),
        keras.layers.Dense(6, activation="tanh"),
        keras.layers.Dense(3),
    ]))  # fmt: skip
    classifier(model, keras.optimizers.SGD(0.3))
    return fit_and_evaluate(model, x, y)


@feature()
def sum_loss_and_mean_loss_on_two_outputs_with_regularisers(wrap):
    x, y = regression_data()
    keras.utils.set_random_seed(5)
    inp = keras.Input((6,))
    h = keras.layers.Dense(
        8, activation="tanh", kernel_regularizer="l2", activity_regularizer="l1"
    )(inp)
    model = wrap(keras.Model(inp, {"a": keras.layers.Dense(1, name="a")(h),
                                   "b": keras.layers.Dense(1, name="b")(h)}))  # fmt: skip
    model.compile(
        keras.optimizers.Adam(0.01),
        loss={"a": keras.losses.MeanSquaredError(reduction="sum"), "b": "mse"},
        loss_weights={"a": 0.05, "b": 2.0},
    )
    targets = {"a": y[:, :1], "b": y[:, 1:]}
    return fit_and_evaluate(model, x, targets)


@feature(tol=FP16_TOL)
def mixed_float16_loss_scaling(wrap):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = dense_data()
        model = wrap(mlp())
        classifier(model, keras.optimizers.SGD(0.1))
        out = fit_and_evaluate(model, x * 300.0, y)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    opt = model.optimizer
    return out | outcome(model, applied_steps=opt.iterations, loss_scale=opt.dynamic_scale)


@feature()
def predict_dict_outputs(wrap):
    x, y = regression_data()
    keras.utils.set_random_seed(5)
    inp = keras.Input((6,))
    model = wrap(keras.Model(inp, {"first": keras.layers.Dense(2)(inp),
                                   "second": keras.layers.Dense(3)(inp)}))  # fmt: skip
    predicted = model.predict(x, batch_size=BATCH, verbose=0)
    return outcome(model, first=predicted["first"], second=predicted["second"])


@feature()
def test_and_predict_on_batch_after_dataset_evaluate(wrap):
    x, y = dense_data()
    model = classifier(wrap(mlp()))
    evaluated = model.evaluate(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), verbose=0, return_dict=True
    )
    on_batch = model.test_on_batch(x[:BATCH], y[:BATCH], return_dict=True)
    return outcome(
        model, evaluate=evaluated, test_on_batch=on_batch,
        predict_on_batch=model.predict_on_batch(x[:BATCH]),
    )  # fmt: skip


class EvaluatesEachEpoch(keras.callbacks.Callback):
    def __init__(self, x, y):
        super().__init__()
        self.x, self.y, self.seen = x, y, []

    def on_epoch_end(self, epoch, logs=None):
        dataset = tf.data.Dataset.from_tensor_slices((self.x, self.y)).batch(BATCH)
        self.seen.append(self.model.evaluate(dataset, verbose=0))
        self.seen.append(self.model.predict(self.x[:5], verbose=0))


@feature()
def callback_evaluates_and_predicts_inside_fit(wrap):
    x, y = dense_data()
    model = classifier(wrap(mlp()))
    callback = EvaluatesEachEpoch(x[:20], y[:20])
    out = fit_and_evaluate(model, x, y, callbacks=[callback])
    return out | outcome(model, seen=callback.seen)


@feature()
def frozen_layer_stays_untouched(wrap):
    x, y = dense_data()
    model = mlp()
    model.layers[0].trainable = False
    model.layers[0].kernel.assign(model.layers[0].kernel * (1.0 + 1.0 / 3.0))
    return fit_and_evaluate(classifier(wrap(model)), x, y)


@feature()
def explicit_progbar_logger(wrap):
    x, y = dense_data()
    model = classifier(wrap(mlp()))
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False,
                        validation_data=(x[:20], y[:20]),
                        callbacks=[keras.callbacks.ProgbarLogger()])  # fmt: skip
    return outcome(model, history)


@feature()
def dataset_and_generator_inputs(wrap):
    x, y = dense_data()
    model = classifier(wrap(mlp()))
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    first = model.fit(dataset, epochs=EPOCHS, verbose=0)

    def batches():
        for i in range(0, N, BATCH):
            yield x[i : i + BATCH], y[i : i + BATCH]

    second = model.fit(batches(), epochs=1, verbose=0)
    return outcome(model, first, second=second.history["loss"])


@feature()
def class_weight_and_validation_split(wrap):
    x, y = dense_data()
    model = classifier(wrap(mlp()))
    history = model.fit(x, y, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False,
                        class_weight={0: 0.5, 1: 2.0, 2: 1.0}, validation_split=0.2)  # fmt: skip
    return outcome(model, history)


class ActivityPenalty(keras.layers.Layer):
    """``add_loss`` of a mean over the batch, as user layers write it."""

    def call(self, inputs):
        self.add_loss(0.01 * keras.ops.mean(keras.ops.square(inputs)))
        return inputs


@feature()
def add_loss_and_steps_per_execution(wrap):
    x, y = dense_data()
    keras.utils.set_random_seed(11)
    model = wrap(keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), ActivityPenalty(),
        keras.layers.Dense(3),
    ]))  # fmt: skip
    classifier(model, steps_per_execution=3)
    return fit_and_evaluate(model, x, y)


# -- the run on this rank -----------------------------------------------------------------------
def compare(serial: dict, distributed: dict, tol) -> dict:
    """The worst of |a - b| / (atol + rtol |b|) over every array (<= 1: equal within tol)."""
    rtol, atol = tol
    if set(serial) != set(distributed):
        return {"error": f"keys differ: {sorted(set(serial) ^ set(distributed))}"}
    worst, where = 0.0, ""
    for key, ref in serial.items():
        got = distributed[key]
        if got.shape != ref.shape:
            return {"error": f"{key}: shape {got.shape} != serial's {ref.shape}"}
        excess = float(np.max(np.abs(got - ref) / (atol + rtol * np.abs(ref)), initial=0.0))
        if math.isnan(excess) or excess > worst:
            worst, where = (math.inf if math.isnan(excess) else excess), key
    return {"worst": worst, "where": where}


def checksum(out: dict) -> int:
    return zlib.crc32(b"".join(np.ascontiguousarray(out[k]).tobytes() for k in sorted(out)))


def main(outdir: str) -> None:
    chosen = [c for c in os.environ.get("TNT_TEST_FEATURES", "").split(",") if c]
    results = {}
    for name, (fn, tol, ranks_differ) in FEATURES.items():
        if chosen and name not in chosen:
            continue
        try:
            serial = fn(lambda m: m)
            distributed = fn(tnt.Model)
            result = compare(serial, distributed, tol) if not ranks_differ else {}
            result["checksum"] = checksum(distributed)
        except Exception as exc:  # (the same on every rank: the world stays in step)
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        results[name] = result
    with open(f"{outdir}/rank{tnt.get_rank()}.json", "w") as f:
        json.dump({"size": tnt.get_size(), "results": results}, f)

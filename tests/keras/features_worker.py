"""Runs on every rank of an mpiexec world: each Keras training feature of FEATURES trained with
plain serial Keras and with tnt.Model in this same process (same seed, data and initial weights),
and the differences written per feature.

Imported by test_keras_features.py's mpiexec snippet (not a test module itself). Over 500 lines:
one small case per Keras feature, read side by side.
"""

from __future__ import annotations

import contextlib
import io
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
        [
            keras.Input((features,)),
            keras.layers.Dense(8, activation="tanh", **dense),
            keras.layers.Dense(out),
        ]
    )


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
    history = model.fit(
        x, y, sample_weight=weights, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False
    )
    evaluated = model.evaluate(
        x, y, sample_weight=weights, batch_size=BATCH, verbose=0, return_dict=True
    )
    return outcome(model, history, evaluate=evaluated)


@feature()
def masked_sequence_loss(wrap):
    x, y = sequence_data()
    keras.utils.set_random_seed(3)
    model = wrap(
        keras.Sequential(
            [
                keras.Input((7,), dtype="int64"),
                keras.layers.Embedding(20, 5, mask_zero=True),
                keras.layers.Dense(6, activation="tanh"),
                keras.layers.Dense(3),
            ]
        )
    )
    classifier(model, keras.optimizers.SGD(0.3))
    return fit_and_evaluate(model, x, y)


@feature()
def masked_and_sum_losses_on_tf_data(wrap):
    """Global batches from tf.data, sliced inside the step (arrays reach it as micro-batches)."""
    x, y = sequence_data()
    keras.utils.set_random_seed(4)
    inp = keras.Input((7,), dtype="int64")
    h = keras.layers.Embedding(20, 5, mask_zero=True)(inp)
    outputs = [keras.layers.Dense(3, name="classes")(h), keras.layers.Dense(1, name="parity")(h)]
    model = wrap(keras.Model(inp, outputs))
    model.compile(
        keras.optimizers.SGD(0.05),
        loss=[
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            keras.losses.MeanSquaredError(reduction="sum"),
        ],
        loss_weights=[1.0, 0.01],
    )
    targets = (y, (y % 2).astype("float32")[..., None])
    data = tf.data.Dataset.from_tensor_slices((x, targets)).batch(BATCH)
    history = model.fit(data, epochs=EPOCHS, verbose=0)
    return outcome(model, history, evaluate=model.evaluate(data, verbose=0, return_dict=True))


@feature()
def sum_loss_and_mean_loss_on_two_outputs_with_regularisers(wrap):
    x, y = regression_data()
    keras.utils.set_random_seed(5)
    inp = keras.Input((6,))
    h = keras.layers.Dense(
        8, activation="tanh", kernel_regularizer="l2", activity_regularizer="l1"
    )(inp)
    model = wrap(
        keras.Model(
            inp, {"a": keras.layers.Dense(1, name="a")(h), "b": keras.layers.Dense(1, name="b")(h)}
        )
    )
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
    model = wrap(
        keras.Model(
            inp, {"first": keras.layers.Dense(2)(inp), "second": keras.layers.Dense(3)(inp)}
        )
    )
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
        model,
        evaluate=evaluated,
        test_on_batch=on_batch,
        predict_on_batch=model.predict_on_batch(x[:BATCH]),
    )


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
    before = model.layers[0].kernel.numpy()
    out = fit_and_evaluate(classifier(wrap(model)), x, y)
    moved = np.sum(model.layers[0].kernel.numpy() != before)  # bit for bit: serial's 0
    return out | outcome(model, frozen_elements_moved=moved)


@feature()
def explicit_progbar_logger_with_validation(wrap):
    """Keras's progress bar passed explicitly: one line per epoch, on the master rank only."""
    x, y = dense_data()
    model = classifier(wrap(mlp()))
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        history = model.fit(
            x,
            y,
            batch_size=BATCH,
            epochs=EPOCHS,
            verbose=2,
            shuffle=False,
            validation_data=(x[:20], y[:20]),
            callbacks=[keras.callbacks.ProgbarLogger()],
        )
    lines = printed.getvalue().count("Epoch ")
    return outcome(model, history) | {"rank.epoch_lines": np.float64(lines)}


@feature()
def tarantella_model_attribute_and_clone_model(wrap):
    x, y = dense_data()
    keras_model = mlp()
    model = classifier(wrap(keras_model))
    model.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    clone = (tnt.models.clone_model if wrap is tnt.Model else keras.models.clone_model)(model)
    clone.set_weights(model.get_weights())
    same = model.model is keras_model if wrap is tnt.Model else True
    return outcome(model, clone=clone.predict(x, verbose=0), same_object=float(same))


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
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=EPOCHS,
        verbose=0,
        shuffle=False,
        class_weight={0: 0.5, 1: 2.0, 2: 1.0},
        validation_split=0.2,
    )
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
    model = wrap(
        keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(8, activation="tanh"),
                ActivityPenalty(),
                keras.layers.Dense(3),
            ]
        )
    )
    classifier(model, steps_per_execution=3)
    return fit_and_evaluate(model, x, y)


class MaskRecorder(keras.layers.Layer):
    """Records what reaches it in training (the dropout mask of a batch of ones)."""

    seen: list = []

    def call(self, x, training=None):
        if training:
            record = tf.py_function(
                lambda t: MaskRecorder.seen.append(t.numpy()) or 0, [x], tf.int32
            )
            with tf.control_dependencies([record]):
                return tf.identity(x)
        return x


@feature(ranks_differ=True)
def dropout_draws_differ_between_ranks(wrap):
    """Every sample of a serial batch gets its own dropout mask; so does every rank's."""
    x = np.ones((BATCH * 2, 6), dtype="float32")
    y = np.zeros(BATCH * 2, dtype="int64")
    keras.utils.set_random_seed(12)
    model = wrap(
        keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dropout(0.5, seed=3),
                MaskRecorder(),
                keras.layers.Dense(3),
            ]
        )
    )
    MaskRecorder.seen = []
    classifier(model).fit(x, y, batch_size=BATCH, epochs=1, verbose=0, shuffle=False)
    first = np.ascontiguousarray(MaskRecorder.seen[0] != 0)
    return outcome(model) | {"rank.mask": np.float64(zlib.crc32(first.tobytes()))}


class RecordedBatches(keras.utils.PyDataset):
    """Global batches by index, recording the order in which they are read."""

    def __init__(self, x, y):
        super().__init__()
        self.x, self.y, self.read = x, y, []

    def __len__(self):
        return -(-len(self.x) // BATCH)

    def __getitem__(self, i):
        self.read.append(i)
        return self.x[i * BATCH : (i + 1) * BATCH], self.y[i * BATCH : (i + 1) * BATCH]


@feature(ranks_differ=True)
def pydataset_shuffled_each_epoch(wrap):
    """fit(PyDataset) shuffles the batch order every epoch, as serial Keras does (its order is
    drawn from Python's random module, so only the ranks are compared with each other)."""
    x, y = dense_data(n=96)
    batches = RecordedBatches(x, y)
    model = classifier(wrap(mlp()))
    model.fit(batches, epochs=EPOCHS, verbose=0)
    last = batches.read[-EPOCHS * len(batches) :]  # (before them: reads of the first batch)
    epochs = [last[k * len(batches) : (k + 1) * len(batches)] for k in range(EPOCHS)]
    every = all(sorted(e) == list(range(len(batches))) for e in epochs)
    shuffled = every and epochs[0] != epochs[1]
    return outcome(model, order=epochs) | {"rank.shuffled": np.float64(shuffled)}


def _embedding_model():
    keras.utils.set_random_seed(13)
    return keras.Sequential(
        [
            keras.Input((7,), dtype="int64"),
            keras.layers.Embedding(20, 4),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(3),
        ]
    )


@feature()
def embedding_sparse_gradient_with_sgd(wrap):
    x, y = sequence_data()
    model = classifier(wrap(_embedding_model()), keras.optimizers.SGD(0.5))
    return fit_and_evaluate(model, x, y[:, 0])


@feature()
def embedding_sparse_gradient_with_adam(wrap):
    x, y = sequence_data()
    model = classifier(wrap(_embedding_model()), keras.optimizers.Adam(0.01))
    return fit_and_evaluate(model, x, y[:, 0])


@feature()
def embedding_sparse_gradient_with_adagrad_in_own_step(wrap):
    x, y = sequence_data()
    keras.utils.set_random_seed(13)
    inp = keras.Input((7,), dtype="int64")
    h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(20, 4)(inp))
    model = classifier(wrap(Siamese(inp, keras.layers.Dense(3)(h))), keras.optimizers.Adagrad(0.1))
    return fit_and_evaluate(model, x, y[:, 0])


@feature()
def synchronized_batch_norm(wrap):
    """Keras's switch for global batch statistics: the moments of the global batch. In float64:
    its variance, E[x^2] - E[x]^2 as Keras computes it, cancels digits, so float32's rounding of
    the ranks' partial sums would show at 1e-5."""
    x, y = dense_data()
    keras.mixed_precision.set_global_policy("float64")
    try:
        keras.utils.set_random_seed(14)
        layers = [
            keras.Input((6,)),
            keras.layers.Dense(8),
            keras.layers.BatchNormalization(synchronized=True),
            keras.layers.Dense(3),
        ]
        model = classifier(wrap(keras.Sequential(layers)))
        return fit_and_evaluate(model, x.astype("float64"), y)
    finally:
        keras.mixed_precision.set_global_policy("float32")


# -- models with a train_step of their own, and custom loops ------------------------------------
def _mean_tracker(name):
    return keras.metrics.Mean(name=name)


class VAE(keras.Model):
    """Keras's VAE example, small; the sampling noise comes with the data (so that serial Keras
    draws the same), the losses are means over the batch."""

    def __init__(self, features=6, latent=2):
        super().__init__()
        keras.utils.set_random_seed(21)
        inp = keras.Input((features,))
        h = keras.layers.Dense(8, activation="relu")(inp)
        self.encoder = keras.Model(
            inp, [keras.layers.Dense(latent)(h), keras.layers.Dense(latent)(h)]
        )
        self.decoder = keras.Sequential(
            [
                keras.Input((latent,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(features),
            ]
        )
        self.trackers = [_mean_tracker(n) for n in ("loss", "reconstruction_loss", "kl_loss")]

    @property
    def metrics(self):
        return self.trackers

    def _vae_losses(self, data):
        z_mean, z_log_var = self.encoder(data["features"])
        z = z_mean + keras.ops.exp(0.5 * z_log_var) * data["noise"]
        reconstruction = self.decoder(z)
        rec = keras.ops.mean(keras.ops.sum(keras.ops.square(data["features"] - reconstruction), 1))
        kl = -0.5 * (1 + z_log_var - keras.ops.square(z_mean) - keras.ops.exp(z_log_var))
        kl = keras.ops.mean(keras.ops.sum(kl, axis=1))
        return rec + kl, rec, kl

    def train_step(self, data):
        with tf.GradientTape() as tape:
            losses = self._vae_losses(data)
        grads = tape.gradient(losses[0], self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights, strict=True))
        for tracker, value in zip(self.trackers, losses, strict=True):
            tracker.update_state(value)
        return {m.name: m.result() for m in self.metrics}

    def test_step(self, data):
        for tracker, value in zip(self.trackers, self._vae_losses(data), strict=True):
            tracker.update_state(value)
        return {m.name: m.result() for m in self.metrics}


@feature()
def vae_own_train_step(wrap):
    x, _ = regression_data()  # (a last batch of 2: uneven micro-batches on 3 ranks)
    noise = np.random.default_rng(4).normal(size=(N, 2)).astype("float32")
    model = wrap(VAE())
    model.compile(keras.optimizers.Adam(0.01))
    data = {"features": x, "noise": noise}
    history = model.fit(data, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False)
    evaluated = model.evaluate(data, batch_size=BATCH, verbose=0, return_dict=True)
    dataset = tf.data.Dataset.from_tensor_slices(data).batch(BATCH)  # (sliced in the step)
    more = model.fit(dataset, epochs=1, verbose=0)
    return outcome(model, history, evaluate=evaluated, tf_data=more.history["loss"])


class GAN(keras.Model):
    """Keras's GAN example, small: two optimizers, the latent noise with the data."""

    def __init__(self, features=6, latent=3):
        super().__init__()
        keras.utils.set_random_seed(22)
        self.discriminator = keras.Sequential(
            [
                keras.Input((features,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
        self.generator = keras.Sequential(
            [
                keras.Input((latent,)),
                keras.layers.Dense(8, activation="relu"),
                keras.layers.Dense(features),
            ]
        )
        self.d_tracker, self.g_tracker = _mean_tracker("d_loss"), _mean_tracker("g_loss")

    def compile(self, d_optimizer, g_optimizer, loss_fn):
        super().compile()
        self.d_optimizer, self.g_optimizer, self.loss_fn = d_optimizer, g_optimizer, loss_fn

    @property
    def metrics(self):
        return [self.d_tracker, self.g_tracker]

    def train_step(self, data):
        real, noise = data["real"], data["noise"]
        fake = self.generator(noise)
        both = keras.ops.concatenate([fake, real], axis=0)
        n = keras.ops.shape(real)[0]
        labels = keras.ops.concatenate([keras.ops.ones((n, 1)), keras.ops.zeros((n, 1))], axis=0)
        with tf.GradientTape() as tape:
            d_loss = self.loss_fn(labels, self.discriminator(both))
        grads = tape.gradient(d_loss, self.discriminator.trainable_weights)
        self.d_optimizer.apply_gradients(
            zip(grads, self.discriminator.trainable_weights, strict=True)
        )
        with tf.GradientTape() as tape:
            g_loss = self.loss_fn(
                keras.ops.zeros((n, 1)), self.discriminator(self.generator(noise))
            )
        grads = tape.gradient(g_loss, self.generator.trainable_weights)
        self.g_optimizer.apply_gradients(zip(grads, self.generator.trainable_weights, strict=True))
        self.d_tracker.update_state(d_loss)
        self.g_tracker.update_state(g_loss)
        return {
            "d_loss": self.d_tracker.result(),
            "g_loss": self.g_tracker.result(),
            "d_loss_of_the_batch": d_loss,
        }


@feature()
def gan_two_optimizers_own_train_step(wrap):
    x, _ = regression_data()
    noise = np.random.default_rng(5).normal(size=(N, 3)).astype("float32")
    model = wrap(GAN())
    model.compile(
        keras.optimizers.Adam(0.01),
        keras.optimizers.SGD(0.05),
        keras.losses.BinaryCrossentropy(from_logits=True),
    )
    history = model.fit(
        {"real": x, "noise": noise}, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False
    )
    return outcome(model, history)


def contrastive_loss(y, distance, margin=1.0):
    y = keras.ops.cast(y, distance.dtype)
    return keras.ops.mean(
        y * keras.ops.square(distance)
        + (1 - y) * keras.ops.square(keras.ops.relu(margin - distance)),
        axis=-1,
    )


class Siamese(keras.Model):
    """A siamese network on pairs with a contrastive loss, its step written as Keras's
    "customizing fit" guide writes it (compute_loss, compute_metrics)."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            distance = self(x, training=True)
            loss = self.compute_loss(y=y, y_pred=distance)
        grads = tape.gradient(loss, self.trainable_weights)
        self.optimizer.apply_gradients(zip(grads, self.trainable_weights, strict=True))
        for metric in self.metrics:
            if metric.name == "loss":
                metric.update_state(loss)
            else:
                metric.update_state(y, distance)
        return {m.name: m.result() for m in self.metrics}


@feature()
def siamese_contrastive_own_train_step(wrap):
    x, labels = dense_data(n=48)
    rng = np.random.default_rng(6)
    partner = rng.permutation(48)
    same = (labels == labels[partner]).astype("float32")[:, None]
    keras.utils.set_random_seed(23)
    embed = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(4)]
    )
    a, b = keras.Input((6,)), keras.Input((6,))
    diff = keras.layers.Subtract()([embed(a), embed(b)])
    distance = keras.layers.Lambda(
        lambda d: keras.ops.sqrt(keras.ops.sum(keras.ops.square(d), axis=1, keepdims=True) + 1e-6)
    )(diff)
    model = wrap(Siamese([a, b], distance))
    model.compile(keras.optimizers.RMSprop(0.01), loss=contrastive_loss)
    history = model.fit(
        [x, x[partner]], same, batch_size=BATCH, epochs=EPOCHS, verbose=0, shuffle=False
    )
    return outcome(model, history)


@feature()
def train_on_batch_loop(wrap):
    x, y = dense_data()
    model = classifier(wrap(mlp()), keras.optimizers.Adam(0.01))
    logs = [
        model.train_on_batch(x[i : i + BATCH], y[i : i + BATCH], return_dict=True)["loss"]
        for i in range(0, N, BATCH)
    ]
    return outcome(model, logs=logs)


@feature()
def custom_loop_with_distributed_optimizer(wrap):
    """A loop with its own tf.GradientTape: each rank takes its equal part of each global batch."""
    x, y = dense_data(n=48)
    model = mlp()
    optimizer = keras.optimizers.Adam(0.01)
    rank, size = (tnt.get_rank(), tnt.get_size()) if wrap is tnt.Model else (0, 1)
    if wrap is tnt.Model:
        optimizer = tnt.distributed_optimizer(optimizer)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(xb, yb):
        with tf.GradientTape() as tape:
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_weights)
        optimizer.apply_gradients(zip(grads, model.trainable_weights, strict=True))

    for _ in range(EPOCHS):
        for i in range(0, 48, BATCH):
            part = BATCH // size
            lo = i + rank * part
            step(x[lo : lo + part], y[lo : lo + part])
    return outcome(model)


# -- the run on this rank -----------------------------------------------------------------------
def compare(serial: dict, distributed: dict, tol) -> dict:
    """The worst of |a - b| / (atol + rtol |b|) over every array (<= 1: equal within tol)."""
    rtol, atol = tol
    serial, distributed = _compared(serial), _compared(distributed)
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


def _compared(out: dict) -> dict:
    """What is compared with serial Keras and between ranks: all but "rank." keys (what this
    rank alone did, checked by the test)."""
    return {k: v for k, v in out.items() if not k.startswith("rank.")}


def checksum(out: dict) -> int:
    out = _compared(out)
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
            result["per_rank"] = {
                k: float(v) for k, v in distributed.items() if k.startswith("rank.")
            }
        except Exception as exc:  # (the same on every rank: the world stays in step)
            result = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        results[name] = result
    with open(f"{outdir}/rank{tnt.get_rank()}.json", "w") as f:
        json.dump({"size": tnt.get_size(), "results": results}, f)

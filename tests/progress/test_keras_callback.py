"""The Keras callback returned by progress_callback, driven by real Keras fit/evaluate/predict."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tnt_notebook.progress_payload import PROGRESS_MIME
from tnt_notebook.rank.progress_publisher import progress_callback

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
keras = pytest.importorskip("keras")


@pytest.fixture(scope="module")
def model_and_data():
    import tensorflow as tf

    try:  # one core's worth of threads, unless TensorFlow's runtime already started in this process
        tf.config.threading.set_intra_op_parallelism_threads(1)
        tf.config.threading.set_inter_op_parallelism_threads(1)
    except RuntimeError:
        pass
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 8)).astype("float32")
    y = (x.sum(axis=1) > 0).astype("int32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(2, activation="softmax")])
    model.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return model, x, y


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.setenv("TNT_NOTEBOOK_RANK", "1")


def states(sent):
    return [b[PROGRESS_MIME] for b, _, _ in sent]


def test_fit_publishes_epochs_steps_validation_and_history(model_and_data, engine):
    model, x, y = model_and_data
    sent = []
    cb = progress_callback(
        "fit",
        1,
        batch_size=32,
        num_samples=80,
        world_size=1,
        min_interval=0.0,
        max_overhead=0,
        publish=lambda b, i, u: sent.append((b, i, u)),
    )
    history = model.fit(
        x[:80],
        y[:80],
        batch_size=32,
        epochs=3,
        verbose=0,
        validation_data=(x[80:], y[80:]),
        callbacks=[cb],
    )
    s = states(sent)
    final = s[-1]
    assert final["status"] == "done" and final["mode"] == "fit"
    assert (final["epochs"], final["epochs_done"]) == (3, 3)
    assert (final["step"], final["steps"]) == (3, 3)  # Keras tells the steps per epoch
    assert final["samples"] == 3 * 80
    assert final["history"]["loss"] == pytest.approx(history.history["loss"])
    assert final["history"]["val_loss"] == pytest.approx(history.history["val_loss"])
    assert final["epoch_logs"]["val_accuracy"] == pytest.approx(history.history["val_accuracy"][-1])
    assert any(st["phase"] == "validate" for st in s)
    assert [st["step"] for st in s if st["epoch"] == 1 and st["phase"] == "train"][:4] == [
        0,
        1,
        2,
        3,
    ]


def test_evaluate_and_predict_publish_their_own_display(model_and_data, engine):
    model, x, y = model_and_data
    sent = []
    pub = lambda b, i, u: sent.append((b, i, u))  # noqa: E731
    cb = progress_callback(
        "evaluate", 1, batch_size=25, min_interval=0.0, max_overhead=0, publish=pub
    )
    result = model.evaluate(x, y, batch_size=25, verbose=0, callbacks=[cb], return_dict=True)
    final = states(sent)[-1]
    assert final["status"] == "done" and final["mode"] == "evaluate"
    assert final["logs"] == pytest.approx(result)
    assert (final["step"], final["steps"]) == (4, 4)
    sent.clear()
    cb = progress_callback(
        "predict", 1, batch_size=50, min_interval=0.0, max_overhead=0, publish=pub
    )
    model.predict(x, batch_size=50, verbose=0, callbacks=[cb])
    final = states(sent)[-1]
    assert final["status"] == "done" and final["samples"] == 100 and final["logs"] == {}
    assert len({i for _, i, _ in sent}) == 1

"""Runs on every rank: each Keras callback with tnt.Model against the same callback in serial Keras.

Writes rank<r>.json into the output directory; test_callbacks.py asserts on it.
"""

from __future__ import annotations

import json
import os
import sys

import keras
import numpy as np

import tnt_notebook as tnt

RANK = tnt.get_rank()
X = np.random.default_rng(0).normal(size=(96, 6)).astype("float32")
Y = (X[:, 0] + X[:, 1] > 0).astype("int64")
BATCH = 16


def make(lr=0.1, wrap=False):
    keras.utils.set_random_seed(3)
    m = keras.Sequential(
        [keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)]
    )
    if wrap:
        m = tnt.Model(m)
    m.compile(
        keras.optimizers.SGD(lr),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return m


def both(make_callbacks, epochs=4, lr=0.1, **kwargs):
    """Train serially and with tnt.Model, each with fresh callbacks."""
    ref_cbs, tnt_cbs = make_callbacks("ref"), make_callbacks("tnt")
    ref, model = make(lr), make(lr, wrap=True)
    h_ref = ref.fit(
        X, Y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=ref_cbs, **kwargs
    )
    h_tnt = model.fit(
        X, Y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, callbacks=tnt_cbs, **kwargs
    )
    return h_ref.history, h_tnt.history, ref_cbs, tnt_cbs, ref, model


def close(a, b, tol=1e-4):
    if isinstance(a, dict):
        return set(a) == set(b) and all(close(a[k], b[k], tol) for k in a)
    if isinstance(a, list) and a and isinstance(a[0], dict):
        return len(a) == len(b) and all(close(p, q, tol) for p, q in zip(a, b, strict=True))
    if isinstance(a, list) and a and isinstance(a[0], np.ndarray):
        return len(a) == len(b) and all(close(p, q, tol) for p, q in zip(a, b, strict=True))
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return False
    both_nan = np.isnan(a) & np.isnan(b)
    return bool(np.all(both_nan | (np.abs(a - b) <= tol * np.abs(b) + 1e-6)))


def event_scalars(log_dir: str) -> dict:
    """{"pids": writer pids (from the event file names), tag: [scalar values]} of a log dir."""
    import tensorflow as tf

    found: dict = {"pids": []}
    for name in sorted(os.listdir(log_dir)):
        if not name.startswith("events.out.tfevents."):
            continue
        # events.out.tfevents.<time>.<host>.<pid>.<n>.v2
        found["pids"].append(int(name.split(".")[-3]))
        for event in tf.compat.v1.train.summary_iterator(os.path.join(log_dir, name)):
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "scalars":
                    found.setdefault(value.tag, []).append(float(tf.make_ndarray(value.tensor)))
    return found


class Recorder(keras.callbacks.Callback):
    """A user callback: records batch and epoch logs and which model object it saw."""

    def __init__(self):
        super().__init__()
        self.batches, self.epochs, self.model_types = [], [], set()

    def on_train_batch_end(self, batch, logs=None):
        self.batches.append(dict(logs))
        self.model_types.add(
            "tnt.Model" if isinstance(self.model, tnt.Model) else type(self.model).__name__
        )

    def on_epoch_end(self, epoch, logs=None):
        self.epochs.append(dict(logs))


def main(out: str) -> None:
    res: dict = {}

    h_ref, h_tnt, *_ = both(
        lambda _: [keras.callbacks.EarlyStopping(monitor="loss", min_delta=0.02, patience=1)],
        epochs=30,
    )
    res["early_stopping"] = {
        "epochs_ref": len(h_ref["loss"]),
        "epochs_tnt": len(h_tnt["loss"]),
        "same": close(h_ref, h_tnt),
    }

    h_ref, h_tnt, *_ = both(
        lambda _: [keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.5)]
    )
    res["lr_scheduler"] = {"same": close(h_ref, h_tnt), "lr": h_tnt.get("learning_rate")}

    h_ref, h_tnt, _, _, ref, model = both(
        lambda _: [
            keras.callbacks.ReduceLROnPlateau(
                monitor="loss", factor=0.5, patience=0, min_delta=0.05
            )
        ],
        epochs=5,
    )
    res["reduce_lr"] = {
        "same": close(h_ref, h_tnt),
        "lr_ref": float(ref.optimizer.learning_rate.numpy()),
        "lr_tnt": float(model.optimizer.learning_rate.numpy()),
    }

    h_ref, h_tnt, *_ = both(lambda _: [keras.callbacks.TerminateOnNaN()], epochs=5, lr=1e12)
    res["terminate_on_nan"] = {
        "epochs_ref": len(h_ref["loss"]),
        "epochs_tnt": len(h_tnt["loss"]),
        "nan": bool(np.isnan(h_tnt["loss"][-1])),
        "same": close(h_ref, h_tnt),
    }

    h_ref, h_tnt, _, _, _, model = both(
        lambda who: [keras.callbacks.CSVLogger(f"{out}/{who}_rank{RANK}.csv")]
    )
    res["csv_logger"] = {"same": close(h_ref, h_tnt)}

    seen: dict = {"ref": [], "tnt": []}
    h_ref, h_tnt, *_ = both(
        lambda who: [
            keras.callbacks.LambdaCallback(
                on_epoch_end=lambda e, logs: seen[who].append(dict(logs))
            )
        ]
    )
    res["lambda"] = {"calls": len(seen["tnt"]), "same": close(seen["ref"], seen["tnt"])}

    h_ref, h_tnt, ref_cbs, tnt_cbs, *_ = both(lambda _: [Recorder()])
    res["user_callback"] = {
        "batches": len(tnt_cbs[0].batches),
        "same_batches": close(ref_cbs[0].batches, tnt_cbs[0].batches),
        "same_epochs": close(ref_cbs[0].epochs, tnt_cbs[0].epochs),
        "model_types": sorted(tnt_cbs[0].model_types),
    }

    master_only = Recorder()
    _, _, _, _, _, _ = both(
        lambda who: (
            [tnt.keras.callbacks.Callback(master_only, run_on_all_ranks=False)]
            if who == "tnt"
            else []
        )
    )
    res["run_on_all_ranks_false"] = {
        "batches": len(master_only.batches),
        "model_types": sorted(master_only.model_types),
    }

    h_ref, h_tnt, _, _, ref, model = both(
        lambda who: [
            keras.callbacks.ModelCheckpoint(
                f"{out}/{who}_ckpt_rank{RANK}.weights.h5", save_weights_only=True
            )
        ]
    )
    written = os.path.exists(f"{out}/tnt_ckpt_rank{RANK}.weights.h5")
    ok = None
    if written:
        check = make()
        check.load_weights(f"{out}/tnt_ckpt_rank{RANK}.weights.h5")
        ok = close(check.get_weights(), model.get_weights())
    res["model_checkpoint"] = {"written": written, "weights_equal_final": ok}

    # the guide's ModelCheckpoint example (Keras 3: a .keras path, no `options`)
    guide_ckpt = f"{out}/guide_ckpt_rank{RANK}.keras"
    _, h_guide, _, _, _, model = both(
        lambda who: [
            keras.callbacks.ModelCheckpoint(
                filepath=guide_ckpt if who == "tnt" else f"{out}/ref_ckpt_rank{RANK}.keras",
                monitor="val_accuracy",  # Keras 3 names it so (and needs a mode for val_acc)
                verbose=1,
                save_best_only=False,
                save_weights_only=False,
                mode="auto",
                save_freq="epoch",
            )
        ],
        epochs=2,
        validation_data=(X, Y),
    )
    res["guide_checkpoint"] = {
        "written": os.path.exists(guide_ckpt),
        "loads_final_weights": close(
            tnt.models.load_model(f"{out}/guide_ckpt_rank0.keras").get_weights(),
            model.get_weights(),
        ),
    }

    # RemoteMonitor posts every epoch's (global) logs once, from the master rank
    both(
        lambda who: [
            keras.callbacks.RemoteMonitor(
                root=os.environ["TNT_TEST_MONITOR"], path=f"/{who}/rank{RANK}", send_as_json=True
            )
        ],
        epochs=2,
    )

    history = keras.callbacks.History()
    h_ref, h_tnt, *_ = both(lambda who: [history] if who == "tnt" else [])
    res["history"] = {
        "same": close(h_ref, h_tnt),
        "user_history_same": close(history.history, h_ref),
    }

    # TensorBoard: the master logs the serial values; with TNT_TENSORBOARD_ON_ALL_DEVICES every rank
    # logs to its own directory
    def fit_with_tensorboard(log_dir, wrap=True):
        return make(wrap=wrap).fit(
            X,
            Y,
            batch_size=BATCH,
            epochs=2,
            shuffle=False,
            verbose=0,
            validation_data=(X, Y),
            callbacks=[keras.callbacks.TensorBoard(log_dir)],
        )

    serial = fit_with_tensorboard(f"{out}/tb_serial_rank{RANK}", wrap=False).history
    fit_with_tensorboard(f"{out}/tb")
    os.environ["TNT_TENSORBOARD_ON_ALL_DEVICES"] = "1"
    fit_with_tensorboard(f"{out}/tball")
    del os.environ["TNT_TENSORBOARD_ON_ALL_DEVICES"]
    tnt.barrier()
    res["tensorboard"] = {
        "pid": os.getpid(),
        "serial": {"epoch_loss": serial["loss"], "epoch_accuracy": serial["accuracy"]},
        "serial_validation": {"epoch_loss": serial["val_loss"]},
        "logs": {
            os.path.relpath(d, out): event_scalars(d)
            for top in ("tb", "tball")
            for d, _, files in os.walk(f"{out}/{top}")
            if any(f.startswith("events.out.tfevents.") for f in files)
        },
    }

    # the master rank asks the progress publisher for its view and uses it instead of Keras's bar
    from tnt_notebook.rank import progress_publisher as progress

    calls, real = [], progress.progress_callback

    def fake_progress(mode, verbose, **params):
        view = Recorder()
        calls.append({"mode": mode, "verbose": verbose, **params, "view": view})
        return view

    progress.progress_callback = fake_progress
    try:
        model = make(wrap=True)
        model.fit(X, Y, batch_size=BATCH, epochs=2, verbose=1)
        model.evaluate(X, Y, batch_size=BATCH)
        model.predict(X, batch_size=BATCH, verbose=0)
    finally:
        progress.progress_callback = real
    res["progress_hook"] = [
        {k: v for k, v in c.items() if k != "view"} | {"batches": len(c["view"].batches)}
        for c in calls
    ]

    # verbose output: this rank's stdout (file descriptor 1) goes to its own file meanwhile
    model = make(wrap=True)
    sys.stdout.flush()
    saved = os.dup(1)
    fd = os.open(f"{out}/stdout_rank{RANK}.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(fd, 1)
    try:
        model.fit(X, Y, batch_size=BATCH, epochs=2, verbose=2)
        model.fit(X, Y, batch_size=BATCH, epochs=1, verbose=1, validation_data=(X, Y))
        model.evaluate(X, Y, batch_size=BATCH, verbose=1)
        model.predict(X, batch_size=BATCH, verbose=1)
        sys.stdout.flush()
    finally:
        os.dup2(saved, 1)
        os.close(fd)
        os.close(saved)

    with open(f"{out}/rank{RANK}.json", "w") as f:
        json.dump(res, f)


if __name__ == "__main__":
    from tests.keras.worker_util import run_or_abort

    run_or_abort(main, sys.argv[1])

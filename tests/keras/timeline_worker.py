"""Run by ``tnt-run --timeline DIR`` on 2 ranks (test_timeline.py): a fit whose rank 1 sleeps in
its input pipeline, timed by a callback of its own; the master writes what it saw to
``DIR/worker.json`` (the summary, the sample and the step times its callback measured)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import keras
import numpy as np
import tensorflow as tf

import tnt_notebook as tnt
from tnt_notebook.bench.fit_worker import build_model
from tnt_notebook.rank import timeline

SLEEP_S = 0.03  # per batch, on rank 1 only


class StepTimes(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times: list[float] = []

    def on_train_batch_begin(self, batch, logs=None):
        self.begin = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self.begin)


def slowed(x, y):
    def sleep(x):
        time.sleep(SLEEP_S)
        return x

    x = tf.py_function(sleep, [x], tf.float32)
    return tf.ensure_shape(x, [None, 28, 28, 1]), y


def main(out: str) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64 * 16, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, size=len(x))
    ds = tf.data.Dataset.from_tensor_slices((x, y)).batch(64)
    if tnt.get_rank() == 1:
        ds = ds.map(slowed)
    model = tnt.Model(build_model(keras, argparse.Namespace(model="lenet")))
    model.compile(
        keras.optimizers.SGD(0.01),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    times = StepTimes()
    model.fit(ds, epochs=1, verbose=0, callbacks=[times])
    if tnt.is_master_rank():
        summary, sample = tnt.timeline_summary(), timeline.timeline_sample()
        with open(os.path.join(out, "worker.json"), "w") as f:
            json.dump({"summary": summary, "sample": sample, "step_times": times.times}, f)


if __name__ == "__main__":
    main(sys.argv[1])

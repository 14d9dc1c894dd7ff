"""No training lost in a notebook: a rank SIGKILLed mid-fit ends the cell naming it, and after
`%tnt_cluster restart` the same fit, run again, resumes from the last backup and ends where an
uninterrupted run ends."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.notebook, pytest.mark.mpi]

SETUP = """%%tnt
import os, signal
import numpy as np, keras
X = np.random.default_rng(0).normal(size=(96, 6)).astype("float32")
Y = (X[:, 0] - X[:, 2] > 0).astype("int64")

def make():
    keras.utils.set_random_seed(1)
    m = tnt.Model(keras.Sequential([
        keras.Input((6,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(2)]))
    m.compile(keras.optimizers.SGD(0.05, momentum=0.9),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return m

class KillRankOne(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2 and tnt.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)

def train(*extra):
    backup = keras.callbacks.BackupAndRestore({backup!r})
    return m.fit(X, Y, batch_size=16, epochs=4, verbose=0, callbacks=[backup, *extra])
"""


@pytest.fixture(scope="module")
def kernel(kernel_factory):
    k = kernel_factory()
    k.ok("%tnt_cluster -n 2", timeout=120)
    return k


def test_a_fit_killed_with_a_rank_resumes_after_restart(kernel, tmp_path):
    setup = SETUP.format(backup=str(tmp_path / "backup"))
    kernel.ok(setup, timeout=120)
    r = kernel.execute("%%tnt\nm = make()\ntrain(KillRankOne())", timeout=180)
    assert r.status == "error" and "rank 1" in r.traceback, r.traceback
    kernel.ok("%tnt_cluster restart", timeout=120)
    kernel.ok(setup, timeout=120)  # the ranks are new processes: define everything again
    kernel.ok("%%tnt\nm = make()\nresumed = train().history", timeout=180)
    out = kernel.ok(
        "%%tnt\nref = make()\n"
        "uninterrupted = ref.fit(X, Y, batch_size=16, epochs=4, verbose=0).history\n"
        "same = all(np.allclose(a, b, rtol=0, atol=1e-6)\n"
        "           for a, b in zip(ref.get_weights(), m.get_weights()))\n"
        'print("epochs", len(resumed["loss"]), "same weights", same, "same history",\n'
        '      np.allclose(resumed["loss"], uninterrupted["loss"], rtol=1e-6))',
        timeout=180,
    )
    assert out.stdout.strip() == "epochs 4 same weights True same history True"

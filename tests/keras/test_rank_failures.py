"""A rank that dies in the middle of fit makes the others raise the rank API's RankLostError naming
it, never hang: through the TensorFlow op and through the tf.numpy_function fallback."""

from __future__ import annotations

import re

import pytest

from tests.support.keras_worlds import ENV
from tests.support.mpiworld import HIDE_DEATH_FROM_HYDRA, run_mpi

# (its tests kill ranks on purpose: what they leave in /dev/shm is removed after each)
pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("killed_worlds_swept")]

# A fit in which rank {rank} does {action} after the 20th step, then {after}.
FIT_WITH_A_FAILING_RANK = """
import os, signal, time
import keras
import numpy as np
import tnt_notebook as tnt
from tnt_notebook.keras import allreduce_op

r = tnt.get_rank()
rng = np.random.default_rng(0)
x = rng.normal(size=(512, 8)).astype("float32")
y = (x[:, 0] > 0).astype("int64")
model = tnt.Model(keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)]))
model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))


class FailInTheSecondEpoch(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if r == {rank} and self.model.optimizer.iterations.numpy() == 20:
            {action}


print("PATH", r, "op" if allreduce_op.op_library() else "numpy_function", flush=True)
t0 = time.monotonic()
try:
    model.fit(x, y, batch_size=32, epochs=3, verbose=0, callbacks=[FailInTheSecondEpoch()])
    print("NO ERROR", r, flush=True)
except Exception as e:
    print("RAISED", r, round(time.monotonic() - t0, 2), type(e).__name__, repr(str(e)), flush=True)
{after}
"""
DIES_IN_FIT = FIT_WITH_A_FAILING_RANK.format(
    rank=1,
    action="os.kill(os.getpid(), signal.SIGKILL)",
    after="os._exit(0)  # MPI itself cannot finalize a world with a dead rank",
)
FAILS_ON_THE_MASTER = FIT_WITH_A_FAILING_RANK.format(
    rank=0,
    action='raise RuntimeError("disk full on the master")',
    after="""
# the world goes on: the next collectives rebuild the engine, and a new fit trains alike
total = tnt.allreduce(np.array([r + 1.0]))
model.fit(x, y, batch_size=32, epochs=1, verbose=0)
print("AFTER", r, total[0], repr(float(np.sum(model.get_weights()[0]))), flush=True)
""",
)


@pytest.mark.parametrize("reduction", ["op", "numpy_function"])
def test_a_rank_killed_during_fit_is_named_by_the_survivor(reduction: str) -> None:
    env = {**ENV, "TNT_COLLECTIVE_TIMEOUT": "20"}
    if reduction == "numpy_function":
        env["TNT_TF_OP"] = "0"
    result = run_mpi(
        2, DIES_IN_FIT, env=env, mpi_args=HIDE_DEATH_FROM_HYDRA, check=False, timeout=120
    )
    out = result.stdout + result.stderr
    assert f"PATH 0 {reduction}" in result.stdout, out
    raised = [line for line in result.stdout.splitlines() if line.startswith("RAISED 0")]
    assert len(raised) == 1, out
    _, _, seconds, kind, message = raised[0].split(" ", 4)
    assert kind == "RankLostError", raised[0]
    assert re.fullmatch(r"'rank 1 \(pid \d+\) died during allreduce'", message), message
    assert float(seconds) < 15, raised[0]  # found out by itself, well before the 20 s timeout


@pytest.mark.parametrize("reduction", ["op", "numpy_function"])
def test_a_rank_whose_fit_raises_aborts_the_others_collectives(reduction: str) -> None:
    """A callback that raises on the master only: the other rank, waiting in the step's allreduce
    (where in the TensorFlow op no signal reaches it), raises at once naming rank 0 and the error,
    instead of waiting out the collective timeout; the world stays usable."""
    env = {**ENV, "TNT_COLLECTIVE_TIMEOUT": "20"}
    if reduction == "numpy_function":
        env["TNT_TF_OP"] = "0"
    result = run_mpi(2, FAILS_ON_THE_MASTER, env=env, timeout=120)
    out = result.stdout + result.stderr
    assert f"PATH 1 {reduction}" in result.stdout, out
    raised = sorted(line for line in result.stdout.splitlines() if line.startswith("RAISED"))
    assert len(raised) == 2, out
    master, other = (line.split(" ", 4) for line in raised)
    assert master[3:] == ["RuntimeError", "'disk full on the master'"], raised
    assert other[3] == "CollectiveAbortedError", raised
    assert other[4] == (
        "'allreduce aborted by rank 0: its fit raised RuntimeError: disk full on the master'"
    ), raised
    assert float(other[2]) < 15, raised  # at once, not after the 20 s timeout
    after = sorted(line.split() for line in result.stdout.splitlines() if line.startswith("AFTER"))
    assert [a[2] for a in after] == ["3.0", "3.0"], out
    assert after[0][3] == after[1][3], out  # identical weights on both ranks

"""Worlds of the native engine for the tests: the code every rank runs first, the environment,
and a rank killed inside a collective, which tests of several rooms share."""

from __future__ import annotations

import re

from tests.support.mpiworld import HIDE_DEATH_FROM_HYDRA, run_mpi

PRELUDE = """
import os, sys
import numpy as np
import tnt_notebook as tnt
from tnt_notebook.rank import api as ranks
from tests.support import world_checks as w
r, p = tnt.get_rank(), tnt.get_size()
"""
ENV = {"TNT_COLLECTIVE_TIMEOUT": "20"}


def run(n: int, body: str, *, env: dict[str, str] | None = None, timeout: float = 180):
    return run_mpi(n, PRELUDE + body, env={**ENV, **(env or {})}, timeout=timeout)


def lines(stdout: str, tag: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith(tag)]


def kill_mid_collective(
    n: int,
    done_dir,
    env: dict[str, str],
    timeout: float,
    named: str = r"\(pid \d+\) died during allreduce",
    before: str = "",
    mpi_args: tuple[str, ...] = (),
) -> list[str]:
    """The last rank is killed inside a collective (a large one, waiting for rank 0) after the
    code `before` ran on every rank; returns the survivors' "LOST rank error seconds message"
    lines, each of which must name the victim (`named`: what follows its name) within half the
    collective timeout. Hydra must not kill the survivors: they have to find out by themselves.
    `done_dir` must be seen by every rank."""
    result = run_mpi(
        n,
        PRELUDE
        + before
        + """
import signal, threading, time
x = np.ones(3_000_000, np.float32)
tnt.allreduce(x)
victim = p - 1
t0 = time.monotonic()
if r == victim:
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
if r == 0:
    time.sleep(1.0)   # the victim dies inside the collective, waiting for rank 0
try:
    tnt.allreduce(x)
    w.say("NO ERROR", r)
except ranks.CollectiveError as e:
    w.say("LOST", r, type(e).__name__, round(time.monotonic() - t0, 2), e)
# a survivor that leaves early makes hydra end the others: wait until every survivor reported
open(os.path.join(os.environ["DONE_DIR"], str(r)), "w").close()
while len(os.listdir(os.environ["DONE_DIR"])) < p - 1 and time.monotonic() - t0 < 20:
    time.sleep(0.05)
os._exit(0)   # MPI itself cannot finalize a world with a dead rank
""",
        env={"TNT_COLLECTIVE_TIMEOUT": str(timeout), "DONE_DIR": str(done_dir), **env},
        mpi_args=(*mpi_args, *HIDE_DEATH_FROM_HYDRA),
        check=False,
        timeout=120,
    )
    lost = lines(result.stdout, "LOST")
    assert len(lost) == n - 1, result.stdout + result.stderr
    for line in lost:
        assert re.search(rf"rank {n - 1} {named}", line), line
        assert float(line.split()[3]) < timeout / 2, line
    return lost

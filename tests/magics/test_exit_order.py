"""ExitOrder names the rank whose process ended first, even after the others were killed too."""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from tnt_notebook.cluster.processes import ExitOrder

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfds (Linux)")


def _first_within(order: ExitOrder, seconds: float) -> int | None:
    deadline = time.monotonic() + seconds
    while order.first() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return order.first()


def test_the_rank_that_exits_first_is_named_after_the_others_are_killed_too():
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(4)]
    order = ExitOrder({p.pid: rank for rank, p in enumerate(procs)})
    try:
        time.sleep(0.1)
        assert order.first() is None  # all alive
        procs[2].kill()
        procs[2].wait(10)
        time.sleep(0.1)  # as mpiexec: the others go a moment later
        for p in procs:
            p.kill()
            p.wait(10)
        assert _first_within(order, 5) == 2
    finally:
        order.close()
        order.close()  # idempotent
        for p in procs:
            p.kill()
            p.wait(10)


def test_processes_already_gone_are_ignored():
    gone = subprocess.Popen(["true"])
    gone.wait(10)  # reaped: no pidfd can be opened
    alive = subprocess.Popen(["sleep", "60"])
    order = ExitOrder({gone.pid: 0, alive.pid: 1})
    try:
        time.sleep(0.1)
        assert order.first() is None
        alive.kill()
        alive.wait(10)
        assert _first_within(order, 5) == 1
    finally:
        order.close()
        alive.kill()
        alive.wait(10)


def test_ranks_found_ended_at_once_are_named_together():
    """Two processes already ended (zombies, not reaped) when watching starts: nothing tells
    which went first, so both are the first together."""
    procs = [subprocess.Popen(["sleep", "60"]) for _ in range(4)]
    try:
        for p in procs[1:3]:
            p.kill()
        for p in procs[1:3]:  # ended, not reaped: a pidfd still opens
            os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
        order = ExitOrder({p.pid: rank for rank, p in enumerate(procs)})
        try:
            assert _first_within(order, 5) == 1
            assert order.first_together() == [1, 2]
        finally:
            order.close()
    finally:
        for p in procs:
            p.kill()
            p.wait(10)

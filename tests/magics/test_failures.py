"""Fail fast in a real kernel: a rank raising before a collective, a rank killed with SIGKILL."""

from __future__ import annotations

import re
import time

import pytest

from tests.support.kernel_driver import stopped_by_fail_fast

pytestmark = [pytest.mark.notebook, pytest.mark.mpi]

N = 3
FAIL_FAST = 4


@pytest.fixture(scope="module")
def kernel(kernel_factory):
    k = kernel_factory()
    k.ok(f"%tnt_cluster -n {N}", timeout=120)
    return k


def ensure_running(kernel) -> None:
    """After a failure the cluster is usable again or says it is dead; restart it then. Usable
    means that collectives work on every rank: an allreduce and a barrier in the next cell."""
    status = kernel.ok("%tnt_cluster status").stdout
    if "DEAD" in status:
        assert "restart it with: %tnt_cluster restart" in status
        kernel.ok("%tnt_cluster restart", timeout=120)
    r = kernel.ok(
        '%%tnt --all-ranks\nprint("size", tnt.get_size(), tnt.allreduce(1.0))\ntnt.barrier()',
        timeout=60,
    )
    assert r.stdout == f"[stdout:0-{N - 1}]\nsize {N} {float(N)}\n", r.text()


@pytest.mark.parametrize("engine_before", [False, True], ids=["first-collective", "engines-built"])
@pytest.mark.parametrize("collective", ["tnt.barrier()", "tnt.allreduce(np.ones(4))"])
def test_a_rank_raising_before_a_collective_ends_the_cell_with_its_error(
    kernel, collective, engine_before
):
    """The waiting ranks are interrupted in their collective: before any engine exists (their
    engines' bootstrap waits for the rank that raised), or with every rank's engine built (theirs
    break, the raising rank's stays healthy). Either way the next cell's collectives work."""
    if engine_before:
        kernel.ok("%%tnt\ntnt.barrier()")
    else:
        kernel.ok(
            "%%tnt\nfrom tnt_notebook.rank import api as ranks\nranks.shutdown()"
        )  # no engine anywhere
    t0 = time.monotonic()
    r = kernel.execute(
        f"%%tnt --fail-fast-timeout {FAIL_FAST}\nimport numpy as np\n"
        'if tnt.get_rank() == 1:\n    raise RuntimeError("rank one gives up")\n'
        f"{collective}\nprint('never')",
        timeout=120,
    )
    elapsed = time.monotonic() - t0
    assert r.status == "error"
    assert "[rank 1] RuntimeError: rank one gives up" in r.traceback
    assert "never" not in r.stdout
    # the native collectives wake up on SIGINT: the others are stopped, the world survives
    assert stopped_by_fail_fast(r.traceback, 3) == [0, 2], r.traceback
    assert "cluster was stopped" not in r.traceback
    assert elapsed < FAIL_FAST, elapsed
    assert "DEAD" not in kernel.ok("%tnt_cluster status").stdout
    ensure_running(kernel)


def test_a_rank_that_ignores_the_interrupt_is_named_and_the_world_is_stopped(kernel):
    ensure_running(kernel)
    t0 = time.monotonic()
    r = kernel.execute(
        f"%%tnt --fail-fast-timeout {FAIL_FAST}\nimport signal, time\n"
        'if tnt.get_rank() == 0:\n    raise ValueError("master fails")\n'
        "if tnt.get_rank() == 2:\n    signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "time.sleep(60)",
        timeout=120,
    )
    elapsed = time.monotonic() - t0
    assert r.status == "error"
    assert "[rank 0] ValueError: master fails" in r.traceback
    assert f"rank(s) 2 did not stop within {FAIL_FAST} s" in r.traceback
    assert "the cluster was stopped" in r.traceback and "%tnt_cluster restart" in r.traceback
    assert elapsed < FAIL_FAST + 10, elapsed
    ensure_running(kernel)


def test_a_rank_killed_with_sigkill_is_reported_dead_and_restart_works(kernel):
    ensure_running(kernel)
    t0 = time.monotonic()
    r = kernel.execute(
        "%%tnt\nimport os, signal, time\n"
        "if tnt.get_rank() == 2:\n    time.sleep(0.5)\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "time.sleep(60)",
        timeout=120,
    )
    elapsed = time.monotonic() - t0
    assert r.status == "error" and r.error["ename"] == "ClusterDeadError"
    # rank 2 named first, though mpiexec kills the others too as soon as it notices
    assert re.match(r"rank(\(s\))? 2\b", r.error["evalue"]), r.error["evalue"]
    assert "died" in r.traceback and "%tnt_cluster restart" in r.traceback
    assert elapsed < 10, elapsed
    status = kernel.ok("%tnt_cluster status").stdout
    assert "DEAD" in status and "%tnt_cluster restart" in status
    r = kernel.execute("%%tnt\nprint(1)")
    assert r.status == "error" and "cluster is dead" in r.traceback
    kernel.ok("%tnt_cluster restart", timeout=120)
    ensure_running(kernel)


def test_a_dead_launcher_is_detected_between_cells(kernel):
    ensure_running(kernel)
    kernel.ok(
        "import os, signal\n"
        "_c = get_ipython().magics_manager.registry['TntMagics'].cluster\n"
        "os.killpg(_c._launcher.pid, signal.SIGKILL)\n"
        "_c._launcher.wait(10)"
    )
    r = kernel.execute("%%tnt\nprint(1)", timeout=60)
    assert r.status == "error" and r.error["ename"] == "ClusterDeadError"
    assert "%tnt_cluster restart" in r.traceback
    kernel.ok("%tnt_cluster restart", timeout=120)
    ensure_running(kernel)

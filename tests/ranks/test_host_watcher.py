"""The host's watcher (tnt_notebook.cluster.cleanup.watch_ranks) ends the nannies that outlive their
engines, whichever way the engines and their proxy ended."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from tnt_notebook.cluster.cleanup import NANNY_GRACE_S, watch_ranks

pytestmark = pytest.mark.timeout(60)

# an "engine" that starts a nanny as ipyparallel does (its own session) and then waits; the
# nanny ignores SIGTERM and never ends by itself, like one waiting for a controller that is gone
ENGINE = """
import subprocess, sys, time
subprocess.Popen([sys.executable, "-c",
                  "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "print(flush=True); time.sleep(600)",
                  "ipyparallel.engine.nanny"], start_new_session=True, stdout=sys.stdout)
time.sleep(600)
"""


@pytest.fixture
def world():
    """An engine with its nanny, and a process that stands for the host's proxy."""
    engine = subprocess.Popen([sys.executable, "-c", ENGINE], stdout=subprocess.PIPE)
    proxy = subprocess.Popen(["sleep", "600"])
    assert engine.stdout.readline() == b"\n"  # the nanny runs
    nanny = psutil.Process(engine.pid).children()[0]
    yield engine, proxy, nanny
    for p in (engine, proxy):
        p.kill()
        p.wait()
    if nanny.is_running():
        nanny.kill()
    engine.stdout.close()


def _watch(pids: list[int], tmp_path) -> tuple[threading.Thread, list[str]]:
    removed: list[str] = []
    watcher = threading.Thread(
        target=lambda: removed.extend(watch_ranks(pids, str(tmp_path))), daemon=True
    )
    watcher.start()
    time.sleep(0.5)  # (it has found the nanny)
    return watcher, removed


@pytest.mark.parametrize("proxy_ends", ["with its engines", "never"])
def test_a_nanny_that_outlives_its_engine_is_ended_after_the_grace(world, tmp_path, proxy_ends):
    engine, proxy, nanny = world
    watcher, removed = _watch([engine.pid, proxy.pid], tmp_path)
    os.kill(engine.pid, signal.SIGKILL)
    engine.wait()
    if proxy_ends == "with its engines":
        proxy.kill()
        proxy.wait()
    t0 = time.monotonic()
    psutil.wait_procs([nanny], timeout=NANNY_GRACE_S + 10)
    assert not nanny.is_running()
    assert time.monotonic() - t0 > NANNY_GRACE_S - 1  # it had its chance to end by itself
    if proxy_ends == "never":
        proxy.kill()  # (a proxy ends once its engines' nannies have)
    watcher.join(timeout=10)
    assert not watcher.is_alive()
    assert any(r.startswith(f"pid {nanny.pid} ") for r in removed), removed


def test_the_watcher_ends_as_soon_as_a_nanny_ends_by_itself(world, tmp_path):
    engine, proxy, nanny = world
    watcher, removed = _watch([engine.pid, proxy.pid], tmp_path)
    for p in (engine, proxy):
        p.kill()
        p.wait()
    nanny.kill()
    watcher.join(timeout=2)
    assert not watcher.is_alive()
    assert not any("nanny" in r for r in removed), removed

"""A world killed without MPI_Finalize leaks MPICH segments; the sweep removes exactly those."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from mpiworld import mpiexec_path, run_mpi

from tnt_notebook.cleanup import SHM_DIR, remove_orphaned_mpi_segments

pytestmark = pytest.mark.mpi


def _mpich_segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob("mpich_shm_*")}


def test_sweep_removes_segments_of_a_world_that_exited_without_finalize():
    before = _mpich_segments()
    run_mpi(2, "from mpi4py import MPI; import os; MPI.COMM_WORLD.Barrier(); os._exit(0)")
    leaked = _mpich_segments() - before
    assert leaked, "expected MPICH to leave its segment behind after os._exit"
    removed = remove_orphaned_mpi_segments()
    assert leaked <= set(removed)
    assert not leaked & _mpich_segments()


def test_sweep_keeps_segments_that_a_live_world_maps(tmp_path):
    ready = tmp_path / "ready"
    code = (
        "from mpi4py import MPI; import time, pathlib; MPI.COMM_WORLD.Barrier(); "
        f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    )
    before = _mpich_segments()
    world = subprocess.Popen(
        [mpiexec_path(), "-n", "2", sys.executable, "-c", code], start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline, "world did not start within 60 s"
            assert world.poll() is None, "world exited early"
            time.sleep(0.05)
        live = _mpich_segments() - before
        assert live
        remove_orphaned_mpi_segments()
        assert live <= _mpich_segments()
    finally:
        os.killpg(world.pid, signal.SIGKILL)
        world.wait(timeout=30)
        remove_orphaned_mpi_segments()


OWNER_ONLY_CHECK = """
import os, stat
import numpy as np
import tnt_notebook as tnt
shared = tnt.empty(4096)
shared[:] = 1
tnt.allreduce(shared)  # the engine's segment and a shared array, both mapped now
modes = {}
for line in open("/proc/self/maps"):
    fields = line.split(maxsplit=5)
    if len(fields) == 6 and ("/dev/shm/tnt-" in fields[5] or "/memfd:tnt-" in fields[5]):
        kind = "segment" if "/dev/shm/" in fields[5] else "shared array"
        mode = stat.S_IMODE(os.stat(f"/proc/self/map_files/{fields[0]}").st_mode)
        modes.setdefault(kind, set()).add(oct(mode))
print(tnt.get_rank(), sorted((k, sorted(v)) for k, v in modes.items()), flush=True)
"""


def test_shared_memory_of_the_engine_and_of_shared_arrays_is_owner_only():
    out = run_mpi(2, OWNER_ONLY_CHECK).stdout.splitlines()
    expected = "[('segment', ['0o600']), ('shared array', ['0o600'])]"
    assert sorted(out) == [f"0 {expected}", f"1 {expected}"]

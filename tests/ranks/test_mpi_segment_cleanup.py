"""A world killed without MPI_Finalize leaks MPICH segments (and, SIGKILLed, Hydra's hwloc file);
the sweep removes exactly those."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.mpiworld import mpiexec_path, run_mpi
from tests.support.testhosts import process_state
from tnt_notebook.cluster.cleanup import (
    SHM_DIR,
    remove_orphaned_mpi_files,
    remove_orphaned_mpi_segments,
)

pytestmark = pytest.mark.mpi


def _mpich_segments() -> set[str]:
    return {p.name for p in SHM_DIR.glob("mpich_shm_*")}


def _processes_using(names: set[str]) -> set[int]:
    """The processes that map or hold open a file whose path ends in one of `names`."""
    pids = set()
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            paths = proc.joinpath("maps").read_text().split()
            paths += [os.readlink(fd) for fd in proc.joinpath("fd").iterdir()]
        except OSError:
            continue
        if any(path.rsplit("/", 1)[-1] in names for path in paths):
            pids.add(int(proc.name))
    return pids


def _wait_until_exited(pids: set[int], timeout: float = 30.0) -> None:
    """SIGKILLed, mpiexec leaves its proxy to end the ranks (each in a session of its own), which
    map their segments until they do; the sweep rightly keeps a segment that a process maps."""
    deadline = time.monotonic() + timeout
    while True:
        alive = {pid for pid in pids if process_state(pid) not in ("", "Z", "X")}
        if not alive:
            return
        assert time.monotonic() < deadline, f"processes {alive} of the killed world still run"
        time.sleep(0.05)


def test_sweep_removes_segments_of_a_world_that_exited_without_finalize():
    before = _mpich_segments()
    run_mpi(2, "from mpi4py import MPI; import os; MPI.COMM_WORLD.Barrier(); os._exit(0)")
    leaked = _mpich_segments() - before
    assert leaked, "expected MPICH to leave its segment behind after os._exit"
    removed = remove_orphaned_mpi_segments()
    assert leaked <= set(removed)
    assert not leaked & _mpich_segments()


def _hwloc_files() -> set[str]:
    return {str(p) for p in Path("/tmp").glob("hydra_hwloc_xmlfile_*")}


def test_sweep_keeps_what_a_live_world_uses_and_removes_it_once_the_world_is_killed(tmp_path):
    """A live world's segments and its proxy's hwloc file stay; SIGKILLed, the world leaves
    both (its proxy cannot remove its file), and the sweep removes them."""
    ready = tmp_path / "ready"
    code = (
        "from mpi4py import MPI; import time, pathlib; MPI.COMM_WORLD.Barrier(); "
        f"pathlib.Path({str(ready)!r}).touch(); time.sleep(60)"
    )
    before, hwloc_before = _mpich_segments(), _hwloc_files()
    world_pids: set[int] = set()
    world = subprocess.Popen(
        [mpiexec_path(), "-n", "2", sys.executable, "-c", code], start_new_session=True
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert time.monotonic() < deadline, "world did not start within 60 s"
            assert world.poll() is None, "world exited early"
            time.sleep(0.05)
        live, hwloc = _mpich_segments() - before, _hwloc_files() - hwloc_before
        assert live and len(hwloc) == 1
        world_pids = _processes_using(live | {Path(f).name for f in hwloc})
        remove_orphaned_mpi_files()
        assert live <= _mpich_segments() and hwloc <= _hwloc_files()
    finally:
        os.killpg(world.pid, signal.SIGKILL)
        world.wait(timeout=30)
        _wait_until_exited(world_pids)
    assert live <= _mpich_segments() and hwloc <= _hwloc_files()
    removed = remove_orphaned_mpi_files()
    assert live <= set(removed) and hwloc <= set(removed)
    assert not live & _mpich_segments() and not hwloc & _hwloc_files()


def test_sweep_spares_a_segment_whose_creator_maps_it_within_the_grace():
    """A segment that exists but is not mapped yet (its creator between sizing and mapping it)."""
    path = SHM_DIR / f"mpich_shm_test_{os.getpid()}"
    code = (
        "import mmap, os, sys, time; fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600); "
        "os.ftruncate(fd, 4096); time.sleep(0.2); m = mmap.mmap(fd, 4096); "
        "print('mapped', flush=True); time.sleep(30)"
    )
    creator = subprocess.Popen([sys.executable, "-c", code, str(path)], stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 30
        while not path.exists():
            assert time.monotonic() < deadline and creator.poll() is None, "no segment"
            time.sleep(0.01)
        assert path.name not in remove_orphaned_mpi_segments()
        assert path.exists()
        assert creator.stdout.readline() == b"mapped\n"
    finally:
        creator.kill()
        creator.wait(timeout=30)
    assert path.name in remove_orphaned_mpi_segments()  # its creator gone, nobody's


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

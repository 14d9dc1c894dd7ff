"""Session-wide guards (no tnt shared-memory segment, no temporary file outlives the tests), the
session's test hosts and its test Slurm."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def temporary_files_are_removed(tmp_path_factory):
    """This process and the ones the tests start (ranks, kernels, launchers) use a temporary
    directory of the session's own, removed at its end: ranks that tests kill never run their exit
    handlers, which would remove TensorFlow's autograph files. (pytest's own tmp_path directories
    stay where they were, for inspection.)"""
    tmp_path_factory.getbasetemp()  # placed before the switch
    own = tempfile.mkdtemp(prefix="tnt-tests-")
    saved = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"] = tempfile.tempdir = own
    yield
    if saved[0] is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = saved[0]
    tempfile.tempdir = saved[1]
    shutil.rmtree(own, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """Every test session must leave /dev/shm as clean of tnt segments as it found it, and no
    file of MPICH's that nobody uses: a test that kills a world on purpose removes what that
    world left (:func:`mpiworld.sweep_killed_worlds`), and the product's watchers remove what
    its clusters' killed ranks left. Leftovers fail the session (and are removed then)."""
    from tnt_notebook.cluster.cleanup import remove_orphaned_mpi_files

    shm = Path("/dev/shm")
    before = {p.name for p in shm.glob("tnt*")} if shm.exists() else set()
    remove_orphaned_mpi_files()  # (what an earlier session left is not this one's)
    yield
    orphans = remove_orphaned_mpi_files()
    left = ({p.name for p in shm.glob("tnt*")} - before) if shm.exists() else set()
    assert not left, f"shared-memory segments left behind: {sorted(left)}"
    assert not orphans, f"MPICH files left behind by killed worlds: {orphans}"


@pytest.fixture(scope="session")
def test_hosts(temporary_files_are_removed):
    """Three test hosts (tests/support/testhosts.py) for the whole session, made on first use; the
    tests skip with the reason where they cannot be made (not root, sshd missing). A test that takes
    a link down, shapes it or stops an sshd puts it back before it ends."""
    from tests.support.testhosts import TestHosts, unavailable

    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with TestHosts(3) as hosts:
        yield hosts


@pytest.fixture(scope="session")
def slurm(temporary_files_are_removed):
    """A real Slurm of two nodes (tests/support/slurmcluster.py) for the whole session, made on
    first use; the tests skip with the reason where it cannot be made (not root, Slurm missing).
    Each node offers 4 CPUs, so that a module's long job of 2 per node leaves room for another job,
    and 4 GPUs (device files that stand for them: Slurm grants them and sets its GPU variables).
    Its client commands find it through SLURM_CONF, set in this process while it runs."""
    from tests.support.slurmcluster import SlurmCluster, unavailable

    reason = unavailable()
    if reason:
        pytest.skip(reason)
    with SlurmCluster(2, cpus=4, gpus=4) as cluster:
        saved = os.environ.get("SLURM_CONF")
        os.environ.update(cluster.env)
        try:
            yield cluster
        finally:
            if saved is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = saved


@pytest.fixture
def killed_worlds_swept():
    """For a test that kills a world (or a rank of one) on purpose, outside a cluster whose host
    watchers would clean up: afterwards, what its killed ranks left (MPICH segments in /dev/shm,
    Hydra's hwloc files) is removed, as the product's next start would, once no process maps it
    any more (the survivors and launcher end a moment after the test)."""
    from tnt_notebook.cluster import cleanup

    def segments() -> set[str]:
        return {
            n for n in os.listdir(cleanup.SHM_DIR) if n.startswith(cleanup.MPI_SEGMENT_PREFIXES)
        }

    before = segments()
    yield
    deadline = time.monotonic() + 30
    while True:
        cleanup.remove_orphaned_mpi_files()
        left = segments() - before - cleanup._mapped_shm_names()
        if not left:
            return
        assert time.monotonic() < deadline, f"still in /dev/shm: {sorted(left)}"
        time.sleep(0.2)

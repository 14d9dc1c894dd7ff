"""Session-wide guards: no tnt shared-memory segment, and no temporary file, outlives the tests."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def temporary_files_of_started_processes_are_removed():
    """The processes the tests start (ranks, kernels, launchers) inherit a TMPDIR of the session's
    own: ranks that tests kill never run their exit handlers, which would remove TensorFlow's
    autograph files, nor does a killed launcher remove its topology file."""
    own = tempfile.mkdtemp(prefix="tnt-tests-")
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = own
    yield
    if previous is None:
        os.environ.pop("TMPDIR", None)
    else:
        os.environ["TMPDIR"] = previous
    shutil.rmtree(own, ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def no_shared_memory_left_behind():
    """Every test session must leave /dev/shm as clean of tnt segments as it found it."""
    shm = Path("/dev/shm")
    before = {p.name for p in shm.glob("tnt*")} if shm.exists() else set()
    yield
    from tnt_notebook.cleanup import remove_orphaned_mpi_segments

    # Worlds that tests kill on purpose leave MPICH's own segments behind; ours must never leak.
    remove_orphaned_mpi_segments(min_age_s=0)
    if shm.exists():
        left = {p.name for p in shm.glob("tnt*")} - before
        assert not left, f"shared-memory segments left behind: {sorted(left)}"

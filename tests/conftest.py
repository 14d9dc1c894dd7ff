"""Session-wide guard: no tnt shared-memory segment may outlive the tests."""

from __future__ import annotations

from pathlib import Path

import pytest


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

"""Shared fixtures: real mpiexec worlds with deadlines, and a clean /dev/shm afterwards."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent


def mpiexec_path() -> str:
    """The launcher of the MPI that mpi4py and the native core use (mpich wheel by default)."""
    return os.environ.get("TNT_MPIEXEC") or str(VENV_BIN / "mpiexec")


def run_mpi(
    n: int,
    code: str,
    *,
    timeout: float = 120,
    env: dict[str, str] | None = None,
    mpi_args: tuple[str, ...] = (),
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run `code` as a Python script on `n` ranks under mpiexec; kill the world at the deadline."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    cmd = [mpiexec_path(), "-n", str(n), *mpi_args, sys.executable, "-c", textwrap.dedent(code)]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=full_env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"mpiexec -n {n} did not finish within {timeout} s\n{out}\n{err}")
    result = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    if check and proc.returncode != 0:
        pytest.fail(f"mpiexec -n {n} exited {proc.returncode}\nstdout:\n{out}\nstderr:\n{err}")
    return result


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

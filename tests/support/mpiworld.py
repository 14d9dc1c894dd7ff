"""Real mpiexec worlds with deadlines, for tests of every suite (`from mpiworld import run_mpi`)."""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent
# Hydra reacts to a rank's death by ending (some of) the others, even with -disable-auto-cleanup.
# The survivors must find out by themselves, so the launcher must not see the death: each rank runs
# under a shell that, when the rank dies, stays a few seconds longer and then exits cleanly.
HIDE_DEATH_FROM_HYDRA = ("-disable-auto-cleanup", "/bin/sh", "-c", '"$@" || sleep 4', "sh")


@functools.cache
def gaspi_built() -> bool:
    """Whether the native core was built with the GASPI transport (GPI-2 found at build time)."""
    from tnt_notebook.transport import built_transports

    try:
        return "gaspi" in built_transports(sys.executable)
    except ValueError:
        return False


requires_gaspi = pytest.mark.skipif(
    not gaspi_built(),
    reason="no GASPI transport in this build: GPI-2 was not found when it was built "
    "(scripts/test.sh builds GPI-2 where ../shared/third_party holds its source)",
)


def transport_env(transport: str) -> dict[str, str]:
    """A world whose step between nodes goes over `transport`; over GASPI every allreduce takes
    the engine's path (the automatic choice would send some through MPI_Allreduce instead)."""
    env = {"TNT_TRANSPORT": transport}
    if transport == "gaspi":
        env["TNT_ALLREDUCE_PATH"] = "engine"
    return env


# A GASPI world: the step between pseudo-nodes of one rank each goes over GPI-2.
GASPI_ENV = {**transport_env("gaspi"), "TNT_RANKS_PER_NODE": "1"}


def free_port_range() -> int:
    """The first of GPI-2's 384 ports, all free right now.

    Below the product's automatic bases (20480 + 384 k) and below the kernel's ephemeral ports
    (32768 and up by default), which any outgoing connection may take between this check and the
    start it is meant for."""
    for base in range(10240, 20480 - 384 + 1, 384):
        try:
            for port in (base, base + 128, base + 256):
                with socket.socket() as s:
                    s.bind(("", port))
            return base
        except OSError:
            continue
    pytest.skip("no free port range")


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
    """Run `code` as a Python script on `n` ranks under mpiexec; kill the world at the deadline.

    The ranks' stdout stays block-buffered, so that a `print(..., flush=True)` reaches the shared
    pipe as one write: unbuffered, each of its pieces is a write of its own and the ranks' lines
    interleave mid-line ("PATHPATH 1 op\n 0 op")."""
    full_env = {**os.environ, **(env or {})}
    full_env.pop("PYTHONUNBUFFERED", None)
    cmd = [mpiexec_path(), "-n", str(n), *mpi_args, sys.executable, "-c", textwrap.dedent(code)]
    result = run_with_deadline(cmd, timeout=timeout, env=full_env)
    if check and result.returncode != 0:
        pytest.fail(
            f"mpiexec -n {n} exited {result.returncode}\n"
            f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
        )
    return result


def run_with_deadline(
    cmd: list[str],
    *,
    timeout: float,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess:
    """Run `cmd` in a session of its own, its output captured; at the deadline kill the session
    (an mpiexec it started and its ranks too: killing `cmd` alone would leave them) and fail."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=cwd,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd[:6])} did not finish within {timeout} s\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def run_plain(code: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run `code` in a plain Python process (a 1-rank world, no mpiexec), with a deadline."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
    )


def run_allreduce_bench(
    args: list[str], out: Path, env: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess, dict]:
    """`python -m tnt_notebook.bench allreduce ARGS` as a user starts it (it launches its own
    world), with a deadline; its printed table and its JSON report, once it exited 0."""
    cmd = [sys.executable, "-m", "tnt_notebook.bench", "allreduce", *args, "--json", str(out)]
    result = run_with_deadline(cmd, timeout=180, env={**os.environ, **(env or {})})
    assert result.returncode == 0, result.stdout + result.stderr
    return result, json.loads(out.read_text())

"""The GASPI transport (GPI-2) between pseudo-nodes of one rank each on this machine: the rank API
and every op and dtype against numpy, new GASPI segments for rebuilt engines, GPI-2's ports (a
range in use is named, two worlds at once choose different ones), nothing left behind."""

from __future__ import annotations

import os
import socket
import tempfile
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.mpiworld import (
    GASPI_ENV,
    free_port_range,
    gaspi_built,
    requires_gaspi,
    run_allreduce_bench,
    run_mpi,
    run_plain,
)
from tests.support.rank_api_checks import API_CHECKS, PRELUDE

pytestmark = pytest.mark.mpi
ENV = {**GASPI_ENV, "TNT_COLLECTIVE_TIMEOUT": "20"}


def machine_files() -> list[str]:
    return [f for f in os.listdir(tempfile.gettempdir()) if f.startswith("tnt-gaspi-")]


@requires_gaspi
@pytest.mark.parametrize("n", [2, 3])
def test_the_rank_api_and_every_op_and_dtype_over_gaspi(n: int) -> None:
    result = run_mpi(
        n,
        PRELUDE
        + API_CHECKS
        + """
info = ranks.engine_info()
assert info["transport"] == "gaspi" and info["num_nodes"] == p and info["local_size"] == 1, info
checks = w.matrix([0, 1, 7, 1001, (33, 65), 300_001])
w.fused(None, count=20)
# a rebuilt engine has a GASPI segment of its own; a tiny shared segment: many rounds per call
w.rebuild_with(TNT_SHM_SEGMENT_BYTES="4096")
checks += w.matrix([1001, 20_001], ops=["sum", "max"], salt="rounds")
w.say("GASPI", r, checks)
""",
        env=ENV,
    )
    assert result.stdout.count("GASPI") == n, result.stdout + result.stderr
    assert machine_files() == []


@requires_gaspi
def test_a_port_in_use_is_named_and_an_automatic_range_then_starts() -> None:
    base = free_port_range()
    with socket.socket() as held:  # another program's listener on GPI-2's TCP port of rank 1
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("", base + 128 + 1))
        held.listen()
        result = run_mpi(
            2,
            PRELUDE
            + f"""
import time
os.environ["TNT_GASPI_PORT"] = "{base}"
t0 = time.monotonic()
msg = w.expect_error(ranks.CollectiveError, tnt.barrier, match="port {base + 129} is in use")
assert "rank 1)" in msg and "TNT_GASPI_PORT" in msg and time.monotonic() - t0 < 10, msg
del os.environ["TNT_GASPI_PORT"]   # GPI-2 did not start: it still can, on a free range
np.testing.assert_array_equal(tnt.allreduce(np.ones(5)), np.full(5, p))
w.say("PORTS", r, msg)
""",
            env=ENV,
        )
    assert result.stdout.count("PORTS") == 2, result.stdout + result.stderr
    assert machine_files() == []


@requires_gaspi
def test_two_gaspi_worlds_at_once_on_the_same_fixed_ports_do_not_both_start() -> None:
    """GPI-2 binds its ports seconds after the check: the ranks claim them first."""
    code = (
        PRELUDE
        + """
import time
try:
    tnt.barrier()
    w.say("STARTED", r)
    time.sleep(6)   # the other world starts meanwhile
except ranks.CollectiveError as e:
    w.say("REFUSED", r, e)
"""
    )
    env = {**ENV, "TNT_GASPI_PORT": str(free_port_range())}
    with ThreadPoolExecutor(2) as pool:
        results = [f.result() for f in [pool.submit(run_mpi, 2, code, env=env) for _ in range(2)]]
    outcomes = sorted(r.stdout.count("STARTED") for r in results)
    assert outcomes in ([0, 2], [0, 0]), [r.stdout for r in results]
    for result in results:
        refused = [line for line in result.stdout.splitlines() if line.startswith("REFUSED")]
        assert len(refused) in (0, 2), result.stdout
        assert all(f"is in use on host {socket.gethostname()}" in line for line in refused), refused


@requires_gaspi
def test_two_gaspi_worlds_at_once_choose_different_ports() -> None:
    code = (
        PRELUDE
        + """
x = np.arange(100_000, dtype=np.float32) * (r + 1)
for _ in range(20):
    np.testing.assert_array_equal(tnt.allreduce(x), np.arange(100_000) * 3)
w.say("WORLD", r)
"""
    )
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda _: run_mpi(2, code, env=ENV), range(2)))
    for result in results:
        assert result.stdout.count("WORLD") == 2, result.stdout + result.stderr


@requires_gaspi
def test_a_plain_process_is_a_one_rank_gaspi_world() -> None:
    result = run_plain(
        PRELUDE + 'assert ranks.engine_info()["transport"] == "gaspi"\n' + API_CHECKS, env=ENV
    )
    assert result.returncode == 0 and "API OK 0" in result.stdout, result.stderr


@pytest.mark.skipif(gaspi_built(), reason="this build has the GASPI transport")
def test_without_gpi2_a_rank_asked_for_gaspi_raises_one_line() -> None:
    result = run_plain("import tnt_notebook as tnt\ntnt.barrier()", env=ENV)
    last = result.stderr.strip().splitlines()[-1]
    assert result.returncode != 0 and last.startswith("ValueError: the GASPI transport is not"), (
        last
    )


@requires_gaspi
def test_the_allreduce_benchmark_compares_gaspi_with_the_mpi_transport_and_mpi(tmp_path) -> None:
    """One run: ours over GASPI, the engine's path over MPI and MPI_Allreduce take turns."""
    args = ["--transport", "gaspi", "--path", "engine", "--sizes", "4096,1M", "--iters", "3"]
    args += ["--warmup", "1"]
    result, data = run_allreduce_bench(args, tmp_path / "a.json", {"TNT_RANKS_PER_NODE": "1"})
    assert (data["transport"], data["nodes"]) == ("gaspi", 2)
    assert all(row["verified"] for row in data["rows"]) and len(data["rows"]) == 4
    for row in data["rows"]:
        assert row["ours"]["path"] == "engine" and row["over_mpi"]["calls"] == 3, row
        assert row["ratio_vs_over_mpi"] > 0, row
    assert "(gaspi between nodes)" in result.stdout and "vs over MPI" in result.stdout

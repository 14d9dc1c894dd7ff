"""The public rank API (tnt.get_rank ... tnt.allreduce, FusedAllreduce) in real worlds."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support.mpiworld import run_allreduce_bench, run_mpi, run_plain
from tests.support.rank_api_checks import API_CHECKS, PRELUDE


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_rank_api_under_mpiexec(n: int) -> None:
    result = run_mpi(n, PRELUDE + API_CHECKS, env={"TNT_COLLECTIVE_TIMEOUT": "20"})
    assert result.stdout.count("API OK") == n, result.stdout + result.stderr


def test_a_plain_process_is_a_one_rank_world() -> None:
    result = run_plain(PRELUDE + API_CHECKS)
    assert result.returncode == 0, result.stderr
    assert "API OK 0" in result.stdout


def test_importing_the_package_loads_neither_mpi_nor_tensorflow() -> None:
    result = run_plain(
        """
        import sys
        import tnt_notebook, tnt_notebook.rank.api
        heavy = [m for m in ("mpi4py", "mpi4py.MPI", "tnt_notebook._native", "tensorflow")
                 if m in sys.modules]
        assert not heavy, heavy
        assert callable(tnt_notebook.allreduce) and "mpi4py" not in sys.modules
        print("CHEAP")
        """
    )
    assert result.returncode == 0 and "CHEAP" in result.stdout, result.stderr


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("TNT_COLLECTIVE_TIMEOUT", "soon"),
        ("TNT_WAIT_SPIN_US", "-5"),
        ("TNT_SHM_SEGMENT_BYTES", "2M"),
        ("TNT_TRANSPORT", "carrier-pigeon"),
        ("TNT_GASPI_PORT", "auto"),
    ],
)
def test_a_bad_engine_setting_in_the_environment_is_a_clear_error(name: str, value: str) -> None:
    result = run_plain("import tnt_notebook as tnt\ntnt.barrier()", env={name: value})
    assert result.returncode != 0 and f"{name}={value!r}" in result.stderr


@pytest.mark.mpi
def test_the_allreduce_benchmark_writes_both_engines_to_json(tmp_path: Path) -> None:
    args = ["--sizes", "4096,2M", "--iters", "3", "--warmup", "1", "--pool", "4M", "--block", "2"]
    result, data = run_allreduce_bench(args, tmp_path / "allreduce.json")
    sizes, memory = [4096, 4096, 2 << 20, 2 << 20], ["numpy", "shared"] * 2
    assert data["ranks"] == 2 and [r["size_bytes"] for r in data["rows"]] == sizes
    assert [r["memory"] for r in data["rows"]] == memory
    assert data["block"] == 2
    assert [r["buffers"] for r in data["rows"]] == ["hot", "hot", "fresh", "fresh"]
    for row in data["rows"]:
        assert row["verified"] and row["ratio"] > 0 and 0 < row["ratio_vs_best_mpi"] <= row["ratio"]
        for engine in ("ours", "mpi"):
            assert row[engine]["latency_us"] > 0 and row[engine]["busbw_GBps"] > 0
            assert row[engine]["calls"] == 3  # every timed call after the warm-up, in turns of 2
    assert "ratio" in result.stdout and "fresh" in result.stdout and "shared" in result.stdout


@pytest.mark.mpi
@pytest.mark.parametrize(
    "path, sizes, paths",
    [
        ("auto", "4096,44K", [("posted", "whole")] * 2),
        # MPI's path set: every call that fits one message is posted, a larger one is not
        ("mpi", "44K,2M", [("posted",), ("whole",)]),
    ],
)
def test_the_allreduce_benchmark_overlaps_computation_with_both_engines(
    path: str, sizes: str, paths: list[tuple[str, ...]], tmp_path: Path
) -> None:
    """Across 2 pseudo-nodes: ours starts, computes, finishes (posted or whole, as the probes
    chose or the path policy sets); MPI runs MPI_Iallreduce around the same computation."""
    args = ["--overlap-us", "2000", "--path", path, "--sizes", sizes, "--iters", "12"]
    args += ["--warmup", "2", "--memory", "numpy", "--link-gbps", "10"]
    result, data = run_allreduce_bench(args, tmp_path / "a.json", {"TNT_RANKS_PER_NODE": "1"})
    assert data["nodes"] == 2 and data["overlap_us"] == 2000
    for row, allowed in zip(data["rows"], paths, strict=True):
        assert row["verified"] and row["ours"]["path"] in allowed, row
        assert row["ours"]["calls"] == row["mpi"]["calls"] == 12
    assert "us of computation inside each call" in result.stdout


@pytest.mark.mpi
def test_an_allreduce_benchmark_killed_takes_its_world_with_it(tmp_path: Path) -> None:
    """SIGKILL to the benchmark a user started: the mpiexec it launched and the ranks end too."""
    marker = str(tmp_path / "killed.json")  # on the command line of every process of the run
    cmd = [sys.executable, "-m", "tnt_notebook.bench", "allreduce", "--sizes", "64M"]
    bench = subprocess.Popen([*cmd, "--iters", "100000", "--json", marker], start_new_session=True)

    def run_processes() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter(["cmdline", "status"]):
            if marker in (p.info["cmdline"] or []) and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        return found

    try:
        deadline = time.monotonic() + 60
        while len(run_processes()) < 4:  # the bench, mpiexec and 2 ranks
            assert bench.poll() is None and time.monotonic() < deadline, run_processes()
            time.sleep(0.2)
        bench.kill()
        bench.wait(timeout=10)
        _, alive = psutil.wait_procs(run_processes(), timeout=20)
        assert not alive, alive
    finally:
        bench.kill()
        for p in run_processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def test_the_allreduce_benchmark_rejects_an_unknown_kind_of_memory(capsys) -> None:
    from tnt_notebook.bench import allreduce

    with pytest.raises(SystemExit):
        allreduce.parse_args(["--memory", "numpy,gpu"])
    assert "--memory takes numpy and/or shared" in capsys.readouterr().err
    assert allreduce.parse_args(["--memory", "shared"]).memory == ["shared"]

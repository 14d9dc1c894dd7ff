"""The public rank API (tnt.get_rank ... tnt.allreduce, FusedAllreduce) in real worlds."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from mpiworld import run_allreduce_bench, run_mpi, run_plain

CHECKS = str(Path(__file__).parents[1] / "native")
PRELUDE = f"""
import os, sys
sys.path.insert(0, {CHECKS!r})
import numpy as np
import ml_dtypes
import tnt_notebook as tnt
from tnt_notebook.rank import api as ranks
import world_checks as w
r, p = tnt.get_rank(), tnt.get_size()
"""

API_CHECKS = """
from mpi4py import MPI
assert (r, p) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
assert tnt.get_master_rank() == 0 and tnt.is_master_rank() == (r == 0)
tnt.barrier()

# broadcast: arrays keep shape and dtype, any picklable object, any root
last = p - 1
for value in [np.arange(12, dtype=np.float16).reshape(3, 4), np.float64(2.5), np.array(7),
              np.ones((2, 3), ml_dtypes.bfloat16), np.arange(30)[::3],
              np.random.default_rng(1).standard_normal((300, 500)),
              {"a": [1, 2, (3, "x")], "b": None}, "text", 42]:
    got = tnt.broadcast(value if r == last else None, root=last)
    if isinstance(value, np.ndarray):
        assert got.shape == value.shape and got.dtype == value.dtype
        np.testing.assert_array_equal(got, value)
    else:
        assert got == value
w.expect_error(ValueError, tnt.broadcast, 1, root=p)
w.expect_error(ValueError, tnt.broadcast, 1, root=-1)
if p > 1:  # an object the root cannot pickle: every rank raises (one rank needs no pickling)
    lam = (lambda: 0) if r == 0 else None
    w.expect_error(Exception, tnt.broadcast, lam, root=0, match="ickl")

# allreduce: a new array of the same shape and dtype
x = np.arange(6, dtype=np.float32).reshape(2, 3) + r
y = tnt.allreduce(x)
assert y is not x and y.shape == x.shape and y.dtype == x.dtype
np.testing.assert_array_equal(y, sum(x - r + q for q in range(p)))
np.testing.assert_array_equal(tnt.allreduce([1.0, 2.0]), [p, 2 * p])          # lists
assert tnt.allreduce(np.float64(r)).shape == () and tnt.allreduce(np.float64(r)) == sum(range(p))
big = np.arange(40, dtype=np.int64).reshape(5, 8)
np.testing.assert_array_equal(tnt.allreduce(big[:, ::3], "max"), big[:, ::3])  # non-contiguous
np.testing.assert_array_equal(tnt.allreduce(big.T), big.T * p)                 # Fortran order
ro = np.full(5, r, np.int32); ro.flags.writeable = False
np.testing.assert_array_equal(tnt.allreduce(ro, "min"), np.zeros(5, np.int32))  # read-only input
out = np.empty(5, np.int32)
assert tnt.allreduce(ro, "max", out=out) is out and (out == p - 1).all()
inplace = np.arange(3_000_001, dtype=np.float64) * (r + 1)   # several rounds, out=input
assert tnt.allreduce(inplace, out=inplace) is inplace
np.testing.assert_array_equal(inplace, np.arange(3_000_001, dtype=np.float64) * (p * (p + 1) // 2))
shifted = np.arange(1_000_007, dtype=np.float64) * (r + 1)  # out overlaps the input, 7 further on
tnt.allreduce(shifted[:-7], out=shifted[7:])
np.testing.assert_array_equal(shifted[7:], np.arange(1_000_000.0) * sum(range(1, p + 1)))
np.testing.assert_array_equal(tnt.allreduce(np.full(3, r + 1, np.int32), "average"),
                              np.full(3, sum(range(1, p + 1)) // p, np.int32))
np.testing.assert_array_equal(tnt.allreduce(np.full(2, -r - 1, np.int64), "average"),
                              np.full(2, -(sum(range(1, p + 1)) // p), np.int64))  # toward zero
# bad input raises on the calling rank before any communication: only rank 0 makes mistakes
if r == 0:
    w.expect_error(ValueError, tnt.allreduce, x, "prod", match="unsupported op")
    w.expect_error(ValueError, tnt.allreduce, x, None)
    for bad in [np.ones(3, bool), np.ones(3, np.complex64), np.ones(3, np.uint8),
                np.array(["a"]), np.array([object()])]:
        w.expect_error(TypeError, tnt.allreduce, bad, match="unsupported dtype")
    w.expect_error(ValueError, tnt.allreduce, x, out=np.empty(5, np.float32), match="shape")
    w.expect_error(ValueError, tnt.allreduce, x, out=np.empty((2, 3), np.float64))
    w.expect_error(ValueError, tnt.allreduce, x, out=np.empty((3, 2), np.float32).T)
    w.expect_error(ValueError, tnt.allreduce, x, out=np.empty(6, np.float32), match="shape")
    w.expect_error(ValueError, tnt.allreduce, x, out=np.empty((2, 3), np.int32), match="dtype")
    w.expect_error(TypeError, tnt.allreduce, x, out=[0] * 6)
    frozen = np.empty((2, 3), np.float32); frozen.flags.writeable = False
    w.expect_error(ValueError, tnt.allreduce, x, out=frozen, match="writeable")
np.testing.assert_array_equal(tnt.allreduce(np.ones(4)), np.full(4, p))  # nobody is out of step

# FusedAllreduce contract
specs = [((3, 4), np.float32), ((5,), np.float32), ((2, 2), np.float64), ((7,), np.float32)]
f = ranks.FusedAllreduce(specs, threshold_bytes=64)
assert f.buckets == [[0, 1], [2], [3]]  # 48 + 20 bytes reach 64; dtypes never mix
arrays = [np.full(s, r + 1, d) for s, d in specs]
for a in arrays:
    a.flags.writeable = False   # TF hands over read-only arrays
for k, b in enumerate(f.buckets):
    outs = f.reduce_bucket(k, [arrays[i] for i in b])
    for i, o in zip(b, outs):
        assert o.shape == specs[i][0] and o.dtype == specs[i][1]
        np.testing.assert_array_equal(o, np.full(specs[i][0], sum(range(1, p + 1))))
res = f.allreduce(arrays, "average")
assert [a.shape for a in res] == [s for s, _ in specs]
# reuse=True: aligned results, the same arrays again once the caller let go, new ones while held
held = f.reduce_bucket(0, [arrays[i] for i in f.buckets[0]], reuse=True)
assert all(o.ctypes.data % 64 == 0 for o in held)
ids = [id(o) for o in held]
twice = [np.full(specs[i][0], 2 * r, specs[i][1]) for i in f.buckets[0]]
again = f.reduce_bucket(0, twice, reuse=True)
assert [id(o) for o in again] != ids  # `held` is still referenced: it must not be overwritten
np.testing.assert_array_equal(held[0], np.full(specs[f.buckets[0][0]][0], sum(range(1, p + 1))))
np.testing.assert_array_equal(again[0], np.full(specs[f.buckets[0][0]][0], p * (p - 1)))
ids = [id(o) for o in again]
del held, again
assert [id(o) for o in f.reduce_bucket(0, [arrays[i] for i in f.buckets[0]], reuse=True)] == ids
if r == 0:
    w.expect_error(IndexError, f.reduce_bucket, len(f.buckets), [])
    w.expect_error(ValueError, f.reduce_bucket, 0, [])
    w.expect_error(TypeError, f.reduce_bucket, 0, [np.ones((3, 4), np.float64)] * len(f.buckets[0]))
    w.expect_error(ValueError, f.reduce_bucket, 0, [np.ones(13, np.float32)] * len(f.buckets[0]))
    w.expect_error(ValueError, f.reduce_bucket, 0, [arrays[i] for i in f.buckets[0]], "prod")
    w.expect_error(ValueError, f.allreduce, arrays[:2])
    w.expect_error(ValueError, ranks.FusedAllreduce, specs, threshold_bytes=-1)
    w.expect_error(TypeError, ranks.FusedAllreduce, specs, threshold_bytes=1.5)
    w.expect_error(TypeError, ranks.FusedAllreduce, [((2,), np.complex128)])
assert ranks.FusedAllreduce(specs, threshold_bytes=0).buckets == [[0], [1], [2], [3]]
os.environ["TNT_FUSION_THRESHOLD"] = "1000000"
assert ranks.FusedAllreduce(specs).buckets == [[0, 1], [2], [3]]
del os.environ["TNT_FUSION_THRESHOLD"]
assert ranks.FusedAllreduce(specs).threshold_bytes == 32768

# timeouts are configurable
if r == 0:
    w.expect_error(ValueError, ranks.set_collective_timeout, 0)
ranks.set_collective_timeout(12.5)
assert ranks.engine_info()["timeout"] == 12.5
ranks.set_collective_timeout(None)
assert ranks.collective_timeout() == float(os.environ.get("TNT_COLLECTIVE_TIMEOUT", 30))
tnt.barrier()
w.say("API OK", r)
"""


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

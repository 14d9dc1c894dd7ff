"""The engine in real mpiexec worlds: results against numpy, fusion, topologies, mismatches."""

from __future__ import annotations

import pytest

from tests.support.engine_worlds import run
from tests.support.mpiworld import requires_gaspi, transport_env

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_every_op_and_dtype_matches_numpy_in_one_and_many_rounds(n: int) -> None:
    result = run(
        n,
        """
# a tiny segment: every size past a few elements takes many pipelined rounds
w.rebuild_with(TNT_SHM_SEGMENT_BYTES="4096")
checks = w.matrix([0, 1, 7, 1001, (33, 65)])
# a 1 MiB segment and sizes of several of its rounds, then the default segment
w.rebuild_with(TNT_SHM_SEGMENT_BYTES=str(1 << 20))
checks += w.matrix([1_100_001], ops=["sum", "max"])
w.rebuild_with(TNT_SHM_SEGMENT_BYTES=None)
assert ranks.engine_info()["slot_bytes"] == 2 << 20
checks += w.matrix([1001, 1_300_001], ops=["sum", "max"])
# outputs of 4 MiB and more take the streaming path (halves convert through a block)
checks += w.matrix([2_100_001], names=["float16", "bfloat16", "float32"], ops=["sum", "average"])
assert ranks.engine_info()["num_nodes"] == 1
w.say("CHECKS", r, checks)
""",
    )
    assert result.stdout.count("CHECKS") == n, result.stdout


@pytest.mark.parametrize("n", [2, 3])
def test_fused_buckets_match_numpy_for_every_threshold(n: int) -> None:
    result = run(
        n,
        """
for seg in ("4096", None):
    w.rebuild_with(TNT_SHM_SEGMENT_BYTES=seg)
    counts = [w.fused(t) for t in (0, None, 1024, 1 << 30)]
    assert counts[0] == 40 and counts[3] <= counts[1] <= counts[2] < counts[0], counts
os.environ["TNT_FUSION_THRESHOLD"] = "0"
assert len(ranks.FusedAllreduce([((2,), np.float32)] * 3).buckets) == 3
w.say("FUSED", r)
""",
    )
    assert result.stdout.count("FUSED") == n, result.stdout


@pytest.mark.parametrize(("n", "per_node"), [(2, "0"), (4, "0"), (4, "2")], ids=["2", "4", "2x2"])
def test_waits_spin_only_where_every_rank_has_a_core_unless_the_user_says(
    n: int, per_node: str
) -> None:
    """Pseudo-nodes share the machine's cores: 2x2 on 2 cores must not spin either."""
    result = run(
        n,
        """
cores = len(os.sched_getaffinity(0))  # mpiexec binds nothing: every rank may use every core
assert ranks.engine_info()["spin_us"] == (2000 if p <= cores else 0), (p, cores)
for spin in ("0", "150"):
    w.rebuild_with(TNT_WAIT_SPIN_US=spin)
    assert ranks.engine_info()["spin_us"] == int(spin)
    checks = w.matrix([1001], names=["float32"], ops=["sum"], salt="spin" + spin)
w.rebuild_with(TNT_WAIT_SPIN_US=None)
w.say("SPIN", r, checks)
""",
        env={"TNT_RANKS_PER_NODE": per_node},
    )
    assert result.stdout.count("SPIN") == n, result.stdout


@pytest.mark.parametrize(
    ("n", "per_node", "transport"),
    [(4, "1", "mpi"), (4, "2", "mpi"), (3, "2", "mpi"), (3, "1", "mpi")]
    + [
        pytest.param(n, k, "gaspi", marks=requires_gaspi) for n, k in ((4, "2"), (3, "2"), (3, "1"))
    ],
    ids=["4x1", "2x2", "2+1", "3x1", "2x2-gaspi", "2+1-gaspi", "3x1-gaspi"],
)
def test_multi_node_path_matches_numpy(n: int, per_node: str, transport: str) -> None:
    """Pseudo-nodes of k consecutive ranks exercise the cross-node step on one machine (over GASPI:
    a ring per local rank, or among the node leaders of uneven nodes)."""
    result = run(
        n,
        f"""
w.rebuild_with(TNT_SHM_SEGMENT_BYTES="4096")
info = ranks.engine_info()
nodes = -(-p // {per_node})
first = r - r % {per_node}
assert info["num_nodes"] == nodes, info
assert info["local_size"] == min(p, first + {per_node}) - first, info
checks = w.matrix([0, 1, 1001], salt="multi")
w.fused(None, count=20)
w.rebuild_with(TNT_SHM_SEGMENT_BYTES=None)
checks += w.matrix([300_001], names=["float32", "float16"], ops=["sum", "average"])
assert info["transport"] == "{transport}", info
w.say("NODES", r, info["num_nodes"], info["nparts"], checks)
""",
        env={"TNT_RANKS_PER_NODE": per_node, **transport_env(transport)},
    )
    assert result.stdout.count("NODES") == n, result.stdout


@pytest.mark.parametrize(
    ("n", "per_node", "transport"),
    [(2, "0", "mpi"), (3, "0", "mpi"), (4, "2", "mpi")]
    + [
        pytest.param(n, k, "gaspi", marks=requires_gaspi) for n, k in ((2, "1"), (3, "1"), (4, "2"))
    ],
    ids=["2", "3", "2x2", "2x1-gaspi", "3x1-gaspi", "2x2-gaspi"],
)
def test_mismatched_calls_raise_on_every_rank_and_the_engine_stays_usable(
    n: int, per_node: str, transport: str
) -> None:
    result = run(
        n,
        """
E = ranks.CollectiveMismatchError
last = r == p - 1
x = np.ones(10, np.float32)
w.expect_error(E, tnt.allreduce, np.ones(11 if last else 10, np.float32), match="10")
w.expect_error(E, tnt.allreduce, np.ones(10, np.float64 if last else np.float32), match="float64")
w.expect_error(E, tnt.allreduce, x, "max" if last else "sum", match="max")
w.expect_error(E, tnt.allreduce, np.ones(0 if last else 3, np.int32))
w.expect_error(E, tnt.broadcast, 1, root=1 if last else 0, match="root")
other_call = (tnt.barrier,) if last else (tnt.allreduce, x)
w.expect_error(E, *other_call, match="barrier")
# fusion plans that differ across ranks
specs = [((3, 4), np.float32), ((5,), np.float32)] + ([((2,), np.float32)] if last else [])
w.expect_error(E, ranks.FusedAllreduce, specs, match="fusion plans differ")
w.expect_error(E, ranks.FusedAllreduce, specs[:2], threshold_bytes=0 if last else 64)
# buckets reduced in a different order
f = ranks.FusedAllreduce(specs[:2], threshold_bytes=0)
k = 1 if last else 0
w.expect_error(E, f.reduce_bucket, k, [np.ones(f.specs[k][0], np.float32)], match="bucket")
# and the engine still works, without a rebuild
name = ranks.engine_info()["segment_name"]
assert (tnt.allreduce(x) == p).all()
assert ranks.engine_info()["segment_name"] == name
w.say("MISMATCH", r)
""",
        env={"TNT_RANKS_PER_NODE": per_node, **transport_env(transport)},
    )
    assert result.stdout.count("MISMATCH") == n, result.stdout


def test_without_mpi_thread_multiple_the_calling_thread_drives_the_transport() -> None:
    """mpi4py can be told to initialise MPI with less thread support; nothing may change."""
    result = run(
        3,
        """
from mpi4py import MPI
assert MPI.Query_thread() == MPI.THREAD_SERIALIZED
w.rebuild_with(TNT_SHM_SEGMENT_BYTES="4096")
checks = w.matrix([0, 1001], names=["float32", "int64"], salt="serialized")
assert tnt.broadcast("x" * 10000 if r == 2 else None, root=2) == "x" * 10000
w.say("SERIALIZED", r, ranks.engine_info()["num_nodes"], checks)
""",
        env={"MPI4PY_RC_THREAD_LEVEL": "serialized", "TNT_RANKS_PER_NODE": "2"},
    )
    assert result.stdout.count("SERIALIZED") == 3, result.stdout

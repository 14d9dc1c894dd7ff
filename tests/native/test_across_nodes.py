"""Collectives across nodes (pseudo-nodes of k consecutive ranks: the same code as across hosts):
every op and dtype on both paths (the engine's pipelined rounds and MPI_Allreduce), sizes that
cross many rounds, fused buckets, and a node's rank killed mid-collective."""

from __future__ import annotations

import pytest

from tests.support.engine_worlds import kill_mid_collective, run

# (its tests kill ranks on purpose: what they leave in /dev/shm is removed after each)
pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("killed_worlds_swept")]


@pytest.mark.parametrize(
    ("n", "per_node"), [(2, "1"), (4, "2"), (3, "1"), (6, "2")], ids=["2x1", "2x2", "3x1", "3x2"]
)
def test_every_op_and_dtype_on_both_paths_matches_numpy(n: int, per_node: str) -> None:
    result = run(
        n,
        f"""
nodes = p // {per_node}
# the engine's path with a tiny segment: 20_000 float32 take 40 pipelined rounds
w.rebuild_with(TNT_ALLREDUCE_PATH="engine", TNT_SHM_SEGMENT_BYTES="4096")
assert ranks.engine_info()["num_nodes"] == nodes
checks = w.matrix([1, 1001, 20_000], salt="engine")
assert w.fused(None, count=20) > 1
# the default segment: rounds of 1 MiB, the last one partial
w.rebuild_with(TNT_SHM_SEGMENT_BYTES=None)
checks += w.matrix([700_001], names=["float32", "bfloat16"], ops=["sum", "average"])
# MPI's path: small calls carry their check in one message, larger ones beside it
w.rebuild_with(TNT_ALLREDUCE_PATH="mpi")
checks += w.matrix([1, 1001, 20_000], salt="mpi")
assert w.fused(None, count=20) > 1
w.rebuild_with(TNT_ALLREDUCE_PATH=None)
w.say("ACROSS", r, checks)
""",
        env={"TNT_RANKS_PER_NODE": per_node},
        timeout=300,
    )
    assert result.stdout.count("ACROSS") == n, result.stdout + result.stderr


def test_calls_that_differ_across_nodes_raise_on_every_rank_on_both_paths() -> None:
    """3 ranks as 2+1: the lone rank's node differs, at a size of many rounds."""
    result = run(
        3,
        """
E = ranks.CollectiveMismatchError
alone = r == 2
for path in ("engine", "mpi"):
    w.rebuild_with(TNT_ALLREDUCE_PATH=path, TNT_SHM_SEGMENT_BYTES="4096")
    for n in (10, 300_000):   # one round / the check in the blob; many rounds / beside the data
        w.expect_error(E, tnt.allreduce, np.ones(n + alone, np.float32), match=str(n))
        w.expect_error(E, tnt.allreduce, np.ones(n, np.float64 if alone else np.float32),
                       match="another")
        assert (tnt.allreduce(np.ones(n, np.float32)) == p).all()   # and then it works
w.say("DIFFER", r)
""",
        env={"TNT_RANKS_PER_NODE": "2"},
    )
    assert result.stdout.count("DIFFER") == 3, result.stdout + result.stderr


@pytest.mark.parametrize("n", [4, 5], ids=["4x1", "5x1"])
def test_parts_cross_by_halving_on_four_nodes_and_around_a_ring_on_five(n: int) -> None:
    """Small parts: recursive doubling (on 5 nodes one folds in first and gets the result last);
    large ones: recursive halving and doubling on 4 nodes, a ring of all 5. Every rank gets the
    same bits."""
    result = run(
        n,
        f"""
w.rebuild_with(TNT_ALLREDUCE_PATH="engine")
assert ranks.engine_info()["num_nodes"] == {n}
checks = w.matrix([1, 1001, 15_000, 300_001], names=["float32", "float64", "bfloat16"],
                  ops=["sum", "average", "max"])
w.say("NODES", r, checks)
""",
        env={"TNT_RANKS_PER_NODE": "1"},
        timeout=300,
    )
    assert result.stdout.count("NODES") == n, result.stdout + result.stderr


@pytest.mark.slow
def test_thirty_three_nodes_fold_one_into_the_halving() -> None:
    """From 32 nodes on, a part crosses by halving also where the nodes are no power of two: the
    one beyond hands its part to a partner and gets the result last."""
    result = run(
        33,
        """
w.rebuild_with(TNT_ALLREDUCE_PATH="engine")
checks = w.matrix([1001, 300_001], names=["float32", "bfloat16"], ops=["sum", "average"])
w.say("NODES", r, checks)
""",
        env={"TNT_RANKS_PER_NODE": "1", "TNT_COLLECTIVE_TIMEOUT": "120"},
        timeout=300,
    )
    assert result.stdout.count("NODES") == 33, result.stdout + result.stderr


@pytest.mark.parametrize("n", [2, 3, 4], ids=["2x1", "3x1", "4x1"])
def test_parts_of_different_sizes_across_nodes_raise_and_the_next_call_works(n: int) -> None:
    """Every pairing of a part that travels with its check, one in fragments of its own and a
    whole round (2 nodes: the receiver matches what the other's check announces; 3 and 4: the
    ring or the halving does not start)."""
    result = run(
        n,
        """
E = ranks.CollectiveMismatchError
w.rebuild_with(TNT_ALLREDUCE_PATH="engine")
sizes = [10, 15_000, 16_000, 100_000, 262_144]   # float32: 40 B .. 1 MiB
for mine in sizes:
    for theirs in sizes:
        if theirs != mine:
            size = theirs if r == p - 1 else mine
            w.expect_error(E, tnt.allreduce, np.ones(size, np.float32), match="another node")
    assert (tnt.allreduce(np.ones(mine, np.float32)) == p).all()
w.say("SIZES", r)
""",
        env={"TNT_RANKS_PER_NODE": "1"},
    )
    assert result.stdout.count("SIZES") == n, result.stdout + result.stderr


@pytest.mark.parametrize("path", ["engine", "mpi"])
def test_a_rank_killed_on_another_node_is_named_on_every_survivor(path: str, tmp_path) -> None:
    """2 nodes x 2 ranks: rank 3 dies inside a collective; its node-mate sees it die and tells
    the other node, whose ranks raise naming it too (well within the collective timeout)."""
    kill_mid_collective(
        4, tmp_path, {"TNT_RANKS_PER_NODE": "2", "TNT_ALLREDUCE_PATH": path}, timeout=16
    )

"""An allreduce in two halves (Engine.start_allreduce, then finish_allreduce in the same order),
which across nodes may post its exchange at the start so that it travels while the rank computes:
the same results as allreduce whether posted or carried out whole, a choice measured per call
site, and failures that raise as allreduce's do. Pseudo-nodes of one host here; real hosts in
test_engine_across_hosts.py."""

from __future__ import annotations

import pytest

from tests.support.engine_worlds import ENV, PRELUDE
from tests.support.mpiworld import run_mpi

pytestmark = pytest.mark.mpi

WORLDS = pytest.mark.parametrize(
    ("n", "per_node"), [(2, "1"), (3, "1"), (4, "2")], ids=["2x1", "3x1", "2x2"]
)


@WORLDS
def test_halves_match_numpy_posted_or_whole(n: int, per_node: str) -> None:
    """Up to 1 MB (one rank per node) or 64 KB (more) a call may be posted, in fragments of 60 KiB;
    larger ones always finish whole. Probes alternate batches posted and whole."""
    result = run_mpi(
        n,
        PRELUDE
        + """
assert ranks.engine_info()["overlaps_exchanges"]
sizes = [1, 1001, 40_000, 300_001]   # 40_000 x 8 bytes: 6 fragments; 300_001: never posted
w.rebuild_with(TNT_ALLREDUCE_PATH="mpi")   # every call that may be posted is
checks = w.halves(sizes)
# halves of 32 KiB: 15_000 float32 span two rounds, which nodes of several ranks post as
# MPI_Iallreduce where they swap 1001
w.rebuild_with(TNT_SHM_SEGMENT_BYTES="65536")
checks += w.halves([1001, 15_000], names=["float32", "bfloat16"], ops=["sum", "average"])
w.rebuild_with(TNT_ALLREDUCE_PATH=None, TNT_SHM_SEGMENT_BYTES=None)   # warm-up, then probes
checks += w.halves(sizes, names=["float32", "bfloat16", "int64"], ops=["sum", "average"], repeats=4)
# each batch of calls started together is posted or not as a whole, chosen by its first call that
# may be posted; a batch of calls too large for posting never is
checks += w.halves([10_000, 300_001], names=["float32"], ops=["sum"], repeats=12)
checks += w.halves([300_001], names=["float32"], ops=["sum"], repeats=3)
(decided,) = [s for s in ranks.current_engine().posting_sites if s["count"] in (10_000, 300_001)]
assert decided["count"] == 10_000 and decided["calls"] == 12, decided
assert decided["decisions"] == 1 and decided["posted_s"] > 0 and decided["whole_s"] > 0, decided
w.say("CHECKS", r, checks)
""",
        env={**ENV, "TNT_RANKS_PER_NODE": per_node},
    )
    assert result.stdout.count("CHECKS") == n, result.stdout


def test_one_node_never_posts() -> None:
    result = run_mpi(
        2,
        PRELUDE
        + """
assert not ranks.engine_info()["overlaps_exchanges"]
checks = w.halves([1001], names=["float32"], ops=["sum"], repeats=12)
assert ranks.current_engine().posting_sites == []
w.say("CHECKS", r, checks)
""",
        env=ENV,
    )
    assert result.stdout.count("CHECKS") == 2, result.stdout


@pytest.mark.parametrize("path", ["mpi", "engine"])
def test_halves_finished_out_of_order_or_with_other_sizes_raise_without_a_hang(path: str) -> None:
    """Out of order: ValueError, and the calls can still finish in order. Other sizes than the
    start's: ValueError, and the engine is rebuilt at the next call (a posted exchange may still
    write into what it was given)."""
    result = run_mpi(
        2,
        PRELUDE
        + f"""
w.rebuild_with(TNT_ALLREDUCE_PATH={path!r})
e = ranks.current_engine()
f32, add = ranks.native_core().DTYPES["float32"], ranks.native_core().OPS["sum"]
x, y = np.ones(10, np.float32), np.ones(20, np.float32)
a, b = e.start_allreduce([x], f32, add), e.start_allreduce([y], f32, add)
w.expect_error(ValueError, e.finish_allreduce, b, [y], [y.copy()], f32, match="in the order")
out = np.empty_like(x)
e.finish_allreduce(a, [x], [out], f32)
np.testing.assert_array_equal(out, x * p)
e.finish_allreduce(b, [y], [out2 := np.empty_like(y)], f32)
np.testing.assert_array_equal(out2, y * p)
c = e.start_allreduce([x], f32, add)
w.expect_error(ValueError, e.finish_allreduce, c, [y], [y.copy()], f32, match="differ in size")
np.testing.assert_array_equal(tnt.allreduce(x), x * p)   # a new engine
assert ranks.current_engine() is not e
w.say("OK", r)
""",
        env={**ENV, "TNT_RANKS_PER_NODE": "1"},
    )
    assert result.stdout.count("OK") == 2, result.stdout


@pytest.mark.parametrize("counts", [(1000, 40_000), (40_000, 50_000)], ids=["4K-160K", "160K-200K"])
def test_ranks_that_start_different_calls_raise_a_mismatch_and_recover(counts) -> None:
    """Sizes with a different number of messages, or first messages of the same size: the check
    in the first one tells both ranks."""
    result = run_mpi(
        2,
        PRELUDE
        + f"""
w.rebuild_with(TNT_ALLREDUCE_PATH="mpi")
e = ranks.current_engine()
f32, add = ranks.native_core().DTYPES["float32"], ranks.native_core().OPS["sum"]
x = np.ones({counts}[r], np.float32)
t = e.start_allreduce([x], f32, add, bucket=3)
msg = w.expect_error(ranks.CollectiveMismatchError, e.finish_allreduce, t, [x], [x.copy()], f32)
assert "{counts[0]}" in msg and "{counts[1]}" in msg, msg
np.testing.assert_array_equal(tnt.allreduce(np.ones(5, np.float32)), np.full(5, p, np.float32))
w.say("RECOVERED", r)
""",
        env={**ENV, "TNT_RANKS_PER_NODE": "1"},
    )
    assert result.stdout.count("RECOVERED") == 2, result.stdout


def test_a_rank_that_never_starts_is_named_by_the_finish_and_the_next_call_recovers() -> None:
    result = run_mpi(
        2,
        PRELUDE
        + """
import time
w.rebuild_with(TNT_ALLREDUCE_PATH="mpi")
x = np.ones(1000, np.float32)
tnt.allreduce(x)
ranks.set_collective_timeout(1.5)
e = ranks.current_engine()
f32, add = ranks.native_core().DTYPES["float32"], ranks.native_core().OPS["sum"]
t0 = time.monotonic()
if r == 1:
    time.sleep(6)  # far past the other's timeout
    w.expect_error(ranks.CollectiveError, tnt.allreduce, x)
else:
    t = e.start_allreduce([x], f32, add)
    msg = w.expect_error(ranks.CollectiveTimeoutError, e.finish_allreduce, t, [x], [x.copy()], f32)
    assert time.monotonic() - t0 < 5.5, time.monotonic() - t0
    assert "timed out after 1.5 s" in msg and "rank(s) 1 did not" in msg, msg
ranks.set_collective_timeout(20)
np.testing.assert_array_equal(tnt.allreduce(x), x * p)
w.say("RECOVERED", r)
""",
        env={**ENV, "TNT_RANKS_PER_NODE": "1"},
    )
    assert result.stdout.count("RECOVERED") == 2, result.stdout


def test_ranks_of_one_node_that_start_different_calls_raise_on_both_nodes_and_recover() -> None:
    """2 nodes x 2 ranks: a posted call is first summed within each node, so the node whose ranks
    disagree raises at the start; its swap still tells the other node, which raises at the
    finish."""
    result = run_mpi(
        4,
        PRELUDE
        + """
w.rebuild_with(TNT_ALLREDUCE_PATH="mpi")
e = ranks.current_engine()
f32, add = ranks.native_core().DTYPES["float32"], ranks.native_core().OPS["sum"]
x = np.ones(1000 if r == 1 else 1001, np.float32)
if r < 2:
    msg = w.expect_error(ranks.CollectiveMismatchError, e.start_allreduce, [x], f32, add, bucket=3)
    assert "1000" in msg and "1001" in msg, msg
else:
    t = e.start_allreduce([x], f32, add, bucket=3)
    msg = w.expect_error(ranks.CollectiveMismatchError, e.finish_allreduce, t, [x], [x.copy()], f32)
    # (rank 2 swaps with rank 0, whose call is its own but whose node disagrees; rank 3 with 1)
    assert ("its ranks disagree among themselves" if r == 2 else "1000") in msg, msg
np.testing.assert_array_equal(tnt.allreduce(np.ones(5, np.float32)), np.full(5, p, np.float32))
w.say("RECOVERED", r)
""",
        env={**ENV, "TNT_RANKS_PER_NODE": "2"},
    )
    assert result.stdout.count("RECOVERED") == 4, result.stdout

"""Each allreduce call site takes the engine's own path or MPI_Allreduce, whichever measures faster:
both paths give numpy's results, every rank takes the same path at the same call, and ranks that
disagree still raise instead of hanging."""

from __future__ import annotations

import pytest
from test_engine_worlds import run

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize(("n", "per_node"), [(2, "0"), (4, "2")], ids=["2", "2x2"])
def test_both_paths_match_numpy_and_every_rank_follows_the_same_choices(
    n: int, per_node: str
) -> None:
    result = run(
        n,
        """
w.rebuild_with(TNT_ALLREDUCE_PATH="mpi")
checks = w.matrix([0, 1, 1001], salt="mpi")
assert w.fused(None, count=20) > 1
# ranks that disagree raise on every rank, also on MPI's path
last = r == p - 1
w.expect_error(ranks.CollectiveMismatchError, tnt.allreduce,
               np.ones(11 if last else 10, np.float32), match="10")
assert (tnt.allreduce(np.ones(10, np.float32)) == p).all()
if ranks.engine_info()["num_nodes"] == 1:
    # MPI's exchange starts before the node's ranks compare their calls: a rank that called
    # something else still raises on every rank, and the next collective works
    if last:
        w.expect_error(ranks.CollectiveMismatchError, tnt.barrier, match="through MPI")
    else:
        w.expect_error(ranks.CollectiveMismatchError, tnt.allreduce, np.ones(10, np.float32),
                       match="barrier")
    assert (tnt.allreduce(np.ones(10, np.float32)) == p).all()
    tnt.barrier()
    w.say("ONENODE", r)

w.rebuild_with(TNT_ALLREDUCE_PATH=None)   # auto: each site probes both, then decides
x = w.rank_input(r, "float32", (3000,), "auto")
want = w.expected("sum", [w.rank_input(q, "float32", (3000,), "auto") for q in range(p)])
for i in range(220):
    w.assert_close(tnt.allreduce(x), want, f"call {i}")
site = [s for s in ranks.engine_info()["path_sites"] if s["count"] == 3000]
# the first decision (after 2 + 10 calls) is probed again 200 calls later, however clear it was
assert len(site) == 1 and site[0]["calls"] == 220 and site[0]["decisions"] == 2, site
assert site[0]["engine_s"] > 0 and site[0]["mpi_s"] > 0, site
# the agreed times are the same on every rank, and so is the path taken
mine = np.array([site[0]["engine_s"], site[0]["mpi_s"], site[0]["path"] == "mpi"], np.float64)
assert (tnt.allreduce(mine, "min") == tnt.allreduce(mine, "max")).all(), mine
checks += w.matrix([1001], names=["float16", "int64"], ops=["average", "max"], salt="auto")
w.say("PATHS", r, checks, site[0]["path"])
""",
        env={"TNT_RANKS_PER_NODE": per_node},
    )
    assert result.stdout.count("PATHS") == n, result.stdout + result.stderr
    assert result.stdout.count("ONENODE") == (n if per_node == "0" else 0), result.stdout


def test_ranks_given_different_paths_all_raise_a_clear_error() -> None:
    result = run(
        2,
        """
import os
os.environ["TNT_ALLREDUCE_PATH"] = "mpi" if r == 0 else "engine"
w.expect_error(ranks.CollectiveError, tnt.barrier, match="TNT_ALLREDUCE_PATH")
os.environ["TNT_ALLREDUCE_PATH"] = "fastest"
w.expect_error(ValueError, tnt.barrier, match="auto, engine or mpi")
w.say("REFUSED", r)
""",
    )
    assert result.stdout.count("REFUSED") == 2, result.stdout + result.stderr

"""Each allreduce call site takes the engine's own path or MPI_Allreduce, whichever measures faster:
the schedule (fed times of our choosing) checks a first or changed choice soon and probes by the
loss otherwise; both paths give numpy's results, every rank takes the same path at the same call,
and ranks that disagree still raise instead of hanging."""

from __future__ import annotations

import math

import pytest

from tests.support.engine_worlds import run
from tnt_notebook import _native

SITE = (3000, 0, 0, -1)  # (count, dtype, op, bucket)


def calls_to_decision(choice: _native.PathChoice, times: dict[str, list[float]]) -> int:
    """Calls SITE until a probe window ends, giving its timed calls of each path the next of
    `times[path]`, and decides on the window's medians (as the engine does, on one rank). Returns
    how many calls it took; calls between windows take the path chosen before."""
    feed = {path: iter(seconds) for path, seconds in times.items()}
    before = choice.sites[0]["path"] if choice.sites else "engine"
    for calls in range(1, 100_000):
        path, timed = choice.next(SITE)
        if not timed:
            assert path == before, (calls, path)
        elif (medians := choice.record(SITE, path, next(feed[path]))) is not None:
            choice.decide(SITE, *medians)
            return calls
    raise AssertionError("no decision")


def interval(slow: float, fast: float) -> int:
    """Calls to the next window: 3 samples of the slower path cost 1 % of the site's time."""
    return min(max(math.ceil(3 * (slow / fast - 1) / 0.01), 200), 20_000)


def test_a_first_or_changed_choice_is_checked_soon_on_both_windows_samples() -> None:
    choice = _native.PathChoice()
    # 2 warm-up calls, then 5 of each; the first window is misled (3 of MPI's 5 calls look fast)
    assert calls_to_decision(choice, {"mpi": [1, 1, 1, 9, 9], "engine": [2] * 5}) == 12
    assert choice.sites[0]["path"] == "mpi"
    # checked 20 calls later by 3 of each, decided on all 8 of each (medians 9 and 2, not 9 and 3)
    assert calls_to_decision(choice, {"mpi": [9] * 3, "engine": [3] * 3}) == 20 + 6
    (site,) = choice.sites
    assert (site["path"], site["engine_s"], site["mpi_s"], site["decisions"]) == ("engine", 2, 9, 2)
    # a check is not checked again: the next window comes after the usual interval, and changes
    # the path on its 3 samples of each alone...
    assert calls_to_decision(choice, {"mpi": [1] * 3, "engine": [2] * 3}) == interval(9, 2) + 6
    assert choice.sites[0]["path"] == "mpi"
    # ...so that change is checked 20 calls later, on both windows' samples (MPI's median 3, not 5)
    assert calls_to_decision(choice, {"mpi": [5] * 3, "engine": [2] * 3}) == 20 + 6
    assert (choice.sites[0]["path"], choice.sites[0]["mpi_s"]) == ("engine", 3)
    # windows that keep the path are not checked
    assert calls_to_decision(choice, {"mpi": [5] * 3, "engine": [2] * 3}) == interval(3, 2) + 6
    assert calls_to_decision(choice, {"mpi": [5] * 3, "engine": [2] * 3}) == interval(5, 2) + 6
    assert choice.sites[0]["decisions"] == 6


@pytest.mark.parametrize("policy", ["engine", "mpi"])
def test_a_set_path_is_always_taken_and_never_timed(policy: str) -> None:
    choice = _native.PathChoice(policy)
    assert {choice.next(SITE) for _ in range(300)} == {(policy, False)}


@pytest.mark.mpi
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
def the_site():
    return [s for s in ranks.engine_info()["path_sites"] if s["count"] == 3000]
for i in range(220):
    w.assert_close(tnt.allreduce(x), want, f"call {i}")
    if i == 37:  # the first decision (after 2 + 10 calls) is checked 20 calls later, however
        checked = the_site()  # clear it was: after 32 + 6 calls
site = the_site()
assert len(checked) == 1 and checked[0]["decisions"] == 2, checked
# and the next window comes at least 200 calls after that
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


@pytest.mark.mpi
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

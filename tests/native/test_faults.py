"""Failures never hang: timeouts name the missing rank, dead or departed ranks are detected, Ctrl-C
interrupts a waiting rank, and the next collective rebuilds the engine."""

from __future__ import annotations

import pytest

from tests.support.engine_worlds import PRELUDE, kill_mid_collective, lines
from tests.support.mpiworld import (
    GASPI_ENV,
    requires_gaspi,
    run_mpi,
    transport_env,
)

# (its tests kill ranks on purpose: what they leave in /dev/shm is removed after each)
pytestmark = [pytest.mark.mpi, pytest.mark.usefixtures("killed_worlds_swept")]


def gaspi(*values: object) -> object:
    """A case whose step between pseudo-nodes goes over GASPI (skipped in builds without it)."""
    return pytest.param(*values, "gaspi", marks=requires_gaspi)


@pytest.mark.parametrize(
    ("n", "per_node", "transport"),
    [(2, "0", "mpi"), (3, "0", "mpi"), (2, "1", "mpi"), (4, "2", "mpi")]
    + [gaspi(2, "1"), gaspi(4, "2")],
    ids=["2", "3", "1x2", "2x2", "1x2-gaspi", "2x2-gaspi"],
)
def test_a_rank_that_never_arrives_is_named_by_the_timeout_and_the_next_call_recovers(
    n: int, per_node: str, transport: str
) -> None:
    """Also across pseudo-nodes: the abort reaches the other nodes as a message. A rebuilt engine
    over GASPI has a new segment (the given-up exchange may still write into the old one)."""
    result = run_mpi(
        n,
        PRELUDE
        + """
import time
x = np.arange(1000, dtype=np.float32)
tnt.allreduce(x)
ranks.set_collective_timeout(1.5)
first = ranks.engine_info()["segment_name"]
t0 = time.monotonic()
if r == 1:
    time.sleep(6)  # far past the others' timeout, even on a busy machine
    w.expect_error(ranks.CollectiveAbortedError, tnt.allreduce, x, match="did not")
else:
    msg = w.expect_error(ranks.CollectiveError, tnt.allreduce, x)
    assert time.monotonic() - t0 < 5.5, time.monotonic() - t0
    if r == 0:   # on the late rank's node (or its only cross-node peer): named
        assert "timed out after 1.5 s" in msg and "rank(s) 1 did not" in msg, msg
ranks.set_collective_timeout(20)
np.testing.assert_array_equal(tnt.allreduce(x), x * p)   # rebuilds the engine on every rank
assert ranks.engine_info()["segment_name"] != first
tnt.barrier()
w.say("RECOVERED", r)
""",
        env={"TNT_RANKS_PER_NODE": per_node, **transport_env(transport)},
    )
    assert len(lines(result.stdout, "RECOVERED")) == n, result.stdout + result.stderr


@pytest.mark.parametrize("transport", ["mpi", pytest.param("gaspi", marks=requires_gaspi)])
@pytest.mark.parametrize("size", [1000, 3_000_000], ids=["one-round", "rounds"])
def test_ranks_waiting_on_a_local_rank_that_waits_on_another_node_name_that_node(
    size: int, transport: str
) -> None:
    """Nodes {0, 1} and {2} (uneven: rank 0 alone exchanges with the other node): rank 1, waiting
    on rank 0, must not name rank 0, which is there and waiting on the late rank 2."""
    result = run_mpi(
        3,
        PRELUDE
        + f"""
import time
x = np.arange({size}, dtype=np.float32)
tnt.allreduce(x)
ranks.set_collective_timeout(1.5)
if r == 2:
    time.sleep(6)
    w.expect_error(ranks.CollectiveAbortedError, tnt.allreduce, x)
else:
    msg = w.expect_error(ranks.CollectiveError, tnt.allreduce, x)  # rank 1's: rank 0's abort
    assert "timed out after 1.5 s: the exchange with rank(s) 2 did not complete" in msg, msg
ranks.set_collective_timeout(20)
np.testing.assert_array_equal(tnt.allreduce(x), x * p)
w.say("RECOVERED", r)
""",
        env={"TNT_RANKS_PER_NODE": "2", **transport_env(transport)},
    )
    assert len(lines(result.stdout, "RECOVERED")) == 3, result.stdout + result.stderr


@pytest.mark.parametrize(
    ("per_node", "transport"),
    [("0", "mpi"), ("1", "mpi"), gaspi("1")],
    ids=["one-node", "two-nodes", "two-nodes-gaspi"],
)
def test_ctrl_c_interrupts_a_waiting_rank_and_the_peers_raise_then_recover(
    per_node: str, transport: str
) -> None:
    result = run_mpi(
        2,
        PRELUDE
        + """
import signal, threading, time
x = np.ones(100, np.float64)
tnt.allreduce(x)
if r == 0:
    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    t0 = time.monotonic()
    try:
        tnt.allreduce(x)
        raise AssertionError("not interrupted")
    except KeyboardInterrupt:
        w.say("INTERRUPTED", round(time.monotonic() - t0, 2))
    assert time.monotonic() - t0 < 4
else:
    time.sleep(5)
    w.expect_error(ranks.CollectiveAbortedError, tnt.allreduce, x, match="rank 0 was interrupted")
np.testing.assert_array_equal(tnt.allreduce(x), x * p)
w.say("RECOVERED", r)
""",
        env={
            "TNT_COLLECTIVE_TIMEOUT": "20",
            "TNT_RANKS_PER_NODE": per_node,
            **transport_env(transport),
        },
    )
    assert len(lines(result.stdout, "INTERRUPTED")) == 1, result.stdout + result.stderr
    assert len(lines(result.stdout, "RECOVERED")) == 2, result.stdout + result.stderr


@pytest.mark.parametrize("per_node", ["0", "1"], ids=["one-node", "three-nodes"])
def test_a_bootstrap_that_an_interrupt_or_a_timeout_left_is_resumed_by_the_next_collective(
    per_node: str,
) -> None:
    """Rank 1 comes late to the first collective: rank 0 is interrupted in the engine's bootstrap,
    rank 2 times out there. Their next collective resumes the bootstrap where it stopped (a new one
    would start a second MPI_Comm_idup that rank 1's first would be matched with)."""
    result = run_mpi(
        3,
        PRELUDE
        + """
import signal, threading, time
t0 = time.monotonic()
if r == 0:
    threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        tnt.barrier()
        raise AssertionError("not interrupted")
    except KeyboardInterrupt:
        w.say("SUSPENDED", r, "interrupted", round(time.monotonic() - t0, 2))
elif r == 2:
    ranks.set_collective_timeout(1.0)
    msg = w.expect_error(ranks.CollectiveTimeoutError, tnt.barrier, match="bootstrap timed out")
    assert "resumes" in msg, msg
    w.say("SUSPENDED", r, "timed out", round(time.monotonic() - t0, 2))
    ranks.set_collective_timeout(20)
else:
    time.sleep(4)
if r != 1:
    assert ranks._engine.bootstrapping
tnt.barrier()
np.testing.assert_array_equal(tnt.allreduce(np.arange(5.0)), np.arange(5.0) * p)
assert ranks.engine_info()["num_nodes"] == (3 if os.environ["TNT_RANKS_PER_NODE"] == "1" else 1)
w.say("RESUMED", r)
""",
        env={"TNT_COLLECTIVE_TIMEOUT": "20", "TNT_RANKS_PER_NODE": per_node},
        timeout=90,
    )
    suspended = lines(result.stdout, "SUSPENDED")
    assert len(suspended) == 2, result.stdout + result.stderr
    assert all(float(line.split()[-1]) < 3.5 for line in suspended), suspended
    assert len(lines(result.stdout, "RESUMED")) == 3, result.stdout + result.stderr


@pytest.mark.parametrize("n", [2, 3])
def test_survivors_name_a_rank_killed_mid_collective(n: int, tmp_path) -> None:
    kill_mid_collective(n, tmp_path, {}, timeout=20)


@requires_gaspi
def test_survivors_name_a_rank_killed_mid_collective_over_gaspi(tmp_path) -> None:
    """3 pseudo-nodes of one rank: the ring's liveness check names the dead rank."""
    kill_mid_collective(
        3, tmp_path, GASPI_ENV, timeout=20, named=r"\(pid \d+\) died during the inter-node exchange"
    )


def test_an_unhandled_exception_in_one_rank_makes_the_peers_raise_not_hang() -> None:
    result = run_mpi(
        3,
        PRELUDE
        + """
import signal, time
signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # see above
x = np.ones(10)
tnt.allreduce(x)
if r == 1:
    raise ValueError("boom")
t0 = time.monotonic()
try:
    tnt.allreduce(x)
except ranks.CollectiveError as e:
    w.say("PEER", r, round(time.monotonic() - t0, 2), e)
    raise
""",
        env={"TNT_COLLECTIVE_TIMEOUT": "20"},
        mpi_args=("-disable-auto-cleanup",),
        check=False,
        timeout=60,
    )
    assert result.returncode != 0
    peers = lines(result.stdout, "PEER")
    assert len(peers) == 2, result.stdout + result.stderr
    for line in peers:
        assert "rank 1 (pid" in line and float(line.split()[2]) < 5, line


def test_the_segment_is_unlinked_as_soon_as_every_rank_has_mapped_it() -> None:
    result = run_mpi(
        3,
        PRELUDE
        + """
info = ranks.engine_info()
assert not os.path.exists("/dev/shm" + info["segment_name"]), info
assert not [f for f in os.listdir("/dev/shm") if info["segment_name"][1:] in f]
w.say("UNLINKED", r)
""",
    )
    assert len(lines(result.stdout, "UNLINKED")) == 3


@pytest.mark.parametrize("per_node", ["0", "1"], ids=["one-node", "two-nodes"])
def test_ranks_configured_with_different_segment_sizes_all_raise_promptly(per_node: str) -> None:
    """Also across nodes, where a round's part must fit what the other node receives."""
    result = run_mpi(
        2,
        PRELUDE
        + """
import time
if r == 1:
    os.environ["TNT_SHM_SEGMENT_BYTES"] = "65536"
t0 = time.monotonic()
msg = w.expect_error(ranks.CollectiveError, tnt.barrier, match="different shared-memory slot")
assert time.monotonic() - t0 < 5
w.say("CONFIG", r, msg)
""",
        env={"TNT_COLLECTIVE_TIMEOUT": "20", "TNT_RANKS_PER_NODE": per_node},
    )
    assert result.stdout.count("CONFIG") == 2, result.stdout + result.stderr
    assert "TNT_SHM_SEGMENT_BYTES" in result.stdout

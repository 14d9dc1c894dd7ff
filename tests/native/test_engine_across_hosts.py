"""The engine across real test hosts (network namespaces with their own hostname, shared memory and
sshd; ranks started by mpiexec over ssh): every op and dtype on both paths and in two halves, the
pipelined rounds, and the link's transport between the hosts (TCP), which pseudo-nodes of one host
never use."""

from __future__ import annotations

import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.support.engine_worlds import PRELUDE
from tests.support.mpiworld import run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.hosts]


@pytest.mark.parametrize(("hosts", "per_node"), [(2, 1), (2, 2), (3, 1)], ids=["2x1", "2x2", "3x1"])
def test_every_op_and_dtype_on_both_paths_across_hosts(test_hosts, tmp_path, hosts, per_node):
    hostfile = test_hosts.write_hostfile(test_hosts.hosts[:hosts], tmp_path / "hosts")
    result = run_mpi(
        hosts * per_node,
        PRELUDE
        + f"""
import socket
info = ranks.engine_info()
assert info["num_nodes"] == {hosts} and info["local_size"] == {per_node}, info
w.rebuild_with(TNT_ALLREDUCE_PATH="engine", TNT_SHM_SEGMENT_BYTES="65536")
checks = w.matrix([1, 1001, 100_000], salt="engine")   # 100_000 float32: 13 pipelined rounds
assert w.fused(None, count=20) > 1
# the default segment: parts of 0.5-1 MiB cross in fragments (2 hosts) or around a ring (3)
w.rebuild_with(TNT_SHM_SEGMENT_BYTES=None)
checks += w.matrix([300_001], names=["float32", "bfloat16"], ops=["sum", "average"])
# the last host calls with parts of other sizes (with its check, in fragments, a whole round)
last_host = r >= p - {per_node}
for mine, theirs in [(10, 40_000), (40_000, 300_000), (300_000, 10)]:
    w.expect_error(ranks.CollectiveMismatchError, tnt.allreduce,
                   np.ones(theirs if last_host else mine, np.float32), match="another node")
assert (tnt.allreduce(np.ones(40_000, np.float32)) == p).all()
w.rebuild_with(TNT_ALLREDUCE_PATH="mpi")
checks += w.matrix([1, 1001, 100_000], names=["float32", "bfloat16", "int64"], salt="mpi")
# in two halves, posted (up to 64 KB with 2 ranks per host, 1 MB with 1; on 2 hosts each rank
# swaps its part of its host's sum in messages, on 3 fragments of MPI_Iallreduce go) or whole
checks += w.halves([1001, 15_000, 100_000], names=["float32", "bfloat16"], ops=["sum", "average"])
w.rebuild_with(TNT_ALLREDUCE_PATH=None)
checks += w.halves([15_000], names=["float32"], ops=["sum"], repeats=12)
(site,) = [s for s in ranks.current_engine().posting_sites if s["calls"] == 12]
assert site["decisions"] == 1 and site["posted_s"] > 0 and site["whole_s"] > 0, site
w.say("HOSTS", r, socket.gethostname(), checks)
""",
        env={**test_hosts.env, "TNT_COLLECTIVE_TIMEOUT": "30"},
        mpi_args=("-f", str(hostfile), "-ppn", str(per_node)),
        timeout=300,
    )
    lines = [x for x in result.stdout.splitlines() if x.startswith("HOSTS")]
    assert len(lines) == hosts * per_node, result.stdout + result.stderr
    assert len({x.split()[2] for x in lines}) == hosts, lines  # each host's own name


CUT_OFF = """
import time
from pathlib import Path
flags = Path(os.environ["FLAGS"])
x = np.ones(1000, np.float32)
tnt.allreduce(x)   # (every endpoint is up)
(flags / f"ready{r}").touch()
while not (flags / "cut").exists():
    time.sleep(0.02)
time.sleep(float(os.environ["IDLE_AFTER_CUT"]))
t0 = time.monotonic()
try:
    tnt.allreduce(x)
    outcome = "NO ERROR"
except ranks.CollectiveError as e:
    outcome = f"{type(e).__name__} {time.monotonic() - t0:.1f} {e}"
(flags / f"outcome{r}").write_text(outcome)
while not (flags / "up").exists():
    time.sleep(0.02)
os._exit(0)   # (MPI cannot finalize a world whose exchange it gave up)
"""


def wait_for(paths, world, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        if world.done() or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# UCX gives up on a silent host's idle connections (TCP keepalive) after 1 s plus 2 probes 1 s
# apart where keepalive is on: mid-collective the user turned it on, which must not crash a rank;
# after 14 s idle it is the product's default (off), without which the collective would crash.
CUTS = {
    "mid-collective": {"IDLE_AFTER_CUT": "0", "UCX_TCP_KEEPIDLE": "1s"},
    "while-idle": {"IDLE_AFTER_CUT": "14"},
}


@pytest.mark.parametrize(
    ("when", "path"),
    [
        ("mid-collective", "engine"),
        ("mid-collective", "mpi"),
        ("while-idle", "engine"),
        pytest.param("while-idle", "mpi", marks=pytest.mark.slow),  # (the same keepalive default)
    ],
    ids=["mid-collective-engine", "mid-collective-mpi", "while-idle-engine", "while-idle-mpi"],
)
def test_a_host_cut_off_fails_the_collective_on_both_hosts_and_no_rank_dies(
    test_hosts, tmp_path, path, when
):
    """2 hosts x 2 ranks; h2 is cut off. Mid-collective with UCX's keepalive on, the connections
    between the hosts that carry nothing (rank 0 exchanges with rank 2, not 3) fail before the
    collective times out: the ranks that give up tell the other host through datagrams, not MPI
    (MPICH crashes the sender of an MPI_Isend to an endpoint that failed). Cut off while idle, every
    connection would fail before the next collective, which would crash: ranks run with keepalive
    off (transport.MPI_ENV_DEFAULTS)."""
    hostfile = test_hosts.write_hostfile(test_hosts.hosts[:2], tmp_path / "hosts")
    flags = Path(tempfile.mkdtemp(dir=test_hosts.shared_dir))  # (each host has a /tmp of its own)
    env = {
        **test_hosts.env,
        "FLAGS": str(flags),
        "TNT_COLLECTIVE_TIMEOUT": "6",
        "TNT_ALLREDUCE_PATH": path,
        "UCX_TCP_KEEPINTVL": "1s",
        "UCX_TCP_KEEPCNT": "2",
        **CUTS[when],
    }
    cut = test_hosts.hosts[1]
    try:
        with ThreadPoolExecutor(1) as pool:
            world = pool.submit(
                run_mpi, 4, PRELUDE + CUT_OFF, env=env,
                mpi_args=("-f", str(hostfile), "-ppn", "2"), timeout=120,
            )  # fmt: skip
            try:
                assert wait_for([flags / f"ready{r}" for r in range(4)], world, 60), "not ready"
                cut.link_down()
                (flags / "cut").touch()
                reported = wait_for([flags / f"outcome{r}" for r in range(4)], world, 45)
            finally:
                cut.link_up()
                (flags / "up").touch()
            result = world.result()  # (fails the test if a rank died: mpiexec exits nonzero)
        assert reported, result.stdout + result.stderr
        for r in range(4):  # (a node-mate that timed out first ends a rank's wait with it)
            outcome = (flags / f"outcome{r}").read_text()
            name, seconds = outcome.split()[:2]
            assert name in ("CollectiveTimeoutError", "CollectiveAbortedError"), outcome
            assert "timed out after 6 s" in outcome and float(seconds) < 6 + 3, outcome
    finally:
        shutil.rmtree(flags)
        for h in test_hosts.hosts[:2]:  # (what the world's os._exit left)
            h.sweep_mpi_files()

"""The engine across real test hosts (network namespaces with their own hostname, shared memory and
sshd; ranks started by mpiexec over ssh): every op and dtype on both paths, the pipelined rounds,
and the link's transport between the hosts (TCP), which pseudo-nodes of one host never use."""

from __future__ import annotations

import pytest
from mpiworld import run_mpi
from test_engine_worlds import PRELUDE

pytestmark = [pytest.mark.mpi, pytest.mark.hosts]


@pytest.mark.parametrize(("hosts", "per_node"), [(2, 2), (3, 1)], ids=["2x2", "3x1"])
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
w.say("HOSTS", r, socket.gethostname(), checks)
""",
        env={**test_hosts.env, "TNT_COLLECTIVE_TIMEOUT": "30"},
        mpi_args=("-f", str(hostfile), "-ppn", str(per_node)),
        timeout=300,
    )
    lines = [x for x in result.stdout.splitlines() if x.startswith("HOSTS")]
    assert len(lines) == hosts * per_node, result.stdout + result.stderr
    assert len({x.split()[2] for x in lines}) == hosts, lines  # each host's own name

"""The GASPI transport across real test hosts (network namespaces with their own hostname, shared
memory and sshd; ranks started by mpiexec over ssh), 3 hosts x 1 rank in one world: the rank API
and every op and dtype with GPI-2 between the hosts, then a rank killed mid-collective, which no
survivor shares a host with: its neighbours' writes to it fail and both name it. (2 hosts x 2
ranks: tests/magics/test_gaspi_cluster_across_hosts.py, as a cluster.)"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

from tests.support.engine_worlds import kill_mid_collective
from tests.support.mpiworld import requires_gaspi, transport_env
from tests.support.rank_api_checks import API_CHECKS

pytestmark = [pytest.mark.mpi, pytest.mark.hosts, requires_gaspi]


def test_three_hosts_every_op_and_dtype_then_a_killed_rank_is_named_by_both_survivors(test_hosts):
    d = Path(tempfile.mkdtemp(prefix="gaspi-", dir=test_hosts.shared_dir))  # seen by every rank
    hostfile = test_hosts.write_hostfile(test_hosts.hosts, d / "hosts")
    before = (
        "import ml_dtypes\n"
        + API_CHECKS
        + """
import socket
info = ranks.engine_info()
assert (info["transport"], info["num_nodes"], info["local_size"]) == ("gaspi", 3, 1), info
checks = w.matrix([1, 1001, 300_001])
assert checks == 72 and w.fused(None, count=20) > 1
w.say("CHECKED", r, socket.gethostname())
"""
    )
    try:
        lost = kill_mid_collective(
            3,
            d,
            {**test_hosts.env, **transport_env("gaspi")},
            timeout=20,
            named=r"failed .*: its process or its host is gone",
            before=before,
            mpi_args=("-f", str(hostfile), "-ppn", "1"),
        )
    finally:  # (a killed world keeps MPICH's segments: later tests check the hosts for leftovers)
        for h in test_hosts.hosts:
            h.sweep_mpi_files()
    assert all("transfers to rank 2 failed" in line for line in lost), lost

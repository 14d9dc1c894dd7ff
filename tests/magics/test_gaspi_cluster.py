"""%tnt_cluster --transport gaspi in a real kernel: ranks that reduce between pseudo-nodes over
GPI-2, the transport in the status, two clusters in a row, nothing left behind; and the one-line
errors for a transport that the build (or the ranks' interpreter) does not have."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile

import pytest

from tests.support.kernel_driver import running, wait_gone
from tests.support.mpiworld import free_port_range, gaspi_built, requires_gaspi
from tnt_notebook.transport import require

pytestmark = [pytest.mark.notebook, pytest.mark.mpi]

CELL = """%%tnt
import numpy as np
from tnt_notebook.rank import api as ranks
info = ranks.engine_info()
print(info["transport"], info["num_nodes"], tnt.allreduce(np.arange(4.0) * (tnt.get_rank() + 1)))
"""


@pytest.fixture(scope="module")
def kernel(kernel_factory):
    return kernel_factory()


@requires_gaspi
def test_two_gaspi_clusters_in_a_row_reduce_between_pseudo_nodes_and_leave_nothing(kernel):
    pids = []
    for start in ("%tnt_cluster", "%tnt_cluster restart"):
        r = kernel.ok(f"{start} -n 2 --transport gaspi -x TNT_RANKS_PER_NODE=1", timeout=180)
        assert "tnt cluster ready: 2 rank(s)" in r.stdout
        assert "transport between nodes: gaspi" in kernel.ok("%tnt_cluster status").stdout
        assert kernel.ok(CELL).stdout == "gaspi 2 [0. 3. 6. 9.]\n"
        pids.append(
            kernel.value(
                "[r.pid for r in get_ipython().magics_manager.registry['TntMagics'].cluster.ranks]"
            )
        )
    assert not set(pids[0]) & set(pids[1])  # new processes: GPI-2 started again in each
    procs = kernel.descendants()
    assert kernel.ok("%tnt_cluster stop").stdout == "tnt cluster stopped\n"
    assert wait_gone(procs, 10) == [] and running(kernel.descendants()) == []
    assert not [f for f in os.listdir(tempfile.gettempdir()) if f.startswith("tnt-gaspi-")]


@requires_gaspi
def test_a_gaspi_port_in_use_stops_the_start_naming_it_and_leaves_nothing(kernel):
    base = free_port_range()
    before = {p.pid for p in running(kernel.descendants())}
    with socket.socket() as held:
        held.bind(("", base + 128))  # GPI-2's TCP data port of the first rank on this host
        held.listen()
        r = kernel.execute(
            f"%tnt_cluster -n 2 --transport gaspi -x TNT_RANKS_PER_NODE=1 TNT_GASPI_PORT={base}",
            timeout=180,
        )
    assert r.status == "error" and r.error["ename"] == "ClusterStartError", r.text()
    assert (
        f"the gaspi transport did not start: CollectiveError: GASPI: port {base + 128} is in use"
        in (r.traceback)
    )
    assert wait_gone([p for p in kernel.descendants() if p.pid not in before], 10) == []
    assert "no tnt cluster is running" in kernel.ok("%tnt_cluster status").stdout


def test_unknown_transports_are_one_line_usage_errors(kernel):
    r = kernel.execute("%tnt_cluster -n 1 --transport carrier-pigeon")
    assert r.status == "error" and "invalid choice" in r.usage_error, r.text()
    # the ranks' interpreter decides what the ranks have; one that lacks tnt_notebook is named
    python = shutil.which("python3", path="/usr/bin:/bin")
    probe = [python, "-c", "import tnt_notebook"]
    if python is None or subprocess.run(probe, cwd="/", capture_output=True).returncode == 0:
        pytest.skip("no interpreter without tnt_notebook on this machine")
    r = kernel.execute(f"%tnt_cluster -n 1 --transport gaspi --python-interpreter {python}")
    assert r.status == "error", r.text()
    assert f"--transport gaspi: cannot load tnt_notebook's native core with {python}" in (
        r.usage_error
    ), r.text()


def test_a_build_without_gpi2_names_what_is_missing_in_one_line():
    with pytest.raises(ValueError, match="built without GPI-2") as e:
        require("gaspi", ("mpi",))
    assert "\n" not in str(e.value) and str(e.value).startswith("the GASPI transport is not")
    require("gaspi", ("mpi", "gaspi"))
    require("mpi", ("mpi",))


@pytest.mark.skipif(gaspi_built(), reason="this build has the GASPI transport")
def test_without_gpi2_the_cluster_refuses_gaspi_in_one_line(kernel):
    r = kernel.execute("%tnt_cluster -n 2 --transport gaspi")
    assert r.status == "error" and "built without GPI-2" in r.usage_error, r.text()

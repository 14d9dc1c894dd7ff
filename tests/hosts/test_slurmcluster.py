"""The test Slurm itself (tests/slurmcluster.py): jobs run on nodes of their own, the allocation
as tnt_notebook reads it, and nothing left behind."""

from __future__ import annotations

import subprocess
import time

import pytest

from tests.support.slurmcluster import SlurmCluster, unavailable
from tests.support.testhosts import running
from tnt_notebook.cluster.slurm import SlurmAllocation

pytestmark = pytest.mark.slurm


def test_jobs_run_on_the_nodes_each_its_own_machine(slurm):
    r = slurm.client(["srun", "--nodes=2", "--ntasks-per-node=2", "--label", "hostname"])
    names = slurm.names
    assert sorted(line.split(": ")[1] for line in r.stdout.splitlines()) == [
        names[0],
        names[0],
        names[1],
        names[1],
    ]
    for h in slurm.nodes:  # a node finds the configuration where Slurm looks by default
        assert h.run(["grep", "-c", "NodeName", "/etc/slurm/slurm.conf"]).stdout.strip() == "2"
        assert h.run(["hostname"]).stdout.strip() == h.name
    assert slurm.controller.run(["hostname"]).stdout.strip().endswith("-ctl")


def test_the_allocation_as_tnt_notebook_reads_it_in_a_job_and_in_a_step(slurm):
    job = {"SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": slurm.names[0][:-1] + "[1-2]"}
    batch = SlurmAllocation.from_environment({**job, "SLURM_TASKS_PER_NODE": "3(x2)"})
    assert batch.nodes == tuple(slurm.names) and batch.tasks_per_node == (3, 3)
    # inside a step (a notebook server that batchspawner started with srun) the step's counts
    # are not the job's: --ntasks-per-node, else the job's CPUs per node over CPUs per task
    step = {**job, "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "1"}
    cpus = {"SLURM_JOB_CPUS_PER_NODE": "4(x2)", "SLURM_CPUS_PER_TASK": "2"}
    assert SlurmAllocation.from_environment({**step, **cpus}).tasks_per_node == (2, 2)
    per_node = {**step, **cpus, "SLURM_NTASKS_PER_NODE": "4"}
    assert SlurmAllocation.from_environment(per_node).tasks_per_node == (4, 4)
    assert SlurmAllocation.from_environment({}) is None
    # this machine (the login node) does not resolve the nodes' names; Slurm knows their address
    assert batch.node_addresses() == {h.name: h.address for h in slurm.nodes}


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_down_leaves_no_daemon_job_namespace_or_file():
    with SlurmCluster(1) as sl:
        sl.sbatch("#!/bin/sh\nsleep 300\n", "--output=/dev/null")
        node = sl.nodes[0]
        deadline = time.monotonic() + 20
        while not any("sleep 300" in item for item in node.leftovers()):
            assert time.monotonic() < deadline, "the job did not start"
            time.sleep(0.1)
        pids = node.pids() + sl.controller.pids()
        workdir, netns = sl.workdir, [h.netns for h in sl.hosts.hosts]
    assert sl.hosts.leftovers() == []
    assert not workdir.exists()
    assert running(pids) == []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not set(netns) & set(names.split())

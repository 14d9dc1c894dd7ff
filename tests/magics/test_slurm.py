"""%tnt_cluster inside a Slurm allocation, on the test Slurm (tests/slurmcluster.py): a notebook
kernel that a batch job with GPUs runs on its first node, as JupyterHub's batchspawner runs the
notebook server (``srun`` in the batch script; the job outlives its kernels), and one under
``salloc`` on the login node. The site's default PMI is PMIx (SLURM_MPI_TYPE=pmix in the kernels'
environment), which the mpich wheel cannot use: the cluster must choose its own."""

from __future__ import annotations

import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest
from jupyter_client import BlockingKernelClient, KernelManager
from jupyter_client.kernelspec import KernelSpecManager

from tests.support.kernel_driver import (
    Kernel,
    assert_death_named_by_the_next_cell,
    cluster_attr,
    start_fit,
)

pytestmark = [pytest.mark.notebook, pytest.mark.mpi, pytest.mark.slurm]

COLLECTIVE_TIMEOUT = 8


class JobKernel(Kernel):
    """Kernels on the first node of one batch job, one after the other (``kernels``), each
    started by ``srun`` in the batch script; the job then sleeps, as a notebook server outlives
    its kernels. ``connect(i)`` drives the i-th."""

    def __init__(self, slurm, workdir: Path, *options: str, kernels: int = 1) -> None:
        self.slurm = slurm
        stamp = time.monotonic_ns()
        self.connection_files = [workdir / f"kernel-{stamp}-{i}.json" for i in range(kernels)]
        runs = "".join(
            "srun --mpi=none --nodes=1 --ntasks=1 --nodelist=$(hostname) env SLURM_MPI_TYPE=pmix "
            f"{sys.executable} -m ipykernel_launcher -f {c} --ip=$(hostname -i)\n"
            for c in self.connection_files
        )
        script = f"#!/bin/bash\ncd {workdir}\n{runs}sleep 600\n"
        self.job = slurm.sbatch(script, *options, f"--output={workdir}/job-%j.out")
        self.output = workdir / f"job-{self.job}.out"
        self.km = None
        self.connect(0)

    def connect(self, i: int) -> None:
        deadline = time.monotonic() + 90
        while True:
            try:
                info = json.loads(self.connection_files[i].read_text())
                break
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                out = self.output.read_text() if self.output.exists() else ""
                pytest.fail(f"no kernel {i} in job {self.job} within 90 s: {out}")
            time.sleep(0.1)
        self.kc = BlockingKernelClient()
        self.kc.load_connection_info(info)
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.node = self.slurm.node(self.value("__import__('socket').gethostname()"))
        self.pid = self.value("__import__('os').getpid()")  # as the node numbers it
        self.load_extension()

    def shutdown(self) -> None:
        """Ask the kernel to exit and wait until it has (its step ends; the job does not)."""
        self.kc.shutdown()
        deadline = time.monotonic() + 30
        while self.node.run(["kill", "-0", str(self.pid)], check=False).returncode == 0:
            assert time.monotonic() < deadline, "the kernel did not exit within 30 s"
            time.sleep(0.1)
        self.kc.stop_channels()

    def kill(self) -> None:
        self.node.run(["kill", "-KILL", str(self.pid)])
        self.kc.stop_channels()


@pytest.fixture(scope="module")
def workdir(slurm):
    """The notebooks' directory, which every node sees at the same path."""
    d = Path(tempfile.mkdtemp(prefix="nb-", dir=slurm.shared_dir))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# the GPUs Slurm grants the module kernel's job on each node: GPU 0 of the second is held
GRANTED = (("0", "1"), ("1", "2"))


@pytest.fixture(scope="module")
def kernel(slurm, workdir):
    """A kernel in a job of 2 nodes x 2 tasks and 2 GPUs per node, granted while another job
    holds GPU 0 of the second node (so Slurm grants the nodes different GPUs, GRANTED); the job
    is cancelled at the end and its nodes checked."""
    holder = slurm.sbatch(
        "#!/bin/sh\nsleep 300\n",
        f"--nodelist={slurm.names[1]}",
        "--gres=gpu:1",
        "--output=/dev/null",
    )
    try:
        slurm.wait_state(holder, "RUNNING")
        k = JobKernel(slurm, workdir, "--nodes=2", "--ntasks-per-node=2", "--gpus-per-node=2")
    finally:
        slurm.scancel(holder)
    yield k
    try:
        k.execute("%tnt_cluster stop", timeout=60)
        k.shutdown()
    finally:
        slurm.scancel(k.job)
    slurm.wait_state(k.job, "CANCELLED", "")
    assert slurm.leftovers() == {}


@pytest.fixture
def running_cluster(kernel):
    """The module kernel's cluster, started here where no test before this one left it running:
    each test runs alone, in any order."""
    if "no tnt cluster is running" in kernel.ok("%tnt_cluster status").stdout:
        kernel.ok(f"%tnt_cluster --collective-timeout {COLLECTIVE_TIMEOUT}", timeout=120)


def status_rows(kernel: Kernel) -> list[tuple[int, str, int]]:
    status = kernel.ok("%tnt_cluster status").stdout
    rows = re.findall(r"^\s+(\d+)\s+(\S+)\s+(\d+)\s+yes\s+(?:CPU|GPU.*)$", status, re.M)
    return [(int(r), h, int(p)) for r, h, p in rows]


def test_the_allocation_gives_the_nodes_and_ranks_per_node(slurm, kernel):
    n1, n2 = slurm.names
    kernel.ok("%tnt_cluster stop", timeout=60)  # (a cluster that another test left)
    r = kernel.ok("%tnt_cluster --dry-run")
    assert f"4 rank(s) on 2 host(s) from Slurm job {kernel.job}" in r.stdout, r.stdout
    assert "-launcher slurm" in r.stdout and "ssh" not in r.stdout
    r = kernel.ok(f"%tnt_cluster --collective-timeout {COLLECTIVE_TIMEOUT}", timeout=120)
    assert f"tnt cluster ready: 4 rank(s) on {n1}, {n2} of Slurm job {kernel.job} " in r.stdout
    status = kernel.ok("%tnt_cluster status").stdout
    assert (
        f"from Slurm job {kernel.job} (nodes {n1[:-1]}[1-2]; mpiexec, whose proxies srun starts)"
        in status
    ), status
    rows = status_rows(kernel)
    assert [(rank, host) for rank, host, _ in rows] == [(0, n1), (1, n1), (2, n2), (3, n2)]
    for _, name, pid in rows:  # each rank runs where status says, with that pid there
        assert "ipyparallel.engine" in slurm.node(name).run(["cat", f"/proc/{pid}/cmdline"]).stdout
    # each rank keeps one of the GPUs that Slurm granted its node, and status names it
    assert re.findall(r"yes\s+(GPU \d+ \(granted by Slurm\))$", status, re.M) == [
        f"GPU {g} (granted by Slurm)" for node in GRANTED for g in node
    ], status
    r = kernel.ok(
        "%%tnt --all-ranks\nimport os, socket\nfrom tnt_notebook.rank import api as ranks\n"
        "i = ranks.engine_info()\n"
        "print(socket.gethostname(), tnt.get_rank(), i['num_nodes'], i['local_rank'],"
        " i['local_size'], tnt.allreduce(1.0), os.environ['CUDA_VISIBLE_DEVICES'])"
    )
    assert r.stdout == "".join(
        f"[stdout:{r}]\n{(n1, n2)[r // 2]} {r} 2 {r % 2} 2 4.0 {GRANTED[r // 2][r % 2]}\n"
        for r in range(4)
    )
    # one job step of the cluster's own name, on both nodes, beside the kernel's own
    cid = cluster_attr(kernel, "cluster_id")
    assert f"{kernel.job}.1 tnt-{cid} {n1[:-1]}[1-2]" in slurm.steps(kernel.job)


@pytest.mark.usefixtures("running_cluster")
def test_fit_equals_serial_keras(kernel):
    code = """%%tnt
from tests.keras import equivalence_worker as e
print(e.summary_on_ranks(("dense_sgd",), 1e-5))
"""
    r = kernel.ok(code, timeout=400)
    result = [line for line in r.stdout.splitlines() if line.startswith("RESULT")]
    assert result and result[0].split()[1:3] == ["True", "True"], r.text()


@pytest.mark.usefixtures("running_cluster")
def test_a_rank_killed_mid_fit_is_named_then_srun_launches_the_next_world(slurm, kernel, workdir):
    n1, n2 = slurm.names
    pids = [pid for _, _, pid in status_rows(kernel)]
    msg_id = start_fit(kernel, workdir)
    t0 = time.monotonic()
    slurm.node(n2).run(["kill", "-KILL", str(pids[3])])
    r = kernel.collect(msg_id, timeout=120)
    assert time.monotonic() - t0 < 30
    assert r.status == "error" and r.error["ename"] == "ClusterDeadError", r.text()
    assert f"rank(s) 3 died (rank 3: pid {pids[3]} on {n2})" in r.traceback, r.traceback
    assert slurm.leftovers(kernel.job) == {}
    # the same allocation, ranks as tasks of srun
    r = kernel.ok("%tnt_cluster restart --launcher srun", timeout=120)
    assert "tnt cluster ready: 4 rank(s)" in r.stdout, r.text()
    assert "srun, one rank per task" in kernel.ok("%tnt_cluster status").stdout
    rows = status_rows(kernel)
    assert [(rank, host) for rank, host, _ in rows] == [(0, n1), (1, n1), (2, n2), (3, n2)]
    r = kernel.ok(
        "%%tnt --all-ranks\nimport os\nfrom tnt_notebook.rank import api as ranks\n"
        "print(tnt.get_rank(), ranks.engine_info()['local_size'], tnt.allreduce(1.0),"
        " os.environ['CUDA_VISIBLE_DEVICES'])"
    )
    assert r.stdout == "".join(
        f"[stdout:{r}]\n{r} 2 4.0 {GRANTED[r // 2][r % 2]}\n" for r in range(4)
    )
    msg_id = kernel.send("%%tnt\nimport time\nfor _ in range(600):\n    time.sleep(0.1)")
    time.sleep(1)
    slurm.node(n2).run(["kill", "-KILL", str(rows[2][2])])
    r = kernel.collect(msg_id, timeout=60)
    assert r.status == "error" and r.error["ename"] == "ClusterDeadError", r.text()
    # named as the hub saw it go (its nanny tells), or as srun reports it
    pid = rows[2][2]
    named = (
        f"rank(s) 2 died (rank 2: pid {pid} on {n2})",
        f"rank 2 on {n2} died: killed by signal SIGKILL (pid {pid})",
    )
    assert any(text in r.traceback for text in named), r.traceback
    assert slurm.leftovers(kernel.job) == {}
    kernel.ok("%tnt_cluster restart --launcher mpiexec", timeout=120)


@pytest.mark.slow  # (two more starts: the kill mid-fit above covers both launchers' reports)
@pytest.mark.usefixtures("running_cluster")
def test_a_rank_killed_between_cells_is_named_with_its_node_under_hydra_and_srun(slurm, kernel):
    n2 = slurm.names[1]
    for launcher in ("mpiexec", "srun"):
        kernel.ok(f"%tnt_cluster restart --launcher {launcher}", timeout=120)
        pid = status_rows(kernel)[3][2]
        slurm.node(n2).run(["kill", "-KILL", str(pid)])
        assert_death_named_by_the_next_cell(kernel, 3, n2, pid, cause_known=launcher == "srun")
    kernel.ok("%tnt_cluster restart --launcher mpiexec", timeout=120)


@pytest.mark.usefixtures("running_cluster")
def test_a_node_lost_mid_fit_is_named_and_its_ranks_end_once_it_is_back(slurm, kernel, workdir):
    n2 = slurm.node(slurm.names[1])
    msg_id = start_fit(kernel, workdir)
    before = n2.leftovers()  # the ranks, their proxy and the host's watcher
    n2.link_down()
    t0 = time.monotonic()
    try:
        r = kernel.collect(msg_id, timeout=120)
        elapsed = time.monotonic() - t0
        kernel.ok("%tnt_cluster stop", timeout=60)
    finally:
        n2.link_up()
    assert elapsed < COLLECTIVE_TIMEOUT + 15, elapsed
    assert r.status == "error" and r.error["ename"] == "ClusterDeadError", r.text()
    assert re.search(r"rank\(s\) [23]", r.traceback) and n2.name in r.traceback, r.traceback
    # the step was cancelled: Slurm ends its ranks on the node once it reaches it again
    left = slurm.leftovers(kernel.job, timeout=60)
    for name in set(left) - {"steps"}:  # swept, so that the module's later tests find the
        sweep = [
            sys.executable,
            "-m",
            "tnt_notebook.cluster.cleanup",
            "ranks",
        ]  # nodes as they should be
        slurm.node(name).run(sweep, check=False)
    r = kernel.ok(f"%tnt_cluster --collective-timeout {COLLECTIVE_TIMEOUT}", timeout=120)
    assert kernel.ok("%%tnt\nprint(tnt.allreduce(1.0))").stdout == "4.0\n"
    assert left == {}, "\n".join(["before the cut:", *before, slurm.log(n2.name)])


@pytest.mark.usefixtures("running_cluster")
def test_stop_ends_the_step_and_leaves_nothing_on_any_node_and_cleanup_reaches_them(slurm, kernel):
    profile = cluster_attr(kernel, "profile_dir")
    kernel.ok("%tnt_cluster stop", timeout=60)
    assert slurm.leftovers(kernel.job) == {}
    assert kernel.node.run(["test", "-e", profile], check=False).returncode == 1
    # this node directly, the other through srun (no ssh)
    r = kernel.ok("%tnt_cluster cleanup", timeout=60)
    assert r.stdout.splitlines() == [f"{n}: ended 0 leftover rank(s)" for n in slurm.names]


def test_kernel_shutdown_and_a_sigkilled_kernel_leave_nothing_on_any_node(slurm, workdir):
    """One job (2 nodes x 1), whose batch script starts a kernel twice; the job lives on."""
    k = JobKernel(slurm, workdir, "--nodes=2", "--ntasks-per-node=1", kernels=2)
    try:
        for i, end in enumerate(("shutdown", "SIGKILL")):
            if i:
                k.connect(i)
            r = k.ok("%tnt_cluster", timeout=120)
            assert "tnt cluster ready: 2 rank(s)" in r.stdout, r.text()
            r = k.ok(  # no GPUs granted: the CPU
                "%%tnt --all-ranks\nimport os, socket\n"
                "print(socket.gethostname(), repr(os.environ['CUDA_VISIBLE_DEVICES']))"
            )
            assert r.stdout == "".join(f"[stdout:{i}]\n{n} ''\n" for i, n in enumerate(slurm.names))
            k.shutdown() if end == "shutdown" else k.kill()
            assert slurm.leftovers(k.job) == {}, end
            assert slurm.job_state(k.job) == "RUNNING"
    finally:
        slurm.scancel(k.job)


def salloc_kernel(workdir: Path, *options: str) -> Kernel:
    """A kernel that salloc starts on the login node (this machine) inside a new allocation:
    the kernel is not a process of the job, so it outlives a cancelled job."""
    spec = workdir / "kernels" / "salloc"
    spec.mkdir(parents=True, exist_ok=True)
    argv = ["salloc", "--quiet", *options, "env", "SLURM_MPI_TYPE=pmix", sys.executable]
    argv += ["-m", "ipykernel_launcher", "-f", "{connection_file}"]
    (spec / "kernel.json").write_text(
        json.dumps({"argv": argv, "display_name": "salloc", "language": "python"})
    )
    km = KernelManager(
        kernel_name="salloc", kernel_spec_manager=KernelSpecManager(kernel_dirs=[str(spec.parent)])
    )
    return Kernel(cwd=str(workdir), km=km)


def test_scancel_of_the_job_ends_the_cell_with_a_clear_message(slurm, workdir):
    k = salloc_kernel(workdir, "--nodes=2", "--ntasks-per-node=1")
    try:
        job = k.value("__import__('os').environ['SLURM_JOB_ID']")
        r = k.ok(f"%tnt_cluster --collective-timeout {COLLECTIVE_TIMEOUT}", timeout=120)
        assert f"tnt cluster ready: 2 rank(s) on {', '.join(slurm.names)} of Slurm job {job}" in (
            r.stdout
        )
        msg_id = start_fit(k, workdir)
        t0 = time.monotonic()
        slurm.scancel(job)
        r = k.collect(msg_id, timeout=60)
        assert time.monotonic() - t0 < 20
        assert r.status == "error" and r.error["ename"] == "ClusterDeadError", r.text()
        assert f"Slurm job {job} was cancelled (scancel): Slurm ended its ranks" in r.traceback
        assert "was cancelled (scancel)" in k.ok("%tnt_cluster status").stdout
        assert slurm.leftovers() == {}
        k.ok("%tnt_cluster stop", timeout=60)
    finally:
        k.shutdown()
        if k.km.is_alive():
            k.km.shutdown_kernel(now=True)
    assert slurm.leftovers() == {}

"""Tarantella's launch rules on GPU nodes, on machines without GPUs: recorded ``nvidia-smi -L``
listings (``TNT_GPU_INVENTORY``) stand for each host's GPUs, and real mpiexec worlds of tnt-run
show each rank's ``CUDA_VISIBLE_DEVICES``; the same code probes ``nvidia-smi -L`` on a GPU node
(scripts/gpu_check.sh checks that end on one)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tnt_notebook.cluster.gpu_inventory import Gpu, offered, parse_listing
from tnt_notebook.cluster.plan import LaunchPlan
from tnt_notebook.cluster.slurm import SlurmAllocation, SlurmError, _gpus_granted
from tnt_notebook.rank.device import keep_own_gpu, node_local_index

TNT_RUN = str(Path(sys.executable).parent / "tnt-run")
VENV_BIN = str(Path(sys.executable).parent)
NAME = "NVIDIA H100 80GB HBM3"
SHOW = """
import os, sys
import tnt_notebook as tnt
seen = os.environ.get("CUDA_VISIBLE_DEVICES")
growth = os.environ.get("TF_FORCE_GPU_ALLOW_GROWTH")
rank, size = tnt.get_rank(), tnt.get_size()
print(f"rank {rank} of {size} sees {seen!r} growth {growth} args {sys.argv[1:]}")
if "--devices" in sys.argv and rank == 0:  # what the progress summary says they train on
    from tnt_notebook.rank.device import ranks_devices
    print(f"devices: {ranks_devices()}")
"""


def listing(n: int) -> str:
    return "".join(f"GPU {i}: {NAME} (UUID: GPU-{i:04x}-uuid)\n" for i in range(n))


@pytest.fixture(scope="module")
def workdir():
    d = Path(tempfile.mkdtemp(prefix="tnt-gpu-"))
    (d / "show.py").write_text(SHOW)
    for n in (0, 1, 4, 6):
        (d / f"gpus{n}.txt").write_text(listing(n))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def tnt_run(d: Path, gpus: int, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    environ["TNT_GPU_INVENTORY"] = str(d / f"gpus{gpus}.txt")
    environ.update(env)
    return subprocess.run(
        [TNT_RUN, "--output-on-all-devices", *args],
        cwd=d,
        env=environ,
        capture_output=True,
        text=True,
        timeout=120,
    )


def seen(r: subprocess.CompletedProcess) -> list[str]:
    """Each rank's line, in rank order."""
    assert r.returncode == 0, r.stderr
    return sorted(r.stdout.splitlines())


# --------------------------------------------------------------- the rules in real mpiexec worlds
@pytest.mark.mpi
def test_one_rank_per_gpu_by_default_each_seeing_only_its_own(workdir):
    r = tnt_run(workdir, 4, "--", "show.py", "--devices")
    assert seen(r) == [
        f"devices: one GPU each ({NAME})",
        *(f"rank {i} of 4 sees '{i}' growth true args ['--devices']" for i in range(4)),
    ]
    assert "warning" not in r.stderr


@pytest.mark.mpi
def test_cuda_visible_devices_already_set_is_subdivided_never_widened(workdir):
    r = tnt_run(workdir, 6, "-n", "2", "--", "show.py", CUDA_VISIBLE_DEVICES="5,3")
    assert seen(r) == [
        "rank 0 of 2 sees '5' growth true args []",
        "rank 1 of 2 sees '3' growth true args []",
    ]
    r = tnt_run(
        workdir, 6, "-n", "2", "-x", "CUDA_VISIBLE_DEVICES=GPU-0004-uuid,2", "--", "show.py"
    )
    assert seen(r)[0] == "rank 0 of 2 sees 'GPU-0004-uuid' growth true args []"
    r = tnt_run(workdir, 6, "-n", "2", "--", "show.py", CUDA_VISIBLE_DEVICES="4")
    assert "2 rank(s) per node but only 1 GPU(s)" in r.stderr
    assert seen(r) == [f"rank {i} of 2 sees '' growth None args []" for i in range(2)]


@pytest.mark.mpi
def test_more_ranks_than_gpus_warn_and_run_every_rank_on_the_cpu(workdir):
    r = tnt_run(workdir, 1, "-n", "2", "--", "show.py", "--devices")
    assert seen(r) == [
        "devices: CPU",
        *(f"rank {i} of 2 sees '' growth None args ['--devices']" for i in range(2)),
    ]
    assert r.stderr == (
        "tnt-run: warning: 2 rank(s) per node but only 1 GPU(s) on each node: every rank runs on "
        "the CPU (--no-gpu runs on the CPU without this warning)\n"
    )


@pytest.mark.mpi
def test_without_gpus_one_cpu_rank_with_a_warning_and_no_gpu_or_a_count_silences_it(workdir):
    r = tnt_run(workdir, 0, "--", "show.py")
    assert seen(r) == ["rank 0 of 1 sees '' growth None args []"]
    assert r.stderr.startswith("tnt-run: warning: no GPUs found on localhost: 1 rank(s) per node")
    r = tnt_run(workdir, 0, "-n", "2", "--", "show.py")  # none installed, a count given: silent
    assert len(seen(r)) == 2 and r.stderr == ""
    r = tnt_run(workdir, 4, "--no-gpu", "-n", "2", "--", "show.py")
    assert seen(r)[0] == "rank 0 of 2 sees '' growth None args []" and r.stderr == ""


@pytest.mark.mpi
def test_python_before_the_script_as_mpirun_users_write_it(workdir):
    path = {"PATH": f"{VENV_BIN}:{os.environ['PATH']}"}
    r = tnt_run(workdir, 1, "-n", "1", "--", "python", "show.py", "--epochs", "3", **path)
    assert seen(r) == ["rank 0 of 1 sees '0' growth true args ['--epochs', '3']"]
    r = tnt_run(workdir, 1, "-n", "1", "--", "python", "-u", "show.py")
    assert r.returncode == 2 and "give the script right after the interpreter" in r.stderr


def test_dry_run_shows_each_ranks_device(workdir):
    r = tnt_run(workdir, 4, "-n", "2", "--dry-run", "--", "show.py")
    assert r.returncode == 0, r.stderr
    assert (
        f"    rank 0 on localhost: GPU 0 ({NAME})\n    rank 1 on localhost: GPU 1 ({NAME})\n"
        in (r.stdout)
    )
    assert (
        "-genv TNT_GPU_PER_RANK 1" in r.stdout
        and "-genv TF_FORCE_GPU_ALLOW_GROWTH true" in r.stdout
    )
    r = tnt_run(workdir, 1, "-n", "2", "--dry-run", "--", "show.py")
    assert "  WARNING: 2 rank(s) per node but only 1 GPU(s)" in r.stdout
    assert "  devices: every rank on the CPU (CUDA_VISIBLE_DEVICES='')" in r.stdout


# --------------------------------------------------------------------- the pieces, in this process
def test_the_inventory_reads_nvidia_smi_listings_and_cuda_visible_devices_as_cuda_does():
    gpus = parse_listing(listing(2) + "  MIG 1g.10gb Device 0: (UUID: MIG-x)\nNo devices\n")
    assert gpus == [Gpu(0, NAME, "GPU-0000-uuid"), Gpu(1, NAME, "GPU-0001-uuid")]
    assert offered(gpus, None) == gpus and offered(gpus, "") == []
    assert offered(gpus, "1,GPU-0000-uuid") == [gpus[1], gpus[0]]
    assert offered(gpus, "1,7,0") == [gpus[1]]  # CUDA stops at the first index that is no GPU


def test_a_rank_keeps_the_gpu_of_its_node_local_index():
    env = {"TNT_GPU_PER_RANK": "1", "MPI_LOCALRANKID": "1", "CUDA_VISIBLE_DEVICES": "2,3"}
    assert keep_own_gpu(env) == "3" and env["CUDA_VISIBLE_DEVICES"] == "3"
    assert keep_own_gpu({"TNT_GPU_PER_RANK": "1", "SLURM_LOCALID": "2"}) == "2"
    # the testing knob that makes every k consecutive ranks a node counts as a node
    assert (
        node_local_index({"TNT_RANKS_PER_NODE": "2", "PMI_RANK": "3", "MPI_LOCALRANKID": "3"}) == 1
    )
    assert keep_own_gpu({"CUDA_VISIBLE_DEVICES": "0,1"}) == "0,1"  # rules off: untouched
    with pytest.raises(RuntimeError, match="node-local rank 2 has no GPU of its own"):
        keep_own_gpu(
            {"TNT_GPU_PER_RANK": "1", "MPI_LOCALRANKID": "2", "CUDA_VISIBLE_DEVICES": "0,1"}
        )


def test_inside_slurm_the_gpus_it_grants_per_node_decide(monkeypatch, workdir):
    monkeypatch.setenv("TNT_GPU_INVENTORY", str(workdir / "gpus6.txt"))  # not asked inside Slurm
    assert _gpus_granted({"SLURM_GPUS_PER_NODE": "a100:2"}) == 2
    assert _gpus_granted({"SLURM_GPUS_PER_NODE": "a100:2,v100:1"}) == 3
    assert _gpus_granted({"SLURM_GPUS_ON_NODE": "4"}) == 4  # --gres=gpu:4
    assert _gpus_granted({"SLURM_JOB_GPUS": "0,1"}) == 2 and _gpus_granted({}) is None
    with pytest.raises(SlurmError, match="SLURM_GPUS_PER_NODE"):
        _gpus_granted({"SLURM_GPUS_PER_NODE": "gpu:two"})
    job = SlurmAllocation("7", "node[1-2]", ("node1", "node2"), (1, 1), gpus_per_node=2)
    plan = LaunchPlan(slurm=job)
    assert plan.size == 4 and plan.devices.gpus is not None and not plan.devices.warning
    assert plan.env_exports()["TNT_GPU_PER_RANK"] == "1"
    assert LaunchPlan(slurm=job, n_per_node=3).devices.warning.startswith("3 rank(s) per node")
    no_gpus = SlurmAllocation("7", "node[1-2]", ("node1", "node2"), (3, 3), gpus_per_node=0)
    plan = LaunchPlan(slurm=no_gpus)  # the tasks it grants, on the CPU, without a warning
    assert plan.n_per_node == 3 and plan.devices.gpus is None and not plan.devices.warning


# ---------------------------------------------------------------- several hosts (tests/testhosts)
@pytest.fixture(scope="module")
def gpu_hosts(test_hosts):
    """A work directory every host sees, with a recorded listing in each host's own /tmp."""
    d = Path(tempfile.mkdtemp(prefix="tnt-gpu-", dir=test_hosts.shared_dir))
    (d / "show.py").write_text(SHOW)
    yield test_hosts, d
    for h in test_hosts.hosts:
        h.run("rm -f /tmp/tnt-gpus.txt", check=False)
    shutil.rmtree(d, ignore_errors=True)


def record(host, n: int) -> None:
    host.run(["sh", "-c", f"printf '{listing(n)}' > /tmp/tnt-gpus.txt"])


@pytest.mark.hosts
@pytest.mark.mpi
def test_across_hosts_each_node_runs_a_rank_per_gpu_and_unlike_nodes_are_refused(gpu_hosts):
    test_hosts, d = gpu_hosts
    two = test_hosts.hosts[:2]
    hostfile = test_hosts.write_hostfile(two, d / "hosts")
    opts = ["--hostfile", str(hostfile), "--ssh", str(test_hosts.ssh)]
    env = {"TNT_GPU_INVENTORY": "/tmp/tnt-gpus.txt"}  # each host reads its own
    record(two[0], 2)
    record(two[1], 2)
    r = tnt_run(d, 0, *opts, "--", "show.py", **env)
    assert seen(r) == [f"rank {i} of 4 sees '{i % 2}' growth true args []" for i in range(4)]
    r = tnt_run(d, 0, *opts, "--dry-run", "--", "show.py", **env)
    assert f"    rank 3 on {two[1].name}: GPU 1 ({NAME})" in r.stdout
    record(two[1], 1)
    r = tnt_run(d, 0, *opts, "--", "show.py", **env)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == (
        f"tnt-run: error: the nodes offer different numbers of GPUs ({two[0].name}: 2, "
        f"{two[1].name}: 1); ranks per node follow the GPUs, so the nodes must be alike: give "
        "hosts with as many GPUs each, or --no-gpu\n"
    )
    record(two[0], 0)
    record(two[1], 0)
    r = tnt_run(d, 0, *opts, "--", "show.py", **env)
    assert seen(r) == [f"rank {i} of 2 sees '' growth None args []" for i in range(2)]
    assert "no GPUs found on " in r.stderr


def test_a_recorded_listing_that_cannot_be_read_is_an_error_before_anything_starts(tmp_path):
    missing = tmp_path / "missing.txt"
    (tmp_path / "show.py").write_text(SHOW)
    r = tnt_run(tmp_path, 0, "-n", "2", "--", "show.py", TNT_GPU_INVENTORY=str(missing))
    assert r.returncode == 2
    assert r.stderr == f"tnt-run: error: TNT_GPU_INVENTORY='{missing}': No such file or directory\n"


@pytest.mark.mpi
def test_a_notebooks_ranks_keep_their_gpu_and_status_names_it(workdir, monkeypatch):
    from tnt_notebook.cluster.lifecycle import Cluster

    monkeypatch.setenv("TNT_GPU_INVENTORY", str(workdir / "gpus4.txt"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cluster = Cluster(LaunchPlan(n=2))
    try:
        cluster.start()
        rows = cluster.status_text().splitlines()[3:]
        assert [row.split(None, 4)[4] for row in rows] == [f"GPU {i} ({NAME})" for i in range(2)]
        cluster.view.execute("import os; v = os.environ.get('CUDA_VISIBLE_DEVICES')").get(30)
        assert cluster.view.pull("v").get(timeout=30) == ["0", "1"]
    finally:
        cluster.stop()


# ------------------------------------------------------------- inside the test Slurm's allocations
SHOW_NODE = SHOW.replace('print(f"rank', "print(f\"{__import__('socket').gethostname()} rank")
# a job's script: what Slurm grants each node (one task per node prints its CUDA_VISIBLE_DEVICES),
# then the ranks of tnt-run with each launcher
GPU_JOB = f"""#!/bin/sh
srun --overlap --ntasks-per-node=1 --ntasks=$SLURM_NNODES sh -c \\
  'echo "granted $(hostname) ${{CUDA_VISIBLE_DEVICES-unset}}"'
for launcher in mpiexec srun; do
  echo "launcher $launcher"
  {TNT_RUN} --launcher $launcher --output-on-all-devices -- show.py 2>&1
done
"""


@pytest.fixture(scope="module")
def in_slurm(slurm):
    """A work directory on the test Slurm's shared storage, and a recorded listing of the 4 GPUs
    each of its nodes has (Gres=gpu:4), as nvidia-smi would print it there."""
    d = Path(tempfile.mkdtemp(prefix="tnt-gpu-", dir=slurm.shared_dir))
    (d / "show.py").write_text(SHOW_NODE)
    (d / "gpus4.txt").write_text(listing(slurm.gpus))
    yield slurm, d
    shutil.rmtree(d, ignore_errors=True)


def shown(hosts: tuple[str, ...], visible: list[str]) -> list[str]:
    """SHOW_NODE's lines of ranks r on hosts[r] that see CUDA_VISIBLE_DEVICES=visible[r]."""
    return [
        f"{host} rank {r} of {len(hosts)} sees '{v}' growth {'true' if v else None} args []"
        for r, (host, v) in enumerate(zip(hosts, visible, strict=True))
    ]


def run_job(slurm, d: Path, *options: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """GPU_JOB as a batch job with `options`: what Slurm granted each node (its
    CUDA_VISIBLE_DEVICES entries), and each launcher's output lines, sorted."""
    env = {"TNT_GPU_INVENTORY": str(d / "gpus4.txt")}
    job = slurm.sbatch(GPU_JOB, *options, f"--chdir={d}", f"--output={d}/job-%j.out", env=env)
    slurm.wait_state(job, "COMPLETED", "FAILED", timeout=120)
    out = (d / f"job-{job}.out").read_text()
    granted: dict[str, list[str]] = {}
    lines: dict[str, list[str]] = {}
    launcher = ""
    for line in out.splitlines():
        if line.startswith("granted "):
            _, host, visible = line.split()
            granted[host] = visible.split(",")
        elif line.startswith("launcher "):
            launcher = line.split()[1]
            lines[launcher] = []
        else:
            lines[launcher].append(line)
    assert slurm.leftovers(job) == {}
    return granted, {k: sorted(v) for k, v in lines.items()}


@pytest.mark.slurm
@pytest.mark.mpi
def test_in_slurm_each_rank_keeps_one_of_the_gpus_slurm_granted_its_node(in_slurm):
    slurm, d = in_slurm
    n1, n2 = slurm.names
    # another job holds GPU 0 of n2: Slurm grants the next job other GPUs there than on n1
    holder = slurm.sbatch(
        "#!/bin/sh\nsleep 300\n", f"--nodelist={n2}", "--gres=gpu:1", "--output=/dev/null"
    )
    try:
        slurm.wait_state(holder, "RUNNING")
        # one task per node: the ranks per node come from the 2 GPUs granted on each
        granted, ran = run_job(slurm, d, "--nodes=2", "--ntasks-per-node=1", "--gpus-per-node=2")
    finally:
        slurm.scancel(holder)
    assert granted[n1] == ["0", "1"] and granted[n2] == ["1", "2"], granted
    expected = shown((n1, n1, n2, n2), [*granted[n1], *granted[n2]])
    assert ran == {"mpiexec": expected, "srun": expected}


@pytest.mark.slurm
@pytest.mark.mpi
def test_in_slurm_a_job_without_gpus_runs_the_tasks_it_grants_on_the_cpu_silently(in_slurm):
    slurm, d = in_slurm
    n1, n2 = slurm.names
    granted, ran = run_job(slurm, d, "--nodes=2", "--ntasks-per-node=1")
    assert granted == {n1: ["unset"], n2: ["unset"]}
    expected = shown((n1, n2), ["", ""])
    assert ran == {"mpiexec": expected, "srun": expected}


@pytest.mark.slurm
@pytest.mark.mpi
def test_in_slurm_an_salloc_shell_with_gres_asks_slurm_what_each_node_was_granted(in_slurm):
    slurm, d = in_slurm
    n1, n2 = slurm.names
    # salloc's shell on the login node has no GPU variable: Slurm shows the job's grants
    salloc = ["salloc", "--quiet", "--nodes=2", "--ntasks-per-node=1"]
    run = [TNT_RUN, "--output-on-all-devices", "--", "show.py"]
    r = slurm.client([*salloc, "--gres=gpu:2", *run], cwd=d, check=False, timeout=120)
    assert (r.returncode, r.stderr) == (0, "")
    assert sorted(r.stdout.splitlines()) == shown((n1, n1, n2, n2), ["0", "1", "0", "1"])
    # 3 GPUs in all: Slurm grants 2 on one node and 1 on the other
    r = slurm.client([*salloc, "--gpus=3", *run], cwd=d, check=False, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert f"grants different GPU counts per node ({n1}: 2, {n2}: 1)" in r.stderr, r.stderr

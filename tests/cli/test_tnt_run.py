"""tnt-run from a shell: on this machine, then across the test hosts (tests/testhosts.py)."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from tests.support.mpiworld import gaspi_built
from tests.support.testhosts import leftovers_within

pytestmark = pytest.mark.mpi

TNT_RUN = str(Path(sys.executable).parent / "tnt-run")

SCRIPT = """
import os, socket, sys, time
from pathlib import Path
import numpy as np
import tnt_notebook as tnt
rank = tnt.get_rank()
total = float(tnt.allreduce(np.ones(3))[0])
print(f"rank {rank} of {tnt.get_size()} on {socket.gethostname()} args {sys.argv[1:]} sum {total}")
mode = sys.argv[1] if len(sys.argv) > 1 else ""
if mode == "fail" and rank == int(sys.argv[2]):
    print("rank", rank, "gives up", file=sys.stderr)
    sys.exit(7)
if mode == "kill" and rank == int(sys.argv[2]):
    os.kill(os.getpid(), 9)
if mode in ("fail", "kill", "sleep"):
    Path(sys.argv[3], f"ready-{rank}").touch()
    time.sleep(300)
"""


@pytest.fixture(scope="module")
def workdir():
    """A directory with the script, visible at the same path on every test host."""
    d = Path(tempfile.mkdtemp(prefix="tnt-run-"))
    (d / "train.py").write_text(SCRIPT)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def tnt_run(*args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [TNT_RUN, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout
    )


def test_master_output_only_unless_asked_and_the_arguments_reach_the_script(workdir):
    r = tnt_run("-n", "3", "--", "train.py", "a", "b", cwd=workdir)
    assert r.returncode == 0, r.stderr
    host = socket.gethostname()
    assert r.stdout == f"rank 0 of 3 on {host} args ['a', 'b'] sum 3.0\n"
    r = tnt_run("-n", "3", "--output-on-all-devices", "--", "train.py", cwd=workdir)
    assert sorted(r.stdout.splitlines()) == [
        f"rank {i} of 3 on {host} args [] sum 3.0" for i in range(3)
    ]


def test_the_first_failing_rank_is_named_and_its_exit_status_returned(workdir):
    t0 = time.monotonic()
    r = tnt_run("-n", "3", "--", "train.py", "fail", "1", str(workdir), cwd=workdir)
    assert time.monotonic() - t0 < 30  # the others, asleep, are ended at once
    assert r.returncode == 7, r.stderr
    assert f"tnt-run: rank 1 on {socket.gethostname()} failed first (exit code 7)" in r.stderr
    assert "rank 1 gives up" in r.stderr
    r = tnt_run("-n", "2", "--", "train.py", "kill", "1", str(workdir), cwd=workdir)
    assert r.returncode == 128 + 9, r.stderr
    assert (
        f"tnt-run: rank 1 on {socket.gethostname()} died first (killed by signal SIGKILL)"
        in r.stderr
    )


def test_bad_options_are_one_line_errors_and_dry_run_starts_nothing(workdir, tmp_path):
    for args, message in [
        (["-n", "0", "--", "train.py"], "-n must be a positive integer"),
        (["--hostfile", str(tmp_path / "none"), "--", "train.py"], "does not exist"),
        (["-n", "2"], "no script given"),
        (["-n", "2", "--", "missing.py"], "script 'missing.py' does not exist"),
        (["-n", "2", "-x", "1X=2", "--", "train.py"], "is not an environment variable name"),
    ]:
        r = tnt_run(*args, cwd=workdir)
        assert r.returncode == 2 and r.stderr.startswith("tnt-run: error: ") and message in r.stderr
        assert r.stderr.count("\n") == 1, r.stderr
    r = tnt_run(
        "-n",
        "2",
        "-x",
        "FOO=bar",
        "--fusion-threshold",
        "8",
        "--dry-run",
        "--",
        "train.py",
        "x",
        cwd=workdir,
    )
    assert r.returncode == 0 and "tnt-run launch plan: 2 rank(s) on this machine" in r.stdout
    assert "-genv FOO bar" in r.stdout and "-genv TNT_FUSION_THRESHOLD 8192" in r.stdout
    assert "-m tnt_notebook.rank.run_script" in r.stdout and r.stdout.rstrip().endswith(
        "-- train.py x"
    )
    assert "-genv TNT_TRANSPORT mpi" in r.stdout
    # the launchers' --transport (one option list): the ranks' build must have it
    r = tnt_run("-n", "2", "--transport", "gaspi", "--dry-run", "--", "train.py", cwd=workdir)
    if gaspi_built():
        assert (
            "transport between nodes: gaspi" in r.stdout and "-genv TNT_TRANSPORT gaspi" in r.stdout
        )
    else:
        assert r.returncode == 2 and "built without GPI-2" in r.stderr, r.stderr


def interrupt_and_check(workdir: Path, args: list[str], ranks: int) -> list[psutil.Process]:
    """Start tnt-run, wait until every rank sleeps, Ctrl-C it; it must end within the bound."""
    flags = Path(tempfile.mkdtemp(dir=workdir))
    proc = subprocess.Popen(
        [TNT_RUN, *args, "--", "train.py", "sleep", "-1", str(flags)],
        cwd=workdir,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while len(list(flags.iterdir())) < ranks:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "the ranks did not start within 120 s"
            time.sleep(0.05)
        descendants = psutil.Process(proc.pid).children(recursive=True)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
        assert time.monotonic() - t0 < 15
        assert proc.returncode == 130 and "every rank was ended" in err, err
        return descendants
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ctrl_c_ends_every_rank(workdir):
    descendants = interrupt_and_check(workdir, ["-n", "3"], 3)
    _, alive = psutil.wait_procs(descendants, timeout=10)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []


def test_cleanup_on_this_machine(workdir):
    r = tnt_run("-n", "1", "--cleanup", cwd=workdir)
    # (other sessions of this user may have left some on this machine: ended too)
    assert r.returncode == 0 and r.stdout.startswith("localhost: ended "), r.stderr


# ----------------------------------------------------------------------- across the test hosts
@pytest.fixture(scope="module")
def on_hosts(test_hosts):
    """A work directory every host sees, and a hostfile of the first two hosts."""
    d = Path(tempfile.mkdtemp(prefix="tnt-run-", dir=test_hosts.shared_dir))
    (d / "train.py").write_text(SCRIPT)
    two = test_hosts.hosts[:2]
    hostfile = test_hosts.write_hostfile(two, d / "hosts")
    yield test_hosts, two, hostfile, d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.hosts
def test_across_hosts_output_failure_ctrl_c_and_cleanup(on_hosts):
    test_hosts, two, hostfile, d = on_hosts
    opts = ["--hostfile", str(hostfile), "--n-per-node", "2", "--ssh", str(test_hosts.ssh)]
    r = tnt_run(*opts, "--output-on-all-devices", "--", "train.py", cwd=d)
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == [
        f"rank {i} of 4 on {two[i // 2].name} args [] sum 4.0" for i in range(4)
    ]
    r = tnt_run(*opts, "--", "train.py", "fail", "3", str(d), cwd=d)
    assert r.returncode == 7
    assert f"tnt-run: rank 3 on {two[1].name} failed first (exit code 7)" in r.stderr
    assert leftovers_within(two) == {}
    interrupt_and_check(d, opts, 4)
    assert leftovers_within(two) == {}
    r = tnt_run(*opts, "--cleanup", cwd=d)
    assert r.stdout.splitlines() == [f"{h.name}: ended 0 leftover rank(s)" for h in two]


# ----------------------------------------------------------------------- inside a Slurm allocation
@pytest.fixture(scope="module")
def in_slurm(slurm):
    """A work directory with the script on the test Slurm's shared storage."""
    d = Path(tempfile.mkdtemp(prefix="tnt-run-", dir=slurm.shared_dir))
    (d / "train.py").write_text(SCRIPT)
    yield slurm, d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.slurm
def test_in_an_allocation_from_salloc_and_as_the_command_of_a_batch_script(in_slurm):
    slurm, d = in_slurm
    n1, n2 = slurm.names
    pmix = {"SLURM_MPI_TYPE": "pmix"}  # a site's default PMI, which the mpich wheel cannot use
    # salloc on the login node (this machine): the allocation's nodes and tasks per node
    salloc = ["salloc", "--quiet", "--nodes=2", "--ntasks-per-node=2", TNT_RUN]
    r = slurm.client(
        [*salloc, "--output-on-all-devices", "--", "train.py", "a"], cwd=d, env=pmix, timeout=120
    )
    assert r.returncode == 0, r.stderr
    assert sorted(r.stdout.splitlines()) == [
        f"rank {i} of 4 on {(n1, n2)[i // 2]} args ['a'] sum 4.0" for i in range(4)
    ]
    # a batch script's command, ranks as tasks of srun: a killed rank is named, its status kept
    job = slurm.sbatch(
        f"#!/bin/sh\n{TNT_RUN} --launcher srun -- train.py kill 3 {d}\necho exit=$?\n",
        "--nodes=2",
        "--ntasks-per-node=2",
        f"--chdir={d}",
        f"--output={d}/job-%j.out",
        env=pmix,
    )
    slurm.wait_state(job, "COMPLETED", timeout=120)
    out = (d / f"job-{job}.out").read_text()
    assert f"tnt-run: rank 3 on {n2} died first (killed by signal SIGKILL)" in out, out
    assert "exit=137" in out and out.startswith("rank 0 of 4 on")
    assert slurm.leftovers(job) == {}

"""%tnt_cluster in a real kernel: hostfiles, usage errors, dry run, exports, start-up failures,
and nothing left behind by stop, kernel shutdown, kernel restart or a SIGKILLed kernel."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import time
from pathlib import Path

import pytest

from tests.support.kernel_driver import (
    Kernel,
    cluster_attr,
    processes_mentioning,
    running,
    wait_gone,
)
from tnt_notebook.cluster import cleanup

pytestmark = [pytest.mark.notebook, pytest.mark.mpi]


@pytest.fixture(scope="module")
def kernel(kernel_factory):
    return kernel_factory()


@pytest.fixture
def hostfile(tmp_path):
    p = tmp_path / "hosts"
    p.write_text("# the machine we run on\n\nlocalhost   # two ranks here\n")
    return p


def private_files(root: str) -> list[str]:
    """Files or dirs under root that someone other than the owner could read."""
    bad = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames, ""]:
            path = os.path.join(dirpath, name) if name else dirpath
            if stat.S_IMODE(os.stat(path).st_mode) & 0o077:
                bad.append(path)
    return bad


def test_hostfile_naming_localhost_with_two_ranks_per_node(kernel, hostfile):
    r = kernel.ok(f"%tnt_cluster --hostfile {hostfile} --n-per-node 2", timeout=120)
    assert "tnt cluster ready: 2 rank(s)" in r.stdout
    profile = kernel.value("get_ipython().magics_manager.registry['TntMagics'].cluster.profile_dir")
    assert private_files(profile) == []
    assert (Path(profile) / "security").is_dir()
    r = kernel.ok('%%tnt --all-ranks\nprint("rank", tnt.get_rank(), "of", tnt.get_size())')
    assert r.stdout == "[stdout:0]\nrank 0 of 2\n[stdout:1]\nrank 1 of 2\n"
    status = kernel.ok("%tnt_cluster status").stdout
    assert "2 rank(s), running" in status
    procs = kernel.descendants()
    assert len(processes_mentioning(profile)) >= 3  # controller, mpiexec, engines
    assert kernel.ok("%tnt_cluster stop").stdout == "tnt cluster stopped\n"
    assert wait_gone(procs, 10) == []
    assert wait_gone(processes_mentioning(profile), 5) == []  # (the watcher ends last)
    assert not Path(profile).exists()
    assert "no tnt cluster is running" in kernel.ok("%tnt_cluster status").stdout


@pytest.mark.parametrize(
    "make, options, message",
    [
        (None, "--hostfile {tmp}/missing", "does not exist"),
        ("", "--hostfile {file}", "is empty: it names no host"),
        ("# only a comment\n\n", "--hostfile {file}", "is empty"),
        ("localhost\nnode1\nlocalhost\n", "--hostfile {file}", "duplicate host 'localhost'"),
        ("bad host name\n", "--hostfile {file}", "is not a host name"),
        ("dir", "--hostfile {tmp}", "is a directory"),
        ("localhost\n", "--hostfile {file} --n-per-node 0", "--n-per-node must be a positive"),
        ("localhost\n", "--hostfile {file} --npernode -2", "--n-per-node must be a positive"),
        ("localhost\n", "--hostfile {file} --devices-per-node x", "must be a positive integer"),
        ("localhost\n", "-n 2 --hostfile {file}", "not both"),
        (None, "--n-per-node 2", "--n-per-node needs --hostfile or a Slurm allocation"),
        (None, "-n 0", "-n must be a positive integer"),
        (None, "-n 1 -x NOEQUALS", "expected NAME=VALUE"),
        (None, "-n 1 -x 1BAD=2", "is not an environment variable name"),
        (None, "-n 1 --python-interpreter /no/such/python", "is not an executable"),
        (None, "-n 1 --log-level chatty", "--log-level must be one of"),
        (None, "-n 1 --mpiexec /no/such/mpiexec", "not found"),
        (None, "bogus", "invalid choice"),
    ],
)
def test_bad_options_and_hostfiles_are_one_line_usage_errors_and_start_nothing(
    kernel, tmp_path, make, options, message
):
    file = tmp_path / "hosts"
    if make is not None and make != "dir":
        file.write_text(make)
    before = {p.pid for p in running(kernel.descendants())}
    r = kernel.execute("%tnt_cluster " + options.format(tmp=tmp_path, file=file))
    assert r.status == "error"
    assert message in r.usage_error, r.text()
    assert r.error is None or not r.traceback  # no traceback
    assert {p.pid for p in running(kernel.descendants())} == before


def test_pin_to_socket_needs_numactl(kernel):
    r = kernel.execute("%tnt_cluster -n 1 --pin-to-socket --dry-run")
    if shutil.which("numactl") is None:
        assert r.status == "error" and "needs numactl" in r.usage_error
    else:
        assert r.status == "ok" and "-m tnt_notebook.rank.pin_to_socket --" in r.stdout


def test_dry_run_prints_the_exact_commands_and_starts_nothing(kernel, hostfile):
    before = {p.pid for p in running(kernel.descendants())}
    r = kernel.ok(
        f"%tnt_cluster --hostfile {hostfile} --npernode 2 -x FOO=bar BAZ=1 "
        "--fusion-threshold 64 --no-gpu --log-level info --dry-run"
    )
    out = r.stdout
    assert "launch plan: 2 rank(s)" in out and "hosts: localhost" in out
    assert "-n 2 -f PROFILE_DIR/hostfile -ppn 2" in out
    for k, v in [
        ("TNT_NOTEBOOK_RANK", "1"),
        ("TNT_FUSION_THRESHOLD", "65536"),
        ("TNT_LOG_LEVEL", "INFO"),
        ("TNT_NO_GPU", "1"),
        ("CUDA_VISIBLE_DEVICES", "''"),
        ("FOO", "bar"),
        ("BAZ", "1"),
        ("TNT_COLLECTIVE_TIMEOUT", "30"),
    ]:
        assert f"-genv {k} {v}" in out
    assert "-m ipyparallel.engine --mpi" in out and "-m ipyparallel.controller" in out
    assert "--ip=127.0.0.1" in out
    assert {p.pid for p in running(kernel.descendants())} == before


def test_exports_reach_every_rank_and_restart_reuses_or_replaces_options(kernel, tmp_path):
    kernel.ok(
        "%tnt_cluster -n 2 -x FOO=bar --fusion-threshold 8 --no-gpu --log-level debug "
        "--output-on-all-devices --collective-timeout 12",
        timeout=120,
    )
    code = (
        "%%tnt\nimport os\n"
        "print([os.environ.get(k) for k in ('FOO', 'TNT_FUSION_THRESHOLD', 'TNT_NO_GPU',"
        " 'CUDA_VISIBLE_DEVICES', 'TNT_LOG_LEVEL', 'TNT_OUTPUT_ON_ALL_DEVICES',"
        " 'TNT_COLLECTIVE_TIMEOUT', 'TNT_NOTEBOOK_RANK')], os.getcwd(), os.getpid())"
    )
    cwd = kernel.value("__import__('os').getcwd()")
    r = kernel.ok(code)  # --output-on-all-devices: every rank shows, merged
    lines = r.stdout.splitlines()
    assert lines[0] == "[stdout:0]" and lines[2] == "[stdout:1]", r.stdout
    values = ["bar", "8192", "1", "", "DEBUG", "1", "12", "1"]
    for line in (lines[1], lines[3]):
        assert line.startswith(f"{values!r} {cwd} ")
    pids = {lines[1].split()[-1], lines[3].split()[-1]}
    kernel.ok("%tnt_cluster restart", timeout=120)  # same options again
    r = kernel.ok(code)
    new_lines = r.stdout.splitlines()
    assert new_lines[1].startswith(f"{values!r}")
    assert {new_lines[1].split()[-1], new_lines[3].split()[-1]}.isdisjoint(pids)
    kernel.ok("%tnt_cluster restart -n 3", timeout=120)  # new options replace the old
    assert kernel.ok("%%tnt\nimport os\nprint(tnt.get_size(), os.environ.get('FOO'))").stdout == (
        "3 None\n"
    )
    kernel.ok("%tnt_cluster stop")


def test_start_up_failure_names_the_ranks_shows_launcher_stderr_and_leaves_nothing(
    kernel, tmp_path
):
    broken = tmp_path / "broken-python"
    broken.write_text("#!/bin/sh\necho 'this python cannot start an engine' >&2\nexit 3\n")
    broken.chmod(0o755)
    before = {p.pid for p in running(kernel.descendants())}
    r = kernel.execute(f"%tnt_cluster -n 2 --python-interpreter {broken}", timeout=120)
    assert r.status == "error" and r.error["ename"] == "ClusterStartError"
    assert "rank(s) 0-1 on host(s) localhost did not come up" in r.traceback
    assert "the MPI launcher exited" in r.traceback
    assert "--- launcher stderr ---\nthis python cannot start an engine" in r.traceback
    assert wait_gone([p for p in kernel.descendants() if p.pid not in before], 10) == []
    r = kernel.execute("%tnt_cluster -n 2 --timeout 0.3", timeout=120)
    assert r.status == "error" and r.error["ename"] == "ClusterStartError"
    assert "within 0.3 s" in r.traceback and "rank(s) 0-1" in r.traceback
    # a controller still silent then is made to show where it was (its fault handler's dump)
    assert "--- controller (exited -6) ---" in r.traceback
    assert "(most recent call first)" in r.traceback
    assert wait_gone([p for p in kernel.descendants() if p.pid not in before], 10) == []
    assert "no tnt cluster is running" in kernel.ok("%tnt_cluster status").stdout


def _start_and_snapshot(k: Kernel, n: int = 2) -> tuple[list, str]:
    k.ok(f"%tnt_cluster -n {n}", timeout=120)
    profile = k.value("get_ipython().magics_manager.registry['TntMagics'].cluster.profile_dir")
    procs = running(k.descendants())
    assert len(procs) >= n + 2
    return procs, profile


def test_kernel_shutdown_and_restart_leave_no_process_or_file(kernel_factory):
    k = kernel_factory()
    procs, profile = _start_and_snapshot(k)
    k.km.restart_kernel(now=False)
    assert wait_gone(procs, 20) == []
    assert not Path(profile).exists()
    k.kc.wait_for_ready(timeout=60)
    k.pid = k.km.provisioner.process.pid
    k.ok("%load_ext tnt_notebook")
    procs, profile = _start_and_snapshot(k, 1)
    k.ok("%unload_ext tnt_notebook")  # %reload_ext must not leave a world behind
    assert wait_gone(procs, 20) == []
    k.ok("%load_ext tnt_notebook")
    procs, profile = _start_and_snapshot(k)
    k.km.shutdown_kernel(now=False)
    assert wait_gone(procs, 20) == []
    assert not Path(profile).exists()


def test_stop_returns_and_leaves_nothing_when_a_rank_does_not_answer(kernel):
    """A rank that cannot answer the shutdown request (here: stopped; in life: stuck in C code
    holding the GIL) is signalled after a grace period instead of being waited for forever."""
    procs, profile = _start_and_snapshot(kernel)
    pids = kernel.value(
        "[r.pid for r in get_ipython().magics_manager.registry['TntMagics'].cluster.ranks]"
    )
    os.kill(pids[1], signal.SIGSTOP)
    t0 = time.monotonic()
    r = kernel.ok("%tnt_cluster stop", timeout=60)
    assert time.monotonic() - t0 < 15, r.text()
    assert wait_gone(procs, 10) == [], [p.cmdline() for p in running(procs)]
    assert not Path(profile).exists()
    assert "no tnt cluster is running" in kernel.ok("%tnt_cluster status").stdout


def test_a_sigkilled_kernel_takes_its_cluster_down(kernel_factory):
    """Every rank, proxy and nanny ends, even a nanny that cannot end by itself (stopped here; in
    life one that waits forever to tell a controller that is gone that its engine ended): the
    host's watcher ends it after its ranks."""
    k = kernel_factory()
    procs, profile = _start_and_snapshot(k)
    nannies = [p for p in procs if "ipyparallel.engine.nanny" in p.cmdline()]
    assert len(nannies) == 2
    nannies[0].suspend()
    os.kill(k.pid, signal.SIGKILL)
    t0 = time.monotonic()
    assert wait_gone(procs, 30) == [], [p.cmdline() for p in running(procs)]
    assert time.monotonic() - t0 < 30
    assert private_files(profile) == []  # what is left is owner-only ...
    from tnt_notebook.cluster.lifecycle import Cluster

    with Cluster(n=1):  # ... and the next start removes it
        pass
    assert not Path(profile).exists()


def test_ranks_killed_with_their_kernel_leave_no_shared_memory_segment(kernel_factory):
    """Ranks SIGKILLed with their kernel (an out-of-memory kill) never run MPI_Finalize, so
    MPICH's segments stay in /dev/shm: the host's watcher removes them once the ranks are gone
    (looked at here, before any sweep of the session's)."""
    k = kernel_factory()
    procs, _ = _start_and_snapshot(k)
    mapping = {p.pid: cleanup._segments_of(p.pid) for p in procs}
    segments = set().union(*mapping.values())
    assert segments
    os.kill(k.pid, signal.SIGKILL)
    for pid, mapped in mapping.items():
        if mapped:  # a rank
            os.kill(pid, signal.SIGKILL)
    t0 = time.monotonic()
    assert wait_gone(procs, 30) == [], [p.cmdline() for p in running(procs)]
    # the watcher is detached (not among procs): give it the moment it needs after the ranks
    while left := sorted(n for n in segments if (cleanup.SHM_DIR / n).exists()):
        assert time.monotonic() - t0 < 45, f"left in /dev/shm: {left}"
        time.sleep(0.1)


def test_a_hostfile_naming_this_machine_by_address_listens_there_only_and_encrypts(
    kernel, tmp_path
):
    """A host that is not loopback by name: the controller listens on the address the host
    reaches (not on every interface), and every connection uses CurveZMQ."""
    from tnt_notebook.cluster.addresses import route_source

    address = route_source("10.255.255.255")  # this machine's address on its default route
    if address.startswith("127."):
        pytest.skip("this machine has no network address besides loopback")
    hosts = tmp_path / "hosts"
    hosts.write_text(address + "\n")
    r = kernel.ok(f"%tnt_cluster --hostfile {hosts} --n-per-node 2 --dry-run")
    assert f"controller listens on {address};" in r.stdout and f"--ip={address}" in r.stdout
    assert "encrypted (CurveZMQ)" in r.stdout
    kernel.ok(f"%tnt_cluster --hostfile {hosts} --n-per-node 2", timeout=120)
    try:
        r = kernel.ok('%%tnt --all-ranks\nprint("rank", tnt.get_rank(), "of", tnt.get_size())')
        assert r.stdout == "[stdout:0]\nrank 0 of 2\n[stdout:1]\nrank 1 of 2\n"
        # the client knows the controller's public key (40 characters of Z85, never empty),
        # and the controller was started with CurveZMQ and that very key pair
        public = cluster_attr(kernel, "client.curve_serverkey.decode()")
        assert len(public) == 40, public
        config = Path(cluster_attr(kernel, "profile_dir"), "ipcontroller_config.py").read_text()
        assert "c.IPController.enable_curve = True" in config
        assert f"c.IPController.curve_publickey = b'{public}'" in config
    finally:
        kernel.ok("%tnt_cluster stop")


def test_cluster_magics_without_a_cluster_are_usage_errors(kernel):
    kernel.ok("%tnt_cluster stop")  # nothing running: says so, no error
    for line, message in [
        ("%%tnt\nprint(1)", "no tnt cluster is running"),
        ("%tnt_pull x", "no tnt cluster is running"),
        ("x = 1\n%tnt_push x", "no tnt cluster is running"),
    ]:
        r = kernel.execute(line)
        assert r.status == "error" and message in r.usage_error, r.text()


def test_pin_to_socket_wraps_each_rank_in_numactl_on_its_node(tmp_path):
    """The rank-side wrapper (python -m tnt_notebook.rank.pin_to_socket -- CMD), run under mpiexec
    with a stand-in numactl that records its arguments and runs the command."""
    import subprocess
    import sys

    from tnt_notebook.cluster.launchers import default_mpiexec

    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "numactl"
    fake.write_text('#!/bin/sh\necho "numactl $1 $2" >> "$PIN_LOG"\nshift 2\nexec "$@"\n')
    fake.chmod(0o755)
    log = tmp_path / "pin.log"
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "PIN_LOG": str(log)}
    cmd = [
        default_mpiexec(),
        "-n",
        "2",
        sys.executable,
        "-m",
        "tnt_notebook.rank.pin_to_socket",
        "--",
        sys.executable,
        "-c",
        "print('pinned child ran')",
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("pinned child ran") == 2
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*"))
    expected = {int(nodes[r % len(nodes)].name[4:]) if nodes else 0 for r in range(2)}
    lines = log.read_text().splitlines()
    assert len(lines) == 2
    assert {int(line.split("--cpunodebind=")[1].split()[0]) for line in lines} == expected
    assert all(f"--membind={line.split('--cpunodebind=')[1].split()[0]}" in line for line in lines)

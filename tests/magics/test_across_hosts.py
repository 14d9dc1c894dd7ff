"""%tnt_cluster across the test hosts (tests/testhosts.py): a real kernel whose ranks run on two
hosts reached through their sshd, two ranks each: placement, nodes, collectives, training equal to
serial Keras, cells, data, security, faults, and nothing left on any host."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.kernel_driver import (
    Kernel,
    assert_death_named_by_the_next_cell,
    cluster_attr,
    start_fit,
    stopped_by_fail_fast,
)
from tests.support.testhosts import CHECKOUT, leftovers_within

pytestmark = [pytest.mark.notebook, pytest.mark.mpi, pytest.mark.hosts]

PER_HOST = 2
COLLECTIVE_TIMEOUT = 8


@pytest.fixture(scope="module")
def hosts(test_hosts):
    """The first two test hosts, their hostfile and a notebook directory they all see."""
    two = test_hosts.hosts[:2]
    nb = Path(tempfile.mkdtemp(prefix="nb-", dir=test_hosts.shared_dir))
    hostfile = test_hosts.write_hostfile(two, nb / "hosts")
    yield test_hosts, two, hostfile, nb
    shutil.rmtree(nb, ignore_errors=True)


@pytest.fixture(scope="module")
def kernel(kernel_factory, hosts):
    test_hosts, two, hostfile, nb = hosts
    k = kernel_factory(cwd=nb)
    start(k, hostfile, test_hosts.ssh)
    return k


def start(k: Kernel, hostfile: Path, ssh: Path) -> None:
    r = k.ok(
        f"%tnt_cluster --hostfile {hostfile} --n-per-node {PER_HOST} --ssh {ssh}"
        f" --collective-timeout {COLLECTIVE_TIMEOUT}",
        timeout=120,
    )
    assert f"tnt cluster ready: {2 * PER_HOST} rank(s)" in r.stdout, r.text()


def test_ranks_are_numbered_host_by_host_and_status_names_each_hosts_own_name(kernel, hosts):
    _, two, _, _ = hosts
    status = kernel.ok("%tnt_cluster status").stdout
    rows = re.findall(r"^\s+(\d+)\s+(\S+)\s+(\d+)\s+yes\s+CPU$", status, re.M)
    assert [(int(r), h) for r, h, _ in rows] == [
        (r, two[r // PER_HOST].name) for r in range(2 * PER_HOST)
    ], status
    for _, name, pid in rows:  # each rank runs where status says, with that pid there
        host = next(h for h in two if h.name == name)
        assert "ipyparallel.engine" in host.run(["cat", f"/proc/{pid}/cmdline"]).stdout
    r = kernel.ok(
        "%%tnt --all-ranks\nimport socket\nfrom tnt_notebook.rank import api as ranks\n"
        "i = ranks.engine_info()\n"
        "print(socket.gethostname(), i['num_nodes'], i['local_rank'], i['local_size'])"
    )
    expected = "".join(
        f"[stdout:{r}]\n{two[r // PER_HOST].name} 2 {r % PER_HOST} {PER_HOST}\n"
        for r in range(2 * PER_HOST)
    )
    assert r.stdout == expected


def test_collectives_of_every_op_and_dtype_across_hosts(kernel):
    r = kernel.ok(
        "%%tnt\nfrom tests.support import world_checks as w\n"
        # sizes within one bucket, across buckets (the 2 MB slot) and a fused gradient list
        "checks = w.matrix([0, 1, 7, 1001, (33, 65)]) + w.matrix([1_100_001], ops=['sum', 'max'])\n"
        "buckets = [w.fused(t) for t in (0, None)]\n"
        "print(checks, buckets[0] > buckets[1] > 0, tnt.broadcast(tnt.get_rank() + 7, root=3))",
        timeout=300,
    )
    assert r.stdout == "132 True 10\n", r.text()


def test_model_fit_evaluate_predict_across_hosts_equal_serial_keras(kernel):
    code = """%%tnt
from tests.keras import equivalence_worker as e
print(e.summary_on_ranks(("dense_sgd",), 1e-5))
"""
    r = kernel.ok(code, timeout=400)
    result = [line for line in r.stdout.splitlines() if line.startswith("RESULT")]
    assert result and result[0].split()[1:3] == ["True", "True"], r.text()


def test_output_tracebacks_and_fail_fast_with_remote_ranks(kernel):
    r = kernel.ok('%%tnt --all-ranks\nimport socket\nprint("same")\nprint(socket.gethostname())')
    assert r.stdout.startswith("[stdout:0-3]\nsame\n")
    t0 = time.monotonic()
    r = kernel.execute(
        "%%tnt --fail-fast-timeout 6\nimport numpy as np\n"
        'if tnt.get_rank() == 3:\n    raise RuntimeError("remote rank gives up")\n'
        "tnt.allreduce(np.ones(4))",
        timeout=120,
    )
    assert r.status == "error"
    assert "[rank 3] RuntimeError: remote rank gives up" in r.traceback
    assert stopped_by_fail_fast(r.traceback, 4) == [0, 1, 2], r.traceback
    assert time.monotonic() - t0 < 6
    assert "DEAD" not in kernel.ok("%tnt_cluster status").stdout
    # the next cell's collectives work on every rank of every host
    r = kernel.ok("%%tnt --all-ranks\nprint(tnt.allreduce(1.0))\ntnt.barrier()", timeout=60)
    assert r.stdout == "[stdout:0-3]\n4.0\n", r.text()


def test_interrupt_reaches_remote_ranks(kernel):
    msg_id = kernel.send("%%tnt\nimport time\nfor _ in range(600):\n    time.sleep(0.1)")
    time.sleep(3)
    kernel.km.interrupt_kernel()
    r = kernel.collect(msg_id, timeout=60)
    assert r.status == "error" and "KeyboardInterrupt" in r.traceback, r.text()
    assert kernel.ok("%%tnt\nprint(tnt.get_size())").stdout == "4\n"


def test_pull_and_push_with_remote_ranks(kernel):
    kernel.ok("import numpy as np\nbig = np.arange(300_000, dtype='float64')\n%tnt_push big")
    kernel.ok("%%tnt\nmine = float(big.sum()) + tnt.get_rank()")
    kernel.ok("%tnt_pull --all-ranks mine")
    total = 300_000 * 299_999 / 2
    assert kernel.value("mine") == [total + r for r in range(4)]
    kernel.ok("%tnt_pull --targets 3 mine")
    assert kernel.value("mine") == total + 3


def test_no_key_or_pushed_value_on_a_command_line_in_an_environment_or_a_readable_file(
    kernel, hosts
):
    test_hosts, two, _, _ = hosts
    profile = cluster_attr(kernel, "profile_dir")
    key = cluster_attr(kernel, "client.session.key.decode()")
    public = cluster_attr(kernel, "client.curve_serverkey.decode()")
    secret = re.search(
        r"curve_secretkey = b'(.+)'", Path(profile, "ipcontroller_config.py").read_text()
    ).group(1)
    kernel.ok("password = 'hunter2-' + 'x' * 8\n%tnt_push password")
    pushed = "hunter2-xxxxxxxx"
    secrets = {"key": key, "public key": public, "secret key": secret, "pushed": pushed}
    # a process that user code starts on a rank inherits no key
    r = kernel.ok(
        "%%tnt --all-ranks\nimport subprocess\nprint(subprocess.run('env', text=True,"
        " capture_output=True).stdout.count(" + repr(key) + "))"
    )
    assert r.stdout == "[stdout:0-3]\n0\n"
    pattern = ["-e", key, "-e", public, "-e", secret, "-e", pushed]
    for h in [None, *two]:  # this machine, then inside each host
        run = h.run if h else lambda cmd, **kw: subprocess.run(cmd, capture_output=True, text=True)
        ps = run(["ps", "-eo", "args"]).stdout
        assert not [name for name, value in secrets.items() if value in ps], h
        # files that others may read, where processes write (not the checkout, where it lies
        # in /tmp: the code, not what runs writes)
        places = ["/tmp", "/dev/shm"] if h else [tempfile.gettempdir(), "/dev/shm"]
        skip = [str(p) for p in (h.shown_from_this_machine() if h else CHECKOUT)]
        pruned = [a for p in skip for a in ("-path", p, "-o")][:-1]
        find = ["find", *places, "(", *pruned, ")", "-prune", "-o", "-type", "f", "-perm", "/044"]
        readable = run([*find, "-print"]).stdout.split()
        if readable:
            found = run(["grep", "-l", "-F", *pattern, *readable], check=False).stdout
            assert found == "", (h, found)
    # environments: only the launcher, the ranks and their nannies (which connect) hold the key
    holders = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if key.encode() in environ.read_bytes():
                holders.append(Path(environ.parent, "cmdline").read_bytes().split(b"\0")[:3])
        except OSError:
            continue
    allowed = (b"mpiexec", b"ipyparallel.engine", b"ipyparallel.engine.nanny")
    assert holders and all(any(a in b" ".join(h) for a in allowed) for h in holders), holders


INTRUDER = r"""
import json, sys, time, zmq
ports = json.loads(sys.argv[1])
marker = sys.argv[2].encode()
ctx = zmq.Context()
heard = []

def listen(sock, seconds):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if sock.poll(100):
            heard.append(b"".join(sock.recv_multipart()))

subs = []
for port in ports["iopub"]:
    s = ctx.socket(zmq.SUB)
    s.setsockopt(zmq.SUBSCRIBE, b"")
    s.connect(port)
    subs.append(s)
# a registration request (engine side) and an execute request (client side), signed with a guess
reg = ctx.socket(zmq.DEALER)
reg.connect(ports["registration"])
reg.send_multipart([b"<IDS|MSG>", b"0" * 64, json.dumps({"msg_id": "x", "msg_type":
    "registration_request", "session": "s", "username": "u", "version": "5.4"}).encode(),
    b"{}", b"{}", json.dumps({"uuid": "intruder", "id": 99}).encode()])
mux = ctx.socket(zmq.DEALER)
mux.connect(ports["mux"])
code = "open(%r, 'w').write('owned')" % sys.argv[3]
mux.send_multipart([b"<IDS|MSG>", b"0" * 64, json.dumps({"msg_id": "y", "msg_type":
    "execute_request", "session": "s", "username": "u", "version": "5.4"}).encode(),
    b"{}", b"{}", json.dumps({"code": code, "silent": False}).encode()])
print("READY", flush=True)
for s in (*subs, reg, mux):
    listen(s, 2 if s in subs else 0.5)
print("HEARD", len(heard), sum(marker in m for m in heard), flush=True)
"""


def test_a_process_knowing_the_ports_but_not_the_keys_can_neither_register_read_nor_inject(
    kernel, hosts
):
    """From the third test host (not in the cluster), on the network the ranks use."""
    test_hosts, _, _, nb = hosts
    outsider = test_hosts.hosts[2]
    profile = cluster_attr(kernel, "profile_dir")
    cid = cluster_attr(kernel, "cluster_id")
    security = Path(profile, "security")
    client = json.loads((security / f"ipcontroller-{cid}-client.json").read_text())
    engine = json.loads((security / f"ipcontroller-{cid}-engine.json").read_text())
    iface = client["interface"]
    ports = {
        "iopub": [f"{iface}:{client['iopub']}", f"{iface}:{engine['iopub']}"],
        "registration": f"{iface}:{engine['registration']}",
        "mux": f"{iface}:{client['mux']}",
    }
    owned = nb / "owned"
    intruder = subprocess.Popen(
        outsider.command([sys.executable, "-c", INTRUDER, json.dumps(ports), "MARK3R", str(owned)]),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert intruder.stdout.readline().strip() == "READY", intruder.stderr.read()
        kernel.ok("%%tnt\nfor _ in range(5):\n    print('MARK3R', flush=True)")
        out, err = intruder.communicate(timeout=60)
    finally:
        if intruder.poll() is None:
            intruder.kill()
            intruder.wait()
    assert out.split() == ["HEARD", "0", "0"], (out, err)
    assert not owned.exists()
    assert cluster_attr(kernel, "client.ids") == [0, 1, 2, 3]


def test_cleanup_ends_leftover_ranks_on_the_hosts_and_keeps_the_running_cluster(kernel, hosts):
    _, two, _, _ = hosts
    # what a rank of a cluster that lost its notebook looks like to `ps`
    stale = [sys.executable, "-c", "import time; time.sleep(300)", "-m", "ipyparallel.engine"]
    stale += ["--IPEngine.init_mpi=import tnt_notebook as tnt", "--cluster-id=stale0"]
    leftovers = [subprocess.Popen(h.command(stale), start_new_session=True) for h in two]
    try:
        r = kernel.ok("%tnt_cluster cleanup", timeout=60)
        assert r.stdout.splitlines() == [
            f"{h.name}: ended 1 leftover rank(s) of cluster(s) stale0" for h in two
        ]
        for p in leftovers:
            assert p.wait(10) == -signal.SIGTERM
    finally:
        for p in leftovers:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert "yes" in kernel.ok("%tnt_cluster status").stdout
    assert kernel.ok("%%tnt\nprint(tnt.allreduce(1.0))").stdout == "4.0\n"


@contextlib.contextmanager
def restarted_after(kernel: Kernel):
    """Restarts the cluster after a test that kills it, also when the test fails (the module's
    later tests need it)."""
    try:
        yield
    finally:
        restart = kernel.execute("%tnt_cluster restart", timeout=120)
    assert restart.status == "ok", restart.text()
    assert kernel.ok("%%tnt\nprint(tnt.allreduce(1.0))").stdout == "4.0\n"


def test_a_rank_killed_on_a_remote_host_mid_fit_is_named_not_its_host(kernel, hosts):
    _, two, _, nb = hosts
    pids = kernel.value(
        "[r.pid for r in get_ipython().magics_manager.registry['TntMagics'].cluster.ranks]"
    )
    msg_id = start_fit(kernel, nb)
    t0 = time.monotonic()
    two[1].run(["kill", "-KILL", str(pids[3])])
    with restarted_after(kernel):
        r = kernel.collect(msg_id, timeout=120)
        assert time.monotonic() - t0 < 30
        assert r.status == "error" and r.error["ename"] == "ClusterDeadError", r.text()
        assert re.search(
            rf"rank\(s\) 3 died \(rank 3: pid {pids[3]} on {two[1].name}\)", r.traceback
        )
        assert "rank(s) 2-3" not in r.traceback
        status = kernel.ok("%tnt_cluster status").stdout
        assert "DEAD: rank(s) 3 died" in status


def test_a_rank_killed_on_a_remote_host_between_cells_is_named_with_its_host(kernel, hosts):
    _, two, _, _ = hosts
    pids = kernel.value(
        "[r.pid for r in get_ipython().magics_manager.registry['TntMagics'].cluster.ranks]"
    )
    two[1].run(["kill", "-KILL", str(pids[3])])
    with restarted_after(kernel):
        assert_death_named_by_the_next_cell(kernel, 3, two[1].name, pids[3])


def assert_the_cut_host_is_named(r, elapsed: float, cut) -> None:
    """A fit whose second host (ranks 2 and 3) was cut off ended within the collective timeout
    (the survivors' collective times out; the hub declares the lost engines dead, 10 s), with
    an error that names the host and its ranks."""
    assert elapsed < COLLECTIVE_TIMEOUT + 15, elapsed
    assert r.status == "error" and r.error["ename"] == "ClusterDeadError", r.text()
    assert re.search(r"rank\(s\) [23]", r.traceback) and cut.name in r.traceback, r.traceback
    # (the survivors' own errors follow when they timed out before the hub lost the engines:
    # they name the lost host's ranks, never a survivor; a call site on MPI_Allreduce's path
    # names every other rank of the world)
    if "timed out after" in r.traceback:
        lost = r"timed out after 8 s: the exchange with rank\(s\) (\d, )*[23] "
        assert re.search(lost, r.traceback), r.traceback
        assert "did not arrive" not in r.traceback, r.traceback


@pytest.mark.slow  # (the next test cuts a host off mid-fit too, then resumes the fit)
def test_a_host_cut_off_mid_fit_raises_within_the_collective_timeout_and_restart_works(
    kernel, hosts
):
    _, two, _, nb = hosts
    msg_id = start_fit(kernel, nb)
    two[1].link_down()
    t0 = time.monotonic()
    with restarted_after(kernel):
        try:
            r = kernel.collect(msg_id, timeout=120)
            elapsed = time.monotonic() - t0
        finally:
            two[1].link_up()
        assert_the_cut_host_is_named(r, elapsed, two[1])


BACKUP_FIT = """%%tnt
import pathlib, time
import numpy as np, keras

class CutAtEpoch3(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 2 and tnt.is_master_rank():
            pathlib.Path({flag!r}).touch()  # the test cuts the second host off now
            time.sleep(1)

x = np.random.default_rng(0).random((1024, 16), dtype="float32")
y = (x.sum(axis=1) > 8).astype("int32")

def make():
    keras.utils.set_random_seed(3)
    m = tnt.Model(keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(2)]))
    m.compile(optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m

m = make()
history = m.fit(x, y, batch_size=64, epochs=4, verbose=0, callbacks=[
    keras.callbacks.BackupAndRestore({backup!r}), *([CutAtEpoch3()] if {cut} else [])])
"""


def test_a_fit_that_loses_a_host_resumes_from_the_masters_own_backup(kernel, hosts):
    # the backup goes to /tmp, which every test host has for itself: only the master's host
    # holds it, and the rerun reads it there
    _, two, _, nb = hosts
    backup = f"/tmp/tnt-backup-{time.monotonic_ns()}"
    flag = nb / f"cut-{time.monotonic_ns()}"
    try:
        msg_id = kernel.send(BACKUP_FIT.format(flag=str(flag), backup=backup, cut=True))
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert time.monotonic() < deadline, "the fit did not reach its third epoch in 120 s"
            time.sleep(0.02)
        two[1].link_down()
        t0 = time.monotonic()
        try:
            r = kernel.collect(msg_id, timeout=120)
            elapsed = time.monotonic() - t0
        finally:
            two[1].link_up()
        assert_the_cut_host_is_named(r, elapsed, two[1])
        held = [h.run(["ls", backup], check=False).returncode == 0 for h in two]
        assert held == [True, False]
        kernel.ok("%tnt_cluster restart", timeout=120)
        kernel.ok(BACKUP_FIT.format(flag=str(flag), backup=backup, cut=False), timeout=180)
        out = kernel.ok(
            "%%tnt\nresumed = history.history['loss']\nref = make()\n"
            "uninterrupted = ref.fit(x, y, batch_size=64, epochs=4, verbose=0).history['loss']\n"
            "same = all(np.allclose(a, b, rtol=0, atol=1e-6)\n"
            "           for a, b in zip(ref.get_weights(), m.get_weights()))\n"
            "print(len(resumed), same, np.allclose(resumed, uninterrupted, rtol=1e-6))",
            timeout=180,
        )
        assert out.stdout == "4 True True\n"
        assert two[0].run(["ls", backup], check=False).returncode != 0  # removed once complete
    finally:  # (a failure here must not fail the module's later checks for leftovers)
        for h in two:
            h.run(["rm", "-rf", backup], check=False)


def test_stop_leaves_nothing_on_any_host(kernel, hosts):
    _, two, _, _ = hosts
    profile = cluster_attr(kernel, "profile_dir")
    kernel.ok("%tnt_cluster stop", timeout=60)
    assert leftovers_within(two) == {}
    assert not Path(profile).exists()


def test_a_start_that_times_out_while_remote_ranks_start_leaves_nothing_on_any_host(kernel, hosts):
    test_hosts, two, hostfile, _ = hosts
    r = kernel.execute(
        f"%tnt_cluster --hostfile {hostfile} --n-per-node {PER_HOST} --ssh {test_hosts.ssh}"
        " --timeout 2",
        timeout=120,
    )
    assert r.status == "error" and r.error["ename"] == "ClusterStartError", r.text()
    assert "within 2 s" in r.traceback
    assert leftovers_within(two, timeout=5) == {}
    assert "no tnt cluster is running" in kernel.ok("%tnt_cluster status").stdout


def test_a_host_whose_sshd_is_down_at_start_is_named_and_nothing_is_left(kernel, hosts):
    test_hosts, two, hostfile, _ = hosts
    two[1].stop_sshd()
    try:
        t0 = time.monotonic()
        r = kernel.execute(
            f"%tnt_cluster --hostfile {hostfile} --n-per-node {PER_HOST} --ssh {test_hosts.ssh}",
            timeout=120,
        )
        assert time.monotonic() - t0 < 30
        assert r.status == "error" and r.error["ename"] == "ClusterStartError", r.text()
        assert f"ssh cannot reach {two[1].name} (Connection refused)" in r.traceback
        assert leftovers_within(two) == {}
    finally:
        two[1].start_sshd()
    assert "no tnt cluster is running" in kernel.ok("%tnt_cluster status").stdout


def test_kernel_shutdown_and_a_sigkilled_kernel_leave_nothing_on_any_host(kernel_factory, hosts):
    """Three hosts, one rank each."""
    test_hosts, _, _, nb = hosts
    three = test_hosts.hosts
    hostfile = test_hosts.write_hostfile(three, nb / "three")
    for end in ("shutdown", "SIGKILL"):
        k = kernel_factory(cwd=nb)
        r = k.ok(f"%tnt_cluster --hostfile {hostfile} --ssh {test_hosts.ssh}", timeout=120)
        assert "tnt cluster ready: 3 rank(s)" in r.stdout
        r = k.ok("%%tnt --all-ranks\nimport socket\nprint(socket.gethostname())")
        assert r.stdout == "".join(f"[stdout:{i}]\n{h.name}\n" for i, h in enumerate(three))
        profile = cluster_attr(k, "profile_dir")
        if end == "shutdown":
            k.km.shutdown_kernel(now=False)
        else:
            os.kill(k.pid, signal.SIGKILL)
        assert leftovers_within(three, timeout=30) == {}, end
        if end == "shutdown":
            assert not Path(profile).exists()

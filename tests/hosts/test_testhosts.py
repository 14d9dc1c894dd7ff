"""The test hosts themselves: separate machines as MPI and ssh see them, faults that act, and
nothing left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import testhosts
from tests.support.testhosts import TestHosts, running, unavailable

pytestmark = pytest.mark.hosts


def ssh(hosts: TestHosts, host: str, command: str, timeout: float = 20):
    return subprocess.run(
        [str(hosts.ssh), host, command], capture_output=True, text=True, timeout=timeout
    )


def test_each_host_is_its_own_machine_reached_by_ssh(test_hosts):
    names = test_hosts.names
    assert test_hosts.hostfile.read_text().split() == names
    ipc = set()
    for h in test_hosts.hosts:
        r = ssh(
            test_hosts,
            h.name,
            f"hostname; readlink /proc/self/ns/ipc; touch /dev/shm/mine /tmp/mine"
            f" {test_hosts.shared_dir}/{h.name}",
        )
        assert r.returncode == 0, r.stderr
        name, ns = r.stdout.split()
        assert name == h.name
        ipc.add(ns)
        assert sorted(h.leftovers()) == ["/dev/shm/mine", "/tmp/mine"]  # private to the host
        h.run("rm /dev/shm/mine /tmp/mine")
    assert len(ipc) == len(names) and os.readlink("/proc/self/ns/ipc") not in ipc
    assert not Path("/dev/shm/mine").exists() and not Path("/tmp/mine").exists()
    assert sorted(p.name for p in test_hosts.shared_dir.iterdir()) == names
    # hosts reach each other by name
    r = ssh(test_hosts, names[0], f"getent hosts {names[1]}")
    assert r.stdout.split()[0] == test_hosts.hosts[1].address
    for name in names:
        (test_hosts.shared_dir / name).unlink()
    assert all(h.leftovers() == [] for h in test_hosts.hosts)


def test_mpi_sees_one_node_per_host(test_hosts):
    mpiexec = str(Path(sys.executable).parent / "mpiexec")
    code = (
        "from mpi4py import MPI; import socket; c = MPI.COMM_WORLD;"
        "s = c.Split_type(MPI.COMM_TYPE_SHARED);"
        "rows = c.gather((c.rank, socket.gethostname(), s.size, c.allreduce(1)));"
        "c.rank or print(rows)"
    )
    r = subprocess.run(
        [
            mpiexec,
            "-f",
            str(test_hosts.hostfile),
            "-ppn",
            "1",
            "-n",
            "3",
            sys.executable,
            "-c",
            code,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **test_hosts.env},
    )
    assert r.returncode == 0, r.stderr
    # one line (Hydra may interleave the lines of ranks on different hosts)
    assert r.stdout == f"{[(i, name, 1, 3) for i, name in enumerate(test_hosts.names)]}\n"


def test_link_down_sshd_down_and_shaping_act_and_are_undone(test_hosts):
    h = test_hosts.hosts[-1]
    try:
        h.link_down()
        t0 = time.monotonic()
        r = ssh(test_hosts, h.name, "true")
        # dropped packets time out; with no neighbour entry cached, ARP gives up first
        assert r.returncode == 255
        assert "timed out" in r.stderr or "No route to host" in r.stderr, r.stderr
        assert time.monotonic() - t0 < 15
        h.link_up()
        assert ssh(test_hosts, h.name, "true").returncode == 0
        h.stop_sshd()
        r = ssh(test_hosts, h.name, "true")
        assert r.returncode == 255 and "refused" in r.stderr
        h.start_sshd()
        assert ssh(test_hosts, h.name, "true").returncode == 0
        h.shape("200mbit")
        assert "tbf" in h.run("tc qdisc show dev eth0").stdout
        assert (
            "rate 200Mbit"
            in subprocess.run(
                ["tc", "qdisc", "show", "dev", h.veth], capture_output=True, text=True
            ).stdout
        )
        h.unshape()
        assert "tbf" not in h.run("tc qdisc show dev eth0").stdout
    finally:
        h.link_up()
        h.unshape()
        if h.sshd is None:
            h.start_sshd()


RECEIVE = """
import socket, sys
s = socket.create_server((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
c, _ = s.accept()
n = 0
while chunk := c.recv(1 << 20):
    n += len(chunk)
print(n, flush=True)
"""
SEND = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2]))) as c:
    c.sendall(bytes(int(sys.argv[3])))
"""


def shaper_counts(host) -> tuple[int, int, int]:
    """What the host's shaper on eth0 has sent (bytes, packets of one MTU) and how often a packet
    had to wait for the rate (overlimits: each wait is a timer and a softirq)."""
    words = host.run(["tc", "-s", "qdisc", "show", "dev", "eth0"]).stdout.replace(",", "").split()
    at = words.index("Sent")
    return int(words[at + 1]), int(words[at + 3]), int(words[words.index("overlimits") + 1])


def test_a_shaped_link_takes_tcp_segments_whole_as_a_nic_with_tso_does(test_hosts):
    # tbf cuts a packet longer than its burst into one per MTU in software, each a softirq on the
    # cores the ranks compute on; shape() caps TCP's segments below the burst instead
    sender, receiver = test_hosts.hosts[0], test_hosts.hosts[1]
    size = 2 * 1024**2
    listener = subprocess.Popen(
        receiver.command([sys.executable, "-c", RECEIVE, receiver.address]),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        sender.shape("200mbit", burst="32kb")
        port = listener.stdout.readline().strip()
        sender.run([sys.executable, "-c", SEND, receiver.address, port, str(size)])
        assert int(listener.communicate(timeout=30)[0]) == size
        sent, packets, waits = shaper_counts(sender)
        assert sent >= size
        # cut into packets of one MTU, about every one of them waits for the rate (1-1.5 per packet)
        assert waits * 3 < packets, f"{waits} waits for {packets} packets of one MTU"
        cap = f"gso_max_size {testhosts.segment_cap('32kb')} "
        assert cap in sender.run(["ip", "-d", "link", "show", "eth0"]).stdout
        sender.unshape()
        assert "gso_max_size 65536 " in sender.run(["ip", "-d", "link", "show", "eth0"]).stdout
    finally:
        sender.unshape()
        listener.kill()
        listener.wait()


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_down_leaves_no_namespace_link_process_or_file():
    with TestHosts(1) as th:
        h = th.hosts[0]
        # a process started over ssh that would outlive its session
        r = ssh(th, h.name, "nohup sleep 300 >/dev/null 2>&1 &")
        assert r.returncode == 0
        assert any("sleep 300" in p for p in h.leftovers())
        pids, workdir = h.pids(), th.workdir
    assert th.leftovers() == []
    assert not workdir.exists()
    assert running(pids) == []
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert h.netns not in names


def script_up() -> tuple[subprocess.Popen, Path]:
    """`tests/testhosts.py up --hosts 1`, once it is up: the process and the hosts' directory."""
    up = subprocess.Popen(
        [sys.executable, str(Path(testhosts.__file__)), "up", "--hosts", "1"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    lines = []
    deadline = time.monotonic() + 60
    try:
        while not lines or not lines[-1].startswith("Ctrl-C"):
            assert time.monotonic() < deadline and up.poll() is None, "".join(lines)
            lines.append(up.stdout.readline())
    except BaseException:
        up.kill()
        up.wait()
        raise
    return up, Path(lines[0].split()[5])


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_hosts_whose_owner_was_killed_are_taken_down_by_the_next_instance():
    """A run killed with SIGKILL takes nothing down; the next instance's up() does."""
    up, workdir = script_up()
    up.kill()
    up.wait()
    abandoned = TestHosts.from_state(workdir)
    (host,) = abandoned.hosts
    pids = host.pids()
    assert pids and abandoned.leftovers(timeout=0)  # its sshd, namespace and links stay
    with TestHosts(1, sshd=False):
        assert running(pids) == []
        assert abandoned.leftovers(timeout=0) == []
        assert not workdir.exists()
        assert not (testhosts.REGISTRY / f"{abandoned.id}.json").exists()


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_a_second_ctrl_c_does_not_cut_the_teardown_short():
    up, workdir = script_up()
    hosts = TestHosts.from_state(workdir)
    try:
        up.send_signal(signal.SIGINT)
        time.sleep(0.05)  # (taking one host down takes about 0.25 s)
        up.send_signal(signal.SIGINT)  # as `timeout` forwards one of its own
        assert up.wait(60) == 0
        assert hosts.leftovers(timeout=0) == []
        assert not (testhosts.REGISTRY / f"{hosts.id}.json").exists()
    finally:
        up.kill()
        up.wait()
        hosts.down()


_RECEIVE_ONE = """
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("0.0.0.0", 47011)); s.settimeout(10)
print(len(s.recv(65536)))
"""
_SEND_UNFRAGMENTED = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, 10, 2)  # IP_MTU_DISCOVER: IP_PMTUDISC_DO (Linux)
for _ in range(20):  # until the receiver listens
    s.sendto(bytes(int(sys.argv[2])), (sys.argv[1], 47011)); time.sleep(0.1)
"""


@pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))
def test_jumbo_frames_and_shaping_given_at_start_apply_to_every_link():
    with TestHosts(2, sshd=False, mtu=9000, shape=("1gbit", "32kb")) as th:
        a, b = th.hosts
        for h in th.hosts:
            qdisc = h.run("tc qdisc show dev eth0").stdout
            assert "tbf" in qdisc and "rate 1Gbit" in qdisc, qdisc
        receiver = subprocess.Popen(
            b.command([sys.executable, "-c", _RECEIVE_ONE]), stdout=subprocess.PIPE, text=True
        )
        try:
            # 8972 bytes of UDP with "don't fragment": one 9000-byte frame, host to host
            a.run([sys.executable, "-c", _SEND_UNFRAGMENTED, b.address, "8972"], check=False)
            out, _ = receiver.communicate(timeout=20)
        finally:
            receiver.kill()
            receiver.wait()
        assert out.strip() == "8972"
        too_big = a.run([sys.executable, "-c", _SEND_UNFRAGMENTED, b.address, "8973"], check=False)
        assert "Message too long" in too_big.stderr

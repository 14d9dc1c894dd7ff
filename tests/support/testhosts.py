"""Test hosts: a few "machines" on this one, each reached over ssh as a cluster node is.

Each host is a network namespace with its own address on a private bridge, entered with ``unshare
--uts --mount --ipc --pid``: its own hostname, private ``/run``, ``/dev/shm``, ``/tmp`` and
``/etc/hosts``, its own IPC namespace (MPI then sees separate nodes), its own process ids (a process
there sees only the host's processes), where asked its own monotonic clock (a time namespace set
ahead by ``clock_offsets``, as another node's clock is), a ``/sys`` of its own network namespace
that keeps this machine's cgroup tree (as a node has one; slurmd needs it), and its own ``sshd``
that accepts one generated key (``sshd=False``: none; tests/support/slurmcluster.py runs Slurm's
daemons instead). Over 500 lines: the hosts, their network and their faults share one set of
namespaces. The rest of the filesystem is shared, as a cluster's home and software are: this
checkout and its virtual environment have the same paths on every host, and so has ``shared_dir``
(for files that every host must see, e.g. a notebook's working directory). Needs root, ``iproute2``,
``util-linux`` and ``openssh-server`` (``scripts/test.sh`` installs them as root).

From Python (the pytest fixture ``test_hosts`` in tests/conftest.py is one of these)::

    with TestHosts(2) as th:
        th.hostfile                # one host name per line
        th.shared_dir              # the same directory on this machine and every host
        th.env                     # {"HYDRA_LAUNCHER_EXEC": th.ssh}: mpiexec -f th.hostfile ...
        th.hosts[0].run("hostname")   # a command inside a host (not through ssh)
        th.hosts[1].link_down(); th.hosts[1].link_up()
        th.hosts[1].shape("200mbit")   # tc tbf both ways; th.hosts[1].unshape()

From a shell (``up`` stays in the foreground until Ctrl-C, then takes everything down)::

    sudo .venv/bin/python tests/testhosts.py up --hosts 2
    sudo .venv/bin/python tests/testhosts.py up --hosts 2 --mtu 9000 --shape 1gbit --burst 32kb
    sudo .venv/bin/python tests/testhosts.py down DIR   # what a killed `up` left behind

Every name (namespaces, links, hosts) carries a random instance id and the address range is
chosen unused, so several instances can run at once; each takes down only its own, and up() takes
down those whose owner ended without doing so (a test run killed with SIGKILL).
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil

TOOLS = ("ip", "tc", "unshare", "nsenter", "ssh", "ssh-keygen", "sshd")
_STATE = "state.json"
#: A copy of each live instance's state, with its owner: a run killed with SIGKILL (whose fixtures
#: take nothing down) is taken down by the next instance's up(). In /run, which, like namespaces,
#: a reboot empties.
REGISTRY = Path("/run/tnt-testhosts")


def _started(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot); None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def unavailable() -> str | None:
    """Why test hosts cannot be made here (None when they can)."""
    if os.geteuid() != 0:
        return "test hosts need root (network namespaces, sshd); run the tests as root"
    missing = [t for t in TOOLS if shutil.which(t) is None and not Path(f"/usr/sbin/{t}").exists()]
    if missing:
        return (
            f"test hosts need {', '.join(missing)} (Debian: iproute2, util-linux, "
            "openssh-client, openssh-server; scripts/test.sh installs them as root)"
        )
    return None


def _sh(*cmd: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, check=check, timeout=timeout)


#: The largest segment TCP hands a link by default (and what `unshape` puts back).
_MAX_GSO = 65536
_TC_UNITS = {"b": 1, "k": 1024, "kb": 1024, "m": 1024**2, "mb": 1024**2}


def tc_bytes(size: str) -> int:
    """A size as tc reads it ("32kb": 32768 bytes)."""
    digits = size.rstrip("bkmBKM")
    unit = size[len(digits) :].lower() or "b"
    if not digits.isdigit() or unit not in _TC_UNITS:
        raise ValueError(f"not a size tc reads in bytes: {size!r} (e.g. 32kb, 1mb)")
    return int(digits) * _TC_UNITS[unit]


def segment_cap(burst: str) -> int:
    """The largest TCP segment a link shaped with `burst` takes (see TestHost.shape); 7/8 of the
    burst, since tbf also counts the headers of the packets a segment stands for."""
    return min(_MAX_GSO, tc_bytes(burst) * 7 // 8)


def _free_subnet() -> ipaddress.IPv4Network:
    """A /24 in 10.0.0.0/8 that no address or route of this machine overlaps."""
    used = []
    for line in _sh("ip", "-4", "-o", "addr").stdout.splitlines():
        used.append(ipaddress.ip_network(line.split()[3], strict=False))
    for line in _sh("ip", "-4", "route").stdout.splitlines():
        first = line.split()[0]
        if first != "default":
            used.append(ipaddress.ip_network(first if "/" in first else first + "/32"))
    for _ in range(100):
        net = ipaddress.ip_network(f"10.{random.randint(100, 254)}.{random.randint(0, 255)}.0/24")
        if not any(net.overlaps(u) for u in used):
            return net
    raise RuntimeError("no free 10.x.y.0/24 address range for test hosts")


# The checkout and the Python running the tests: a host must see them to start its init, sshd
# and ranks, also where they lie in /tmp, which each host replaces by its own.
CHECKOUT = (Path(__file__).resolve().parents[2], Path(sys.prefix).resolve())


def _private_tmp_keeping(paths: list[Path]) -> str:
    """Shell commands that mount a private /tmp on which ``paths`` (those in /tmp) stay visible:
    each is bound aside under /run, the tmpfs mounted, then each bound back to its own place."""
    kept: list[Path] = []
    for path in sorted({Path(p) for p in paths}):
        if path.is_relative_to("/tmp") and not any(path.is_relative_to(k) for k in kept):
            kept.append(path)
    aside = [(shlex.quote(str(p)), f"/run/kept{i}") for i, p in enumerate(kept)]
    out = "".join(f"mkdir -p {tmp}; mount --bind {p} {tmp}; " for p, tmp in aside)
    out += "mount -t tmpfs -o mode=1777 tmpfs /tmp; "
    out += "".join(f"mkdir -p {p}; mount --bind {tmp} {p}; umount {tmp}; " for p, tmp in aside)
    return out


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


# The host's pid 1: reaps the processes orphaned inside the host, as an init does.
_INIT = (
    "import os, time\n"
    "while True:\n"
    "    try:\n"
    "        os.wait()\n"
    "    except ChildProcessError:\n"
    "        time.sleep(0.2)\n"
)


def process_state(pid: int) -> str:
    """A process's state letter ('' when it is gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class TestHost:
    """One host: ``name`` (its hostname, as in the hostfile), ``address``, ``netns``."""

    __test__ = False  # not a pytest test class

    def __init__(
        self, name: str, address: str, netns: str, veth: str, workdir: Path, clock_offset: int = 0
    ) -> None:
        self.name = name
        self.clock_offset = clock_offset  # seconds its monotonic clock runs ahead of this machine's
        self.address = address
        self.netns = netns
        self.veth = veth  # the root-namespace end of the host's link
        self.workdir = workdir
        self.holder: subprocess.Popen | None = None  # unshare, whose child is the host's init
        self.sshd: subprocess.Popen | None = None  # nsenter, whose child is the host's sshd
        self.daemons: list[subprocess.Popen] = []  # nsenter of each start_daemon()

    def __repr__(self) -> str:
        return f"TestHost({self.name}, {self.address})"

    # ------------------------------------------------------------------ inside the host
    @property
    def init_pid(self) -> int:
        """The host's first process (its pid 1), as this machine numbers it."""
        assert self.holder is not None, "host is not up"
        return _children(self.holder.pid)[0]

    def command(self, cmd: str | list[str]) -> list[str]:
        """`cmd` wrapped to run inside the host's namespaces (a string goes through sh -c)."""
        argv = ["sh", "-c", cmd] if isinstance(cmd, str) else list(cmd)
        time = ["-T"] if self.clock_offset else []
        return [
            "nsenter",
            "-t",
            str(self.init_pid),
            "-n",
            "-u",
            "-m",
            "-i",
            "-p",
            *time,
            "--",
            *argv,
        ]

    def run(
        self, cmd: str | list[str], timeout: float = 30, check: bool = True, **kwargs
    ) -> subprocess.CompletedProcess:
        """Run a command inside the host (not through ssh); text output captured."""
        kwargs.setdefault("capture_output", True)
        return subprocess.run(self.command(cmd), text=True, timeout=timeout, check=check, **kwargs)

    def pids(self) -> list[int]:
        """Every process living in the host's network namespace (zombies, which this machine's
        init reaps late, do not count: nothing runs there)."""
        out = _sh("ip", "netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split() if process_state(int(p)) not in ("Z", "")]

    def own_pids(self) -> set[int]:
        """The host's own processes: its holder and init, sshd and daemons (not their children)."""
        own = {p.pid for p in (self.holder, self.sshd, *self.daemons) if p is not None}
        return own | {c for pid in list(own) for c in _children(pid)}

    def leftovers(self) -> list[str]:
        """What runs in the host besides its own processes (own_pids), or lies in its /dev/shm
        or /tmp."""
        own = self.own_pids()
        found = []
        for pid in self.pids():
            if pid in own:
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            found.append(f"pid {pid}: {cmd.strip()}")
        files = self.run("ls -Ad /dev/shm/* /tmp/*", check=False).stdout.split()
        shown = self.shown_from_this_machine()
        return found + [f for f in files if not any(k.is_relative_to(f) for k in shown)]

    def shown_from_this_machine(self) -> tuple[Path, ...]:
        """What the host's private /tmp shows of this machine's: this instance's directory, and
        the checkout and its Python where they lie in /tmp."""
        return (self.workdir, *CHECKOUT)

    def sweep_mpi_files(self) -> None:
        """Remove the MPICH segments and Hydra hwloc files that nobody uses: what a world that a
        test killed (or left through os._exit) keeps there."""
        code = "from tnt_notebook.cluster.cleanup import remove_orphaned_mpi_files as r; r()"
        self.run([sys.executable, "-c", code])

    # ------------------------------------------------------------------ faults and links
    def link_down(self) -> None:
        """Cut the host off (its link loses carrier; packets are dropped, nothing is reset)."""
        _sh("ip", "link", "set", self.veth, "down")

    def link_up(self) -> None:
        _sh("ip", "link", "set", self.veth, "up")

    def shape(self, rate: str, burst: str = "256kb", latency: str = "20ms") -> None:
        """Limit the host's link to `rate` both ways (tc tbf; this kernel has no netem).

        tbf cuts a packet longer than its burst into packets of one MTU each, in software, a
        timer and a softirq apiece on the cores the ranks compute on: TCP's segments (up to 64
        KB) are capped below the burst instead, so that they pass whole, as a NIC with TSO sends
        them without the host's CPU. (A socket keeps the size its link had when it connected.)"""
        tbf = ["tbf", "rate", rate, "burst", burst, "latency", latency]
        self._set_link(["gso_max_size", str(segment_cap(burst))])
        _sh("tc", "qdisc", "replace", "dev", self.veth, "root", *tbf)
        self.run(["tc", "qdisc", "replace", "dev", "eth0", "root", *tbf])

    def unshape(self) -> None:
        _sh("tc", "qdisc", "del", "dev", self.veth, "root", check=False)
        self.run(["tc", "qdisc", "del", "dev", "eth0", "root"], check=False)
        self._set_link(["gso_max_size", str(_MAX_GSO)])

    def _set_link(self, settings: list[str]) -> None:
        """`ip link set` on both ends of the host's link."""
        _sh("ip", "link", "set", "dev", self.veth, *settings)
        self.run(["ip", "link", "set", "dev", "eth0", *settings])

    def stop_sshd(self) -> None:
        """The host stays up but refuses ssh (connection refused), as a node whose sshd died."""
        if self.sshd is not None:
            for pid in _children(self.sshd.pid):  # nsenter ends with it
                os.kill(pid, signal.SIGTERM)
            try:
                self.sshd.wait(5)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
                self.sshd.wait(5)
            self.sshd = None

    def start_sshd(self, timeout: float = 10) -> None:
        assert self.sshd is None, "sshd already runs"
        log = open(self.workdir / f"sshd-{self.name}.log", "ab")  # noqa: SIM115
        with log:
            self.sshd = subprocess.Popen(
                self.command(["/usr/sbin/sshd", "-D", "-e", "-f", str(self._sshd_config())]),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        deadline = time.monotonic() + timeout
        while True:  # ready once it listens
            if self.sshd.poll() is not None:
                raise RuntimeError(f"sshd of {self.name} exited: {self._sshd_log()}")
            if f"{self.address}:22 " in self.run(["ss", "-Htln"], check=False).stdout:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"sshd of {self.name} does not listen: {self._sshd_log()}")
            time.sleep(0.02)

    def start_daemon(self, argv: list[str], log: Path) -> subprocess.Popen:
        """Run `argv` in the foreground inside the host, output to `log`; taken down with it."""
        with open(log, "ab") as out:
            p = subprocess.Popen(
                self.command(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )
        self.daemons.append(p)
        return p

    def _sshd_log(self) -> str:
        return (self.workdir / f"sshd-{self.name}.log").read_text(errors="replace")[-2000:]

    def _sshd_config(self) -> Path:
        path = self.workdir / f"sshd_config-{self.name}"
        if not path.exists():
            path.write_text(
                f"ListenAddress {self.address}\n"
                f"HostKey {self.workdir / f'host_key-{self.name}'}\n"
                f"AuthorizedKeysFile {self.workdir / 'id_ed25519.pub'}\n"
                "PermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\n"
                "UsePAM no\n"
                "StrictModes no\n"
                "PidFile none\n"
                "MaxStartups 100:30:200\n"
                "PrintMotd no\n"
                "LogLevel ERROR\n"
            )
        return path


def leftovers_within(hosts: list[TestHost], timeout: float = 15) -> dict[str, list[str]]:
    """What still runs, or lies in /dev/shm and /tmp, inside each of `hosts` once `timeout` has
    passed (or at once when nothing does); {} when every host is clean."""
    deadline = time.monotonic() + timeout
    while True:
        left = {h.name: h.leftovers() for h in hosts}
        if not any(left.values()) or time.monotonic() > deadline:
            return {name: items for name, items in left.items() if items}
        time.sleep(0.2)


class TestHosts:
    """`n` test hosts, their hostfile, ssh configuration and ssh wrapper; a context manager."""

    __test__ = False

    def __init__(
        self,
        n: int = 2,
        workdir: str | os.PathLike | None = None,
        names: list[str] | None = None,
        sshd: bool = True,
        mtu: int = 1500,
        shape: tuple[str, str] | None = None,
        clock_offsets: dict[int, int] | None = None,
    ) -> None:
        """`n` hosts named tnt<id>-h1, -h2...; or one per entry of `names`, tnt<id>-<name>.
        `mtu`: of every link (9000: the jumbo frames of cluster networks, which a shaped link
        passes in a sixth of the packets, each costing this machine's shared cores a softirq).
        `shape`: (rate, burst) for every host's link once up (TestHost.shape).
        `clock_offsets`: {host index: seconds} that host's monotonic clock runs ahead."""
        if names is not None:
            n = len(names)
        if not 1 <= n <= 8:
            raise ValueError("between 1 and 8 test hosts")
        self.n = n
        self.suffixes = names or [f"h{i}" for i in range(1, n + 1)]
        self.with_sshd = sshd
        self.mtu = mtu
        self.shape = shape
        self.clock_offsets = clock_offsets or {}
        self.id = f"{random.getrandbits(16):04x}"
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=f"tnt-testhosts-{self.id}-"))
        self.bridge = f"tntbr{self.id}"
        self.hosts: list[TestHost] = []
        self.subnet: ipaddress.IPv4Network | None = None
        self.bridge_address = ""

    # ------------------------------------------------------------------ what users need
    @property
    def hostfile(self) -> Path:
        return self.workdir / "hostfile"

    @property
    def shared_dir(self) -> Path:
        """A directory at the same path here and on every host (a cluster's shared home)."""
        return self.workdir / "shared"

    @property
    def ssh_config(self) -> Path:
        return self.workdir / "ssh_config"

    @property
    def ssh(self) -> Path:
        """An ssh command that reaches the hosts (for HYDRA_LAUNCHER_EXEC or --ssh)."""
        return self.workdir / "ssh"

    @property
    def env(self) -> dict[str, str]:
        """Environment for mpiexec (Hydra) to launch on the hosts through their sshd."""
        return {"HYDRA_LAUNCHER_EXEC": str(self.ssh)}

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.hosts]

    def write_hostfile(self, hosts: list[TestHost], path: str | os.PathLike) -> Path:
        """A hostfile naming some of the hosts (e.g. the first two of three)."""
        p = Path(path)
        p.write_text("".join(h.name + "\n" for h in hosts))
        return p

    # ------------------------------------------------------------------ up and down
    def __enter__(self) -> TestHosts:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        take_down_abandoned()
        self.workdir.mkdir(mode=0o700, exist_ok=True)
        self.shared_dir.mkdir(exist_ok=True)
        self.subnet = _free_subnet()
        addresses = [str(a) for a in self.subnet.hosts()]
        self.bridge_address = addresses[0]
        for i, suffix in enumerate(self.suffixes, start=1):
            self.hosts.append(
                TestHost(
                    name=f"tnt{self.id}-{suffix}",
                    address=addresses[i],
                    netns=f"tnt{self.id}-{suffix}",
                    veth=f"tntv{self.id}h{i}",
                    workdir=self.workdir,
                    clock_offset=self.clock_offsets.get(i - 1, 0),
                )
            )
        self._save_state()
        if self.with_sshd:
            self._keys()
        _sh("ip", "link", "add", self.bridge, "mtu", str(self.mtu), "type", "bridge")
        _sh("ip", "addr", "add", f"{self.bridge_address}/24", "dev", self.bridge)
        _sh("ip", "link", "set", self.bridge, "up")
        etc_hosts = self.workdir / "etc_hosts"
        import socket

        etc_hosts.write_text(
            "127.0.0.1 localhost\n"
            + "".join(f"{h.address} {h.name}\n" for h in self.hosts)
            # Hydra's proxies connect back to the launching machine by its name
            + f"{self.bridge_address} {socket.gethostname()}\n"
        )
        for h in self.hosts:
            self._host_up(h, etc_hosts)
        if self.with_sshd:
            for h in self.hosts:
                h.start_sshd()
        self.hostfile.write_text("".join(h.name + "\n" for h in self.hosts))
        self._save_state()
        if self.shape:
            for h in self.hosts:
                h.shape(*self.shape)

    def _keys(self) -> None:
        d = self.workdir
        _sh(
            "ssh-keygen",
            "-q",
            "-t",
            "ed25519",
            "-N",
            "",
            "-C",
            "tnt-testhosts",
            "-f",
            str(d / "id_ed25519"),
        )
        known = []
        config = []
        for h in self.hosts:
            key = d / f"host_key-{h.name}"
            _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key))
            known.append(f"{h.name},{h.address} {(d / f'host_key-{h.name}.pub').read_text()}")
            config.append(f"Host {h.name}\n  HostName {h.address}\n")
        (d / "known_hosts").write_text("".join(known))
        config.append(
            "Host *\n"
            "  User root\n"
            f"  IdentityFile {d / 'id_ed25519'}\n"
            "  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {d / 'known_hosts'}\n"
            "  GlobalKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking yes\n"
            "  BatchMode yes\n"
            "  ConnectTimeout 5\n"
            "  LogLevel ERROR\n"
        )
        self.ssh_config.write_text("".join(config))
        self.ssh.write_text(f'#!/bin/sh\nexec ssh -F {shlex.quote(str(self.ssh_config))} "$@"\n')
        self.ssh.chmod(0o755)

    def _host_up(self, h: TestHost, etc_hosts: Path) -> None:
        _sh("ip", "netns", "add", h.netns)
        mtu = ("mtu", str(self.mtu))
        peer = ("peer", "name", "eth0", *mtu, "netns", h.netns)
        _sh("ip", "link", "add", h.veth, *mtu, "type", "veth", *peer)
        _sh("ip", "link", "set", h.veth, "master", self.bridge, "up")
        ns = ("ip", "-n", h.netns)
        _sh(*ns, "addr", "add", f"{h.address}/24", "dev", "eth0")
        _sh(*ns, "link", "set", "eth0", "up")
        _sh(*ns, "link", "set", "lo", "up")
        _sh(*ns, "route", "add", "default", "via", self.bridge_address)
        ready = self.workdir / f"ready-{h.name}"
        setup = (
            "set -e; "
            f"hostname {h.name}; "
            "mount --make-rprivate /; "
            "mount -t tmpfs -o mode=755 tmpfs /run; mkdir -m 755 /run/sshd /run/cg; "
            # the network namespace's own /sys (as `ip netns exec` makes), with the cgroup tree
            "mount --rbind /sys/fs/cgroup /run/cg; umount -l /sys; mount -t sysfs sysfs /sys; "
            "mount --move /run/cg /sys/fs/cgroup; "
            "mount -t tmpfs -o mode=1777 tmpfs /dev/shm; "
            f"mount --bind {shlex.quote(str(etc_hosts))} /etc/hosts; "
            # a private /tmp; this instance's directory (sshd's keys, shared_dir) stays visible,
            # and so do the checkout and its Python where they lie in /tmp (a clone made there)
            + _private_tmp_keeping([self.workdir, *CHECKOUT])
            + f"touch {shlex.quote(str(ready))}; "
            + f"exec {shlex.quote(sys.executable)} -c {shlex.quote(_INIT)}"
        )
        h.holder = subprocess.Popen(
            [
                "nsenter",
                f"--net=/run/netns/{h.netns}",
                "unshare",
                "--uts",
                "--mount",
                "--ipc",
                "--pid",
                *(["--time", f"--monotonic={h.clock_offset}"] if h.clock_offset else []),
                "--fork",
                "--mount-proc",
                "--",
                "sh",
                "-c",
                setup,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10
        while not ready.exists():
            if h.holder.poll() is not None:
                raise RuntimeError(f"host {h.name} did not start: {h.holder.stderr.read()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"host {h.name} did not start within 10 s")
            time.sleep(0.01)

    def down(self) -> None:
        """Take everything down: processes in the hosts, namespaces, links, files."""
        for h in self.hosts:
            self._host_down(h)
        _sh("ip", "link", "del", self.bridge, check=False)
        left = self.leftovers()
        shutil.rmtree(self.workdir, ignore_errors=True)
        (REGISTRY / f"{self.id}.json").unlink(missing_ok=True)
        self.hosts = []
        if left:
            raise RuntimeError(f"test hosts left behind: {left}")

    def _host_down(self, h: TestHost) -> None:
        # SIGTERM first; the host's init ignores it (an init with no handler), SIGKILL then
        # ends whatever is left in the host at once
        everyone = set(h.pids())
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for pid in h.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            own = h.own_pids()
            deadline = time.monotonic() + 3
            while set(h.pids()) - (own if sig == signal.SIGTERM else set()):
                if time.monotonic() > deadline:
                    break
                for p in (h.holder, h.sshd, *h.daemons):
                    if p is not None:
                        p.poll()  # reap our own children
                time.sleep(0.02)
        deadline = time.monotonic() + 5  # killed processes still exiting leave the netns first
        while [
            p for p in everyone if process_state(p) not in ("", "Z")
        ] and time.monotonic() < deadline:
            time.sleep(0.02)
        for p in (h.holder, h.sshd, *h.daemons):
            if p is not None:
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    pass
                if p.stderr is not None:
                    p.stderr.close()
        h.holder = h.sshd = None
        h.daemons = []
        _sh("ip", "netns", "del", h.netns, check=False)
        _sh("ip", "link", "del", h.veth, check=False)  # the pair vanishes with the namespace

    def leftovers(self, timeout: float = 5) -> list[str]:
        """Namespaces and links of this instance that still exist (after down: none)."""
        deadline = time.monotonic() + timeout
        while True:  # a veth goes away up to ~2 s after its namespace
            netns = _sh("ip", "netns", "list", check=False).stdout
            links = _sh("ip", "-o", "link", check=False).stdout
            left = [f"netns {h.netns}" for h in self.hosts if h.netns in netns.split()]
            left += [
                f"link {name}"
                for name in (self.bridge, *(h.veth for h in self.hosts))
                if f" {name}:" in links or f" {name}@" in links
            ]
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.05)

    # ------------------------------------------------------------------ state for `down DIR`
    def _save_state(self) -> None:
        state = {
            "id": self.id,
            "workdir": str(self.workdir),
            "owner": [os.getpid(), _started(os.getpid())],
            "bridge": self.bridge,
            "hosts": [
                {"name": h.name, "address": h.address, "netns": h.netns, "veth": h.veth}
                for h in self.hosts
            ],
        }
        (self.workdir / _STATE).write_text(json.dumps(state))
        REGISTRY.mkdir(mode=0o700, exist_ok=True)
        (REGISTRY / f"{self.id}.json").write_text(json.dumps(state))

    @classmethod
    def from_state(cls, workdir: str | os.PathLike) -> TestHosts:
        """The instance a killed `up` left in `workdir`, to take it down."""
        return cls._from(json.loads((Path(workdir) / _STATE).read_text()), workdir)

    @classmethod
    def _from(cls, state: dict, workdir: str | os.PathLike) -> TestHosts:
        th = cls(len(state["hosts"]) or 1, workdir)
        th.id = state.get("id", th.id)
        th.bridge = state["bridge"]
        th.hosts = [TestHost(workdir=th.workdir, **h) for h in state["hosts"]]
        return th


def take_down_abandoned() -> list[str]:
    """Take down the instances whose owner has ended without taking them down (a test run killed
    with SIGKILL): their hosts' processes (sshd, Slurm's daemons, ranks), namespaces, links and
    files. Returns their ids."""
    done = []
    for entry in sorted(REGISTRY.glob("*.json")) if REGISTRY.is_dir() else []:
        try:
            state = json.loads(entry.read_text())
            pid, started = state["owner"]
        except (OSError, ValueError, KeyError):
            continue
        if _started(pid) == started:  # its owner runs
            continue
        try:
            TestHosts._from(state, state["workdir"]).down()
        except RuntimeError:  # what could not be removed stays; the next instance goes on
            pass
        entry.unlink(missing_ok=True)
        done.append(state["id"])
    return done


def command_line(
    argv: list[str] | None,
    prog: str,
    what: str,
    add_options: Callable[[argparse.ArgumentParser], None],
    make: Callable[[argparse.Namespace], Any],
    from_dir: Callable[[str], Any],
    why_not: Callable[[], str | None],
    report: Callable[[Any], None],
) -> int:
    """`up` (stays in the foreground until Ctrl-C, then takes everything down) and `down DIR`
    (what a killed `up` left) for a test world: these hosts, or tests/slurmcluster.py's Slurm."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description=sys.modules[make.__module__].__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = ap.add_subparsers(dest="action", required=True)
    add_options(sub.add_parser("up", help=f"start {what}; stay in the foreground until Ctrl-C"))
    down = sub.add_parser("down", help="take down what a killed `up` left in DIR")
    down.add_argument("dir")
    args = ap.parse_args(argv)
    if args.action == "down":
        from_dir(args.dir).down()
        print(f"removed {what} of {args.dir}")
        return 0
    reason = why_not()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    signal.signal(signal.SIGINT, signal.default_int_handler)  # also when started in background
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with make(args) as world:
        try:
            report(world)
            print("Ctrl-C takes it all down", flush=True)
            signal.pause()
        except KeyboardInterrupt:
            pass
        finally:
            # a second Ctrl-C (or the one that `timeout` forwards) must not cut the teardown short
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print(f"{what} taken down")
    return 0


def _report(th: TestHosts) -> None:
    link = ""
    if th.shape:
        rate, burst = th.shape
        link = f", links shaped to {rate} (burst {burst}, TCP segments <= {segment_cap(burst)} B)"
    print(f"{len(th.hosts)} test hosts up in {th.workdir} (MTU {th.mtu}{link}):")
    for h in th.hosts:
        print(f"  {h.name}  {h.address}")
    print(f"hostfile:   {th.hostfile}")
    print(f"shared dir: {th.shared_dir}   (the same path on every host: work from here)")
    print(f"ssh:        {th.ssh} HOST   (config {th.ssh_config})")
    print(f"for mpiexec/%tnt_cluster: export HYDRA_LAUNCHER_EXEC={th.ssh}")
    print(f"inside a host: {shlex.join(th.hosts[0].command(['bash']))}")


def _options(up: argparse.ArgumentParser) -> None:
    up.add_argument("--hosts", type=int, default=2, help="how many (default 2)")
    up.add_argument("--mtu", type=int, default=1500, help="of every link (default 1500)")
    up.add_argument("--shape", metavar="RATE", help="limit every link to RATE both ways (1gbit)")
    up.add_argument("--burst", default="256kb", help="the shaper's burst (default 256kb)")


def main(argv: list[str] | None = None) -> int:
    return command_line(
        argv,
        "tests/testhosts.py",
        "the test hosts",
        _options,
        lambda args: TestHosts(
            args.hosts, mtu=args.mtu, shape=(args.shape, args.burst) if args.shape else None
        ),
        TestHosts.from_state,
        unavailable,
        _report,
    )


if __name__ == "__main__":
    sys.exit(main())


def running(pids: list[int]) -> list[int]:
    """Those of pids that run (a zombie waiting for this machine's slow init does not)."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.Error:
            pass
    return out

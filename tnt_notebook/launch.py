"""Hostfiles and the launch plan: which hosts, how many ranks where, what each rank gets, and
the exact commands that start a cluster. Validated on construction, starts nothing.

Ranks run on this machine (``-n``), on the hosts of a hostfile reached with ssh, or on the nodes
of the Slurm allocation this process runs in (neither ``-n`` nor ``--hostfile`` given): there they
are one job step, started by Hydra's Slurm bootstrap (``mpiexec -launcher slurm``: srun starts
its proxies) or by ``srun`` itself, one rank per task (``--launcher srun``); a hostfile naming only
nodes of the allocation is launched through Slurm too.

Hostfiles follow Tarantella's format: unique host names, one per line; blank lines and ``#``
comments are ignored. Errors are a :class:`HostfileError` or :class:`PlanError` with a one-line
message (the magics turn them into an IPython ``UsageError``).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tnt_notebook import tf_logs
from tnt_notebook.slurm import SlurmAllocation, SlurmError, step_name
from tnt_notebook.transport import TRANSPORTS, built_transports, mpi_env_defaults, require

_HOST_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.\-]*[A-Za-z0-9_])?$")
_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1", "ip6-localhost"}


class HostfileError(ValueError):
    """A hostfile or per-node count that cannot be launched; the message is one line."""


def parse_hostfile_text(text: str, source: str = "hostfile") -> list[str]:
    """Host names of a hostfile's text, in order; rejects empty files, bad and duplicate names."""
    hosts: list[str] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not _HOST_RE.match(line):
            raise HostfileError(
                f"{source}, line {lineno}: {line!r} is not a host name "
                "(one host name per line, e.g. 'node01')"
            )
        if line in seen:
            raise HostfileError(
                f"{source}, line {lineno}: duplicate host {line!r} (first on line {seen[line]}); "
                "host names must be unique, use --n-per-node for several ranks per host"
            )
        seen[line] = lineno
        hosts.append(line)
    if not hosts:
        raise HostfileError(f"{source} is empty: it names no host")
    return hosts


def read_hostfile(path: str | os.PathLike) -> list[str]:
    """Host names listed in the hostfile at `path` (see :func:`parse_hostfile_text`)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise HostfileError(f"hostfile {str(p)!r} does not exist")
    if p.is_dir():
        raise HostfileError(f"hostfile {str(p)!r} is a directory, not a file")
    try:
        text = p.read_text()
    except PermissionError:
        raise HostfileError(f"hostfile {str(p)!r} is not readable (permission denied)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise HostfileError(f"hostfile {str(p)!r} cannot be read: {e}") from None
    return parse_hostfile_text(text, source=f"hostfile {str(p)!r}")


def validate_n_per_node(value: object) -> int:
    """A positive number of ranks per host; anything else is a HostfileError."""
    if isinstance(value, bool):
        raise HostfileError(f"--n-per-node must be a positive integer, got {value!r}")
    try:
        n = int(str(value).strip())
    except ValueError:
        raise HostfileError(f"--n-per-node must be a positive integer, got {value!r}") from None
    if n < 1:
        raise HostfileError(f"--n-per-node must be a positive integer, got {value!r}")
    return n


def is_local_host(name: str) -> bool:
    """True when `name` designates the machine we run on (controller may stay on loopback)."""
    if name in _LOCAL_NAMES or name.startswith("127."):
        return True
    me = {socket.gethostname(), socket.getfqdn()}
    return name in me or name.split(".")[0] == socket.gethostname().split(".")[0]


def all_local(hosts: list[str]) -> bool:
    """True when every host is this machine."""
    return all(is_local_host(h) for h in hosts)


DEFAULT_STARTUP_TIMEOUT = 60.0
DEFAULT_COLLECTIVE_TIMEOUT = 30.0
HEARTBEAT_MS = 500  # hub ping period: engines finish registering within ~1 period
HEARTBEAT_MISSES = 20  # an engine silent for 10 s is declared dead by the hub
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# the controller draws its engine-facing ports in this order (ipyparallel.controller.app)
ENGINE_PORT_NAMES = ("registration", "control", "mux", "task", "iopub", "hb_ping", "hb_pong")
BROADCAST_LEAVES = 2  # 2**IPController.broadcast_scheduler_depth (default depth 1)


class PlanError(ValueError):
    """Options that do not make a launchable cluster (one-line message)."""


LAUNCHERS = ("mpiexec", "srun")  # how ranks start inside a Slurm allocation


def default_mpiexec() -> str:
    """The launcher of the MPI the package uses: $TNT_MPIEXEC, else the mpich wheel's."""
    env = os.environ.get("TNT_MPIEXEC")
    if env:
        return env
    venv = Path(sys.executable).parent / "mpiexec"
    return str(venv) if venv.exists() else (shutil.which("mpiexec") or "mpiexec")


def _launcher_flavor(mpiexec: str) -> str:
    """'hydra' (MPICH, Intel MPI) or 'openmpi': they spell hostfile and env options differently."""
    try:
        out = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "hydra"
    return "openmpi" if ("Open MPI" in out or "OpenRTE" in out) else "hydra"


def ssh_target(host: str, ssh: str) -> str:
    """The name or address that `ssh` connects to for `host` (its configuration's HostName)."""
    try:
        out = subprocess.run([ssh, "-G", host], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return host
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value.strip():
            return value.strip()
    return host


def route_source(address: str) -> str:
    """This machine's address on the route to `address` (nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return s.getsockname()[0]


def address_hosts_reach(hosts: list[str], target_of: Callable[[str], str]) -> str:
    """The one address of this machine on the routes to every remote host of `hosts`, each
    reached at ``target_of(host)`` (its ssh HostName, its Slurm NodeAddr)."""
    sources: dict[str, str] = {}
    for host in hosts:
        if is_local_host(host):
            continue
        target = target_of(host)
        try:
            address = socket.getaddrinfo(target, None, socket.AF_INET)[0][4][0]
            sources[host] = route_source(address)
        except OSError as e:
            raise PlanError(
                f"host {host!r} has no reachable IPv4 address ({e}); "
                "give the controller's address with --controller-ip"
            ) from None
    if len(set(sources.values())) > 1:
        seen = ", ".join(f"{h} via {a}" for h, a in sources.items())
        raise PlanError(
            f"the hosts are reached from different addresses of this machine ({seen}); "
            "choose the one they all reach with --controller-ip"
        )
    return next(iter(sources.values()))


_SSH_FAILURE_RE = re.compile(
    r"^ssh: (?:connect to host (\S+) port \d+|Could not resolve hostname (\S+?)): (.+)$"
    r"|^(?:\S+@)?(\S+): (Permission denied .+)$",
    re.M,
)


def ssh_failures(stderr: str, hosts: list[str], ssh: str) -> list[str]:
    """'HOST (why)' for each host that ssh could not reach, as its errors in `stderr` say
    (they name the address connected to; this names the host of the hostfile)."""
    found = list(_SSH_FAILURE_RE.finditer(stderr))
    if not found:
        return []
    host_of: dict[str, str] = {}
    for host in hosts:
        target = ssh_target(host, ssh)
        host_of[host] = host_of[target] = host
        try:
            host_of[socket.gethostbyname(target)] = host
        except OSError:
            pass
    out = []
    for m in found:
        target = m.group(1) or m.group(2) or m.group(4)
        why = (m.group(3) or m.group(5)).strip().rstrip(".")
        item = f"{host_of.get(target, target)} ({why})"
        if item not in out:
            out.append(item)
    return out


_HYDRA_DEATH_RE = re.compile(
    r"PID (\d+) RUNNING AT (\S+)\s*\n=\s*(?:KILLED BY SIGNAL: (\d+)|EXIT CODE: (\d+))"
    r"(?:(?:.*\n)*?.*EXIT STRING: .*\(signal (\d+)\))?"
)


@dataclass
class RankDeath:
    """A rank that the launcher reports dead: by a signal, or with an exit code. Hydra names
    its pid, srun its rank (the task id)."""

    pid: int | None
    host: str
    signal: int | None
    code: int | None
    rank: int | None = None

    def how(self) -> str:
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = str(self.signal)
            return f"killed by signal {name}"
        return f"exit code {self.code}"


def hydra_deaths(report: str) -> list[RankDeath]:
    """The ranks that Hydra's BAD TERMINATION report names, in its order."""
    out = []
    for m in _HYDRA_DEATH_RE.finditer(report):
        sig = m[3] or m[5]
        out.append(
            RankDeath(int(m[1]), m[2], int(sig) if sig else None, None if sig else int(m[4]))
        )
    return out


_SRUN_DEATH_RE = re.compile(
    r"^srun: error: (\S+): tasks? ([\d,\-]+): (?:Exited with exit code (\d+)|(.+?))\s*$", re.M
)
_SIGNAL_BY_TEXT = {
    text: int(s) for s in signal.Signals if (text := signal.strsignal(s)) is not None
}


def srun_deaths(report: str) -> list[RankDeath]:
    """The tasks (ranks) that srun reports ended badly, in its order: the first is the one
    that ended the step under --kill-on-bad-exit, the others were ended by Slurm for it."""
    out = []
    for m in _SRUN_DEATH_RE.finditer(report):
        sig = _SIGNAL_BY_TEXT.get(m[4] or "")
        if m[3] is None and sig is None:
            continue
        for part in m[2].split(","):
            first, _, last = part.partition("-")
            for rank in range(int(first), int(last or first) + 1):
                code = int(m[3]) if m[3] is not None else None
                out.append(RankDeath(None, m[1], sig, code, rank))
    return out


_SRUN_ERROR_RE = re.compile(
    r"^srun: error: (?!\S+: tasks? [\d,\-]+: )(.+)$|^slurmstepd\S*: error: (mpi/.+)$", re.M
)


def srun_launch_error(stderr: str) -> str | None:
    """The first error of srun, or of Slurm's PMI server, other than a task's end: a step it
    could not create or launch (an unknown PMI, nodes it may not use), which Hydra, whose
    proxies srun starts, waits out forever, or PMI requests it cannot read, which leave the
    ranks waiting forever; None when there is none."""
    m = _SRUN_ERROR_RE.search(stderr)
    if m is None:
        return None
    if m[2]:  # seen with Slurm 22.05 and MPICH 5: the address exchange needs several messages
        return (
            f"Slurm's PMI server failed ({m[2].strip()}); its PMI2 cannot serve this MPI "
            "here: use --launcher mpiexec"
        )
    return m[1].strip()


def write_private(path: str, text: str) -> None:
    """A new file only its owner can read."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


@dataclass
class LaunchPlan:
    """Everything needed to launch a cluster; validated on construction, starts nothing.

    Either ``n`` ranks on this machine, or a ``hostfile`` with ``n_per_node`` ranks per host, or
    (neither given, inside a Slurm job) ``n_per_node`` ranks on each node of the ``slurm``
    allocation (default: what it grants per node), started with ``launcher`` (``mpiexec`` or
    ``srun``). When a host is another machine, the controller listens on ``controller_ip``
    (default: the address of this machine that the hosts reach) and Hydra reaches the hosts
    through Slurm, else with ``ssh`` (default: ``$HYDRA_LAUNCHER_EXEC``, else ``ssh``).
    """

    n: int | None = None
    hostfile: str | None = None
    n_per_node: int | None = None
    exports: dict[str, str] = field(default_factory=dict)
    fusion_threshold_kb: float | None = None
    no_gpu: bool = False
    pin_to_socket: bool = False
    python: str = field(default_factory=lambda: sys.executable)
    log_level: str | None = None
    output_on_all_devices: bool = False
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT
    timeout: float = DEFAULT_STARTUP_TIMEOUT
    mpiexec: str = field(default_factory=default_mpiexec)
    cwd: str = field(default_factory=os.getcwd)
    flavor: str | None = None
    controller_ip: str | None = None
    ssh: str | None = None
    # between nodes: mpi or gaspi (default: $TNT_TRANSPORT, else mpi)
    transport: str = field(default_factory=lambda: os.environ.get("TNT_TRANSPORT", "") or "mpi")
    launcher: str = "mpiexec"
    slurm: SlurmAllocation | None = None  # default: the allocation this process runs in
    hosts: list[str] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.launcher not in LAUNCHERS:
            choices = ", ".join(LAUNCHERS)
            raise PlanError(f"--launcher must be one of {choices}, got {self.launcher!r}")
        if self.n is None and self.slurm is None:
            self.slurm = SlurmAllocation.from_environment()
        elif self.n is not None:
            self.slurm = None  # -n: ranks on this machine, inside an allocation too
        if self.hostfile is not None:
            if self.n is not None:
                raise PlanError("give either -n N (one machine) or --hostfile FILE, not both")
            self.n_per_node = validate_n_per_node(1 if self.n_per_node is None else self.n_per_node)
            self.hosts = read_hostfile(self.hostfile)
            if self.slurm is not None and not set(self.hosts) <= set(self.slurm.nodes):
                self.slurm = None  # hosts outside the allocation: reached with ssh
        elif self.slurm is not None:
            self.hosts = list(self.slurm.nodes)
            self.n_per_node = (
                self.slurm.per_node()
                if self.n_per_node is None
                else validate_n_per_node(self.n_per_node)
            )
        else:
            if self.n_per_node is not None:
                raise HostfileError(
                    "--n-per-node needs --hostfile or a Slurm allocation (use -n N on one machine)"
                )
            n = 1 if self.n is None else self.n
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise PlanError(f"-n must be a positive integer, got {self.n!r}")
            self.n = n
            self.hosts = ["localhost"]
        for name, value in self.exports.items():
            if not _ENV_NAME_RE.match(name):
                raise PlanError(f"-x {name}={value}: {name!r} is not an environment variable name")
        if self.fusion_threshold_kb is not None and self.fusion_threshold_kb < 0:
            raise PlanError(f"--fusion-threshold must be >= 0 KB, got {self.fusion_threshold_kb}")
        if self.timeout <= 0:
            raise PlanError(f"--timeout must be > 0 seconds, got {self.timeout}")
        if self.collective_timeout <= 0:
            raise PlanError(f"--collective-timeout must be > 0, got {self.collective_timeout}")
        if self.log_level is not None:
            level = str(self.log_level).upper()
            if level not in LOG_LEVELS:
                raise PlanError(f"--log-level must be one of {', '.join(LOG_LEVELS)}")
            self.log_level = level
        if shutil.which(self.python) is None:
            raise PlanError(f"--python-interpreter {self.python!r} is not an executable")
        if shutil.which(self.mpiexec) is None:
            raise PlanError(
                f"MPI launcher {self.mpiexec!r} not found (set --mpiexec or TNT_MPIEXEC)"
            )
        if self.ssh is not None and shutil.which(self.ssh) is None:
            raise PlanError(f"--ssh {self.ssh!r} is not an executable")
        if self.controller_ip is not None:
            try:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((self.controller_ip, 0))
            except OSError:
                raise PlanError(
                    f"--controller-ip {self.controller_ip!r} is not an IPv4 address of this machine"
                ) from None
        self.transport = str(self.transport).strip().lower()
        if self.transport not in TRANSPORTS:
            raise PlanError(f"--transport must be one of {', '.join(TRANSPORTS)}")
        if self.transport != "mpi":  # the ranks' build must have it: ask their interpreter
            try:
                require(self.transport, built_transports(self.python))
            except ValueError as e:
                raise PlanError(f"--transport {self.transport}: {e}") from None
        if self.launcher == "srun" and self.slurm is None:
            raise PlanError(
                "--launcher srun starts the ranks as a Slurm job step: it needs the nodes of a "
                "Slurm allocation (SLURM_JOB_ID is not set, or -n N was given)"
            )
        if self.pin_to_socket and shutil.which("numactl") is None:
            raise PlanError("--pin-to-socket needs numactl, which is not installed on this machine")
        if self.flavor is None:
            self.flavor = (
                "hydra"
                if self.mpiexec == str(Path(sys.executable).parent / "mpiexec")
                else _launcher_flavor(self.mpiexec)
            )

    @property
    def per_host(self) -> bool:
        """True when ranks are placed n_per_node per host (a hostfile or a Slurm allocation)."""
        return self.hostfile is not None or self.slurm is not None

    @property
    def size(self) -> int:
        """Number of ranks in the world."""
        if self.per_host:
            return len(self.hosts) * int(self.n_per_node or 1)
        return int(self.n or 1)

    @property
    def origin(self) -> str:
        """Where the ranks' hosts come from, in words (status, dry run)."""
        if self.slurm is None:
            return f"hostfile {self.hostfile}" if self.hostfile is not None else "this machine"
        how = (
            "srun, one rank per task"
            if self.launcher == "srun"
            else "mpiexec, whose proxies srun starts"
        )
        source = f"hostfile {self.hostfile} in " if self.hostfile is not None else ""
        return f"{source}Slurm job {self.slurm.job_id} (nodes {self.slurm.nodelist}; {how})"

    @property
    def local(self) -> bool:
        """True when every rank runs on this machine (controller stays on loopback)."""
        return all_local(self.hosts)

    @property
    def ssh_command(self) -> str:
        """How this machine reaches the hosts: --ssh, else $HYDRA_LAUNCHER_EXEC, else ssh."""
        return self.ssh or os.environ.get("HYDRA_LAUNCHER_EXEC") or "ssh"

    def ssh_wrapper(self, profile_dir: str) -> str:
        """The launcher Hydra runs to reach a host: the ssh command without the engines'
        connection info in its environment (only the ranks need it)."""
        return os.path.join(profile_dir, "ssh")

    def ssh_wrapper_text(self) -> str:
        return f'#!/bin/sh\nunset IPP_CONNECTION_INFO\nexec {shlex.quote(self.ssh_command)} "$@"\n'

    def remote_command(self, host: str, argv: list[str]) -> list[str]:
        """`argv` run on another host of the plan: through Slurm (a step of one task on that
        node) or ssh (no password prompt, 5 s to connect)."""
        if self.slurm is not None:
            return [
                "srun",
                "--overlap",
                "--mpi=none",
                "--nodes=1",
                "--ntasks=1",
                f"--nodelist={host}",
                "--input=none",
                *argv,
            ]
        ssh = [self.ssh_command, "-o", "BatchMode=yes", "-o", "ConnectTimeout=5"]
        return [*ssh, host, shlex.join(argv)]

    @property
    def reached_with(self) -> str:
        """How the ranks reach the other hosts, in words."""
        if self.slurm is not None:
            return f"srun (Slurm job {self.slurm.job_id})"
        return self.ssh_command

    @cached_property
    def listen_address(self) -> str:
        """Where the controller listens: loopback when every rank is here, else only the address
        that the hosts reach (PlanError when there is no single one)."""
        if self.local:
            return "127.0.0.1"
        if self.controller_ip:
            return self.controller_ip
        if self.slurm is not None:  # names this machine may not resolve: Slurm's NodeAddr
            return address_hosts_reach(self.hosts, self.slurm.node_addresses().__getitem__)
        return address_hosts_reach(self.hosts, lambda host: ssh_target(host, self.ssh_command))

    def host_of_rank(self, rank: int) -> str:
        """The host a rank is placed on (block placement, as mpiexec -ppn does)."""
        if not self.per_host:
            return "localhost"
        return self.hosts[min(rank // int(self.n_per_node or 1), len(self.hosts) - 1)]

    def env_exports(self, engines: bool = True) -> dict[str, str]:
        """Variables exported on every rank (COMMON contract 2) plus the user's -x values;
        ranks that are a script's (tnt-run), not engines, are not told they are engines."""
        env = {"TNT_NOTEBOOK_ENGINE": "1"} if engines else {}
        env["TNT_COLLECTIVE_TIMEOUT"] = f"{self.collective_timeout:g}"
        env["TNT_TRANSPORT"] = self.transport
        if self.fusion_threshold_kb is not None:
            env["TNT_FUSION_THRESHOLD"] = str(int(round(self.fusion_threshold_kb * 1024)))
        if self.log_level:
            env["TNT_LOG_LEVEL"] = self.log_level
        env.update(tf_logs.log_environment(self.log_level))
        if self.output_on_all_devices:
            env["TNT_OUTPUT_ON_ALL_DEVICES"] = "1"
        if self.no_gpu:
            env["TNT_NO_GPU"] = "1"
            env["CUDA_VISIBLE_DEVICES"] = ""
        env.update(mpi_env_defaults())
        env.update(self.exports)
        return env

    def controller_command(
        self,
        profile_dir: str,
        cluster_id: str,
        ports: list[int] | None = None,
        address: str | None = None,
    ) -> list[str]:
        """ipyparallel controller, with the engine-facing ports and the key chosen by us."""
        ports = ports or [0] * (len(ENGINE_PORT_NAMES) + BROADCAST_LEAVES)
        return [
            sys.executable,
            "-m",
            "ipyparallel.controller",
            f"--profile-dir={profile_dir}",
            f"--cluster-id={cluster_id}",
            f"--ip={address or self.listen_address}",
            *(f"--IPController.engine_ports={p}" for p in ports),
            f"--Session.keyfile={os.path.join(profile_dir, 'security', 'key')}",
            f"--HeartMonitor.period={HEARTBEAT_MS}",
            f"--HeartMonitor.max_heartmonitor_misses={HEARTBEAT_MISSES}",
            f"--IPController.registration_timeout={int(self.timeout) + 10}",
            "--nodb",  # the hub keeps no copy of every output (we never query it): less CPU per
            # message while ranks train, and no memory growing with a long session's output
            "--log-level=WARN",
        ]

    def engine_command(self, profile_dir: str, cluster_id: str) -> list[str]:
        """One rank: an ipyparallel engine in MPI mode (engine id == MPI rank)."""
        cmd = [
            self.python,
            "-m",
            "ipyparallel.engine",
            "--mpi",
            f"--profile-dir={profile_dir}",
            f"--cluster-id={cluster_id}",
            "--IPEngine.init_mpi=import tnt_notebook as tnt",
            f"--IPEngine.timeout={self.timeout:g}",
            "--log-level=ERROR",
        ]
        if not self.local:  # the profile directory is this machine's: made where it is missing
            cmd.insert(-1, "--IPEngine.auto_create=True")
        return self._pinned(cmd)

    def script_command(self, script: list[str], profile_dir: str, cluster_id: str) -> list[str]:
        """One rank of `tnt-run`: the user's script and arguments, run by the rank-side runner
        (master output only, the first failure named, leftovers watched)."""
        runner = [self.python, "-m", "tnt_notebook.launch", "--run-script"]
        runner += [f"--profile-dir={profile_dir}", f"--cluster-id={cluster_id}", "--"]
        return self._pinned([*runner, *script])

    def _pinned(self, cmd: list[str]) -> list[str]:
        if self.pin_to_socket:
            return [self.python, "-m", "tnt_notebook.launch", "--pin-to-socket", "--", *cmd]
        return cmd

    def srun_wrapper(self, profile_dir: str) -> str:
        return os.path.join(profile_dir, "srun")

    def srun_wrapper_text(self, cluster_id: str) -> str:
        """What Hydra's Slurm bootstrap runs for srun: a step of our own name that shares the
        allocation's CPUs with the notebook's step (--overlap), without the engines' connection
        info and with no PMI of Slurm's for the proxies (a site's PMIx default would reach the
        ranks beside Hydra's PMI, and they would abort)."""
        name = f"--job-name={step_name(cluster_id)}"
        srun = shlex.join(["srun", name, "--overlap", "--mpi=none"])
        return f'#!/bin/sh\nunset IPP_CONNECTION_INFO\nexec {srun} "$@"\n'

    def write_launch_files(self, profile_dir: str, cluster_id: str) -> None:
        """The owner-only files the launcher reads: the hostfile, and the wrapper through which
        Hydra reaches hosts that are other machines (srun inside a Slurm allocation, else ssh)."""
        if self.per_host:
            write_private(os.path.join(profile_dir, "hostfile"), "\n".join(self.hosts) + "\n")
        if self.slurm is not None:
            if self.launcher == "mpiexec" and self.flavor == "hydra":
                wrapper = self.srun_wrapper(profile_dir)
                write_private(wrapper, self.srun_wrapper_text(cluster_id))
                os.chmod(wrapper, 0o700)
        elif not self.local:
            wrapper = self.ssh_wrapper(profile_dir)
            write_private(wrapper, self.ssh_wrapper_text())
            os.chmod(wrapper, 0o700)

    def launcher_command(
        self,
        profile_dir: str,
        cluster_id: str,
        address: str | None = None,
        program: list[str] | None = None,
    ) -> list[str]:
        """mpiexec (or srun) with the world size, placement, exported variables and the engine
        command (or `program`, a script's ranks for tnt-run)."""
        env = self.env_exports(engines=program is None)
        program = program or self.engine_command(profile_dir, cluster_id)
        if self.launcher == "srun":
            return self._srun_command(cluster_id, env, program)
        cmd = [self.mpiexec]
        if self.flavor == "openmpi":
            if self.per_host:
                hostfile = os.path.join(profile_dir, "hostfile")
                cmd += ["--hostfile", hostfile, "--npernode", str(self.n_per_node)]
            cmd += ["-n", str(self.size), "--wdir", self.cwd, "-x", "IPP_CONNECTION_INFO"]
            for k, v in env.items():
                cmd += ["-x", f"{k}={v}"]
        else:
            cmd += ["-n", str(self.size)]
            if self.per_host:
                cmd += ["-f", os.path.join(profile_dir, "hostfile"), "-ppn", str(self.n_per_node)]
            cmd += ["-wdir", self.cwd]
            if not self.local:
                # proxies on the hosts connect back to this address, not to a name that the
                # hosts may resolve to something else (Debian maps its own name to 127.0.1.1)
                cmd += ["-localhost", address or self.listen_address]
            if self.slurm is not None:  # also for ranks on this node: they belong in the job
                cmd += ["-launcher", "slurm", "-launcher-exec", self.srun_wrapper(profile_dir)]
            elif not self.local:
                cmd += ["-launcher", "ssh", "-launcher-exec", self.ssh_wrapper(profile_dir)]
            for k, v in env.items():
                cmd += ["-genv", k, v]
        return cmd + program

    def _srun_command(self, cluster_id: str, env: dict[str, str], program: list[str]) -> list[str]:
        """One rank per task of a job step of our own name: PMI2 (the mpich wheel has no PMIx,
        and a site's default may be PMIx or none), sharing CPUs with the notebook's own step
        (--overlap), ended as a whole when one rank dies (--kill-on-bad-exit), ranks placed
        block by block whatever the step we run in says (its variables reach srun)."""
        assert self.slurm is not None
        granted = dict(zip(self.slurm.nodes, self.slurm.tasks_per_node, strict=True))
        cmd = [
            "srun",
            f"--job-name={step_name(cluster_id)}",
            "--overlap",
            "--kill-on-bad-exit=1",
            "--mpi=pmi2",
            f"--nodes={len(self.hosts)}",
            f"--ntasks={self.size}",
            f"--ntasks-per-node={self.n_per_node}",
            "--distribution=block",
            f"--nodelist={','.join(self.hosts)}",
            f"--chdir={self.cwd}",
            "--input=none",
        ]
        if any(int(self.n_per_node or 1) > granted[h] for h in self.hosts):
            cmd.append("--overcommit")  # more ranks per node than the job's tasks: asked for
        # srun hands its own environment to the ranks: the exports go through `env`
        return [*cmd, "env", *(f"{k}={v}" for k, v in env.items()), *program]

    def commands(
        self,
        profile_dir: str = "PROFILE_DIR",
        cluster_id: str = "CLUSTER_ID",
        ports: Any = None,
        address: str | None = None,
    ) -> list[list[str]]:
        """The exact commands start() runs: [controller, launcher] (both start concurrently)."""
        return [
            self.controller_command(profile_dir, cluster_id, ports, address),
            self.launcher_command(profile_dir, cluster_id, address),
        ]

    def describe(self, script: list[str] | None = None) -> str:
        """Human-readable launch plan for --dry-run (of `script`'s ranks for tnt-run)."""
        where = (
            f"{len(self.hosts)} host(s) from {self.origin} x {self.n_per_node} per node"
            if self.per_host
            else "this machine"
        )
        try:
            address = self.listen_address
            listens = address
        except (PlanError, SlurmError) as e:
            address, listens = "ADDRESS", f"ADDRESS (not found here: {e})"
        if script is None:
            security = (
                "messages signed"
                if self.local
                else "messages signed and encrypted (CurveZMQ); hosts reached with "
                + self.reached_with
            )
            head = [
                f"tnt cluster launch plan: {self.size} rank(s) on {where}",
                f"  hosts: {', '.join(self.hosts)}",
                f"  controller listens on {listens}; MPI launcher {self.mpiexec} ({self.flavor})",
                f"  {security}",
                f"  engines' working directory: {self.cwd}",
                f"  start-up timeout: {self.timeout:g} s",
                f"  transport between nodes: {self.transport}",
            ]
        else:
            head = [
                f"tnt-run launch plan: {self.size} rank(s) on {where}",
                f"  hosts: {', '.join(self.hosts)}",
                f"  MPI launcher {self.mpiexec} ({self.flavor})"
                + (
                    "" if self.local else f"; hosts reached with {self.reached_with} from {listens}"
                ),
                f"  working directory: {self.cwd}; transport between nodes: {self.transport}",
            ]
        lines = [
            *head,
            "  exported on every rank:",
            *(f"    {k}={v!r}" for k, v in self.env_exports(engines=script is None).items()),
        ]
        if script is None:
            lines.append(
                "  (the engine connection info reaches the ranks in IPP_CONNECTION_INFO, inherited)"
            )
            lines.append("commands (started concurrently):")
            ports = [f"PORT{i}" for i in range(len(ENGINE_PORT_NAMES) + BROADCAST_LEAVES)]
            commands = self.commands(ports=ports, address=address)
        else:
            lines.append("command:")
            program = self.script_command(script, "PROFILE_DIR", "RUN_ID")
            commands = [self.launcher_command("PROFILE_DIR", "RUN_ID", address, program)]
        lines += ["  " + shlex.join(cmd) for cmd in commands]
        return "\n".join(lines)


# Tarantella's launcher options, shared by %tnt_cluster and tnt-run: (flags, argparse keywords)
LAUNCH_OPTIONS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("-n",), {"type": int, "default": None, "help": "number of ranks on this machine"}),
    (("--hostfile",), {"default": None, "help": "file with one unique host name per line"}),
    (
        ("--n-per-node", "--npernode", "--devices-per-node"),
        {
            "dest": "n_per_node",
            "default": None,
            "help": "ranks per host of the hostfile (1) or per node of the Slurm allocation "
            "(what it grants per node)",
        },
    ),
    (
        ("--launcher",),
        {
            "choices": LAUNCHERS,
            "default": None,
            "help": "inside a Slurm allocation: mpiexec (default; srun starts its proxies) or "
            "srun (one rank per task, PMI2)",
        },
    ),
    (
        ("-x",),
        {
            "dest": "exports",
            "action": "extend",
            "nargs": "+",
            "metavar": "NAME=VALUE",
            "help": "environment variable exported on every rank (repeatable)",
        },
    ),
    (
        ("--fusion-threshold",),
        {
            "type": float,
            "default": None,
            "metavar": "KB",
            "help": "gradient fusion bucket size in KB (TNT_FUSION_THRESHOLD)",
        },
    ),
    (("--no-gpu",), {"action": "store_true", "help": "hide GPUs from the ranks"}),
    (
        ("--pin-to-socket",),
        {"action": "store_true", "help": "bind each rank to a NUMA socket with numactl"},
    ),
    (("--python-interpreter",), {"default": None, "help": "the ranks' Python (default: this)"}),
    (("--log-level",), {"default": None, "help": "TNT_LOG_LEVEL on the ranks"}),
    (
        ("--output-on-all-devices",),
        {"action": "store_true", "help": "every rank's output (merged), not only the master's"},
    ),
    (
        ("--collective-timeout",),
        {
            "type": float,
            "default": None,
            "metavar": "SECONDS",
            "help": "bounded wait of every collective on the ranks (default 30 s)",
        },
    ),
    (("--mpiexec",), {"default": None, "help": "MPI launcher (default: $TNT_MPIEXEC or venv's)"}),
    (
        ("--transport",),
        {
            "choices": TRANSPORTS,
            "default": None,
            "help": "between nodes: mpi, or gaspi (GPI-2, where the build has it); "
            "default $TNT_TRANSPORT, else mpi",
        },
    ),
    (
        ("--ssh",),
        {
            "default": None,
            "metavar": "COMMAND",
            "help": "how to reach the hosts (default: $HYDRA_LAUNCHER_EXEC, else ssh)",
        },
    ),
    (("--dry-run",), {"action": "store_true", "help": "print the launch plan, start nothing"}),
]


def plan_from_options(options: Any) -> LaunchPlan:
    """The plan that the launchers' shared options describe (``%tnt_cluster``'s and
    ``tnt-run``'s parsed arguments: attributes named as the options, ``exports`` a list of
    NAME=VALUE); options a launcher does not have, or left out, keep the plan's defaults."""
    exports: dict[str, str] = {}
    for item in getattr(options, "exports", None) or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise PlanError(f"-x {item!r}: expected NAME=VALUE")
        exports[name] = value
    kwargs: dict[str, Any] = {"exports": exports}
    for key, option in (
        ("n", "n"),
        ("hostfile", "hostfile"),
        ("n_per_node", "n_per_node"),
        ("fusion_threshold_kb", "fusion_threshold"),
        ("no_gpu", "no_gpu"),
        ("pin_to_socket", "pin_to_socket"),
        ("log_level", "log_level"),
        ("output_on_all_devices", "output_on_all_devices"),
        ("python", "python_interpreter"),
        ("timeout", "timeout"),
        ("collective_timeout", "collective_timeout"),
        ("mpiexec", "mpiexec"),
        ("controller_ip", "controller_ip"),
        ("ssh", "ssh"),
        ("transport", "transport"),
        ("launcher", "launcher"),
    ):
        value = getattr(options, option, None)
        if value is not None and value is not False:
            kwargs[key] = value
    return LaunchPlan(**kwargs)


def _pin_main(argv: list[str]) -> None:
    """`python -m tnt_notebook.launch --pin-to-socket -- CMD...`: exec CMD under numactl,
    bound to the NUMA node of this rank's local index."""
    cmd = argv[argv.index("--") + 1 :]
    local = int(
        os.environ.get("MPI_LOCALRANKID")
        or os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK")
        or os.environ.get("PMI_RANK")
        or 0
    )
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*")) or [Path("node0")]
    node = int(nodes[local % len(nodes)].name[4:])
    numactl = shutil.which("numactl")
    if numactl is None:
        sys.exit("tnt_notebook: --pin-to-socket needs numactl on every host")
    os.execv(numactl, [numactl, f"--cpunodebind={node}", f"--membind={node}", *cmd])


RANK_STATUS = "\x1etnt-run"  # starts the lines by which script ranks tell tnt-run their state
# How long a failing rank lets the launcher forward its last lines before it aborts the world.
ABORT_GRACE_S = 0.5


def _run_script_main(argv: list[str]) -> None:
    """`python -m tnt_notebook.launch --run-script --profile-dir=D --cluster-id=I -- SCRIPT...`:
    one rank of tnt-run. Only the master rank's stdout is shown (unless
    TNT_OUTPUT_ON_ALL_DEVICES); the rank tells tnt-run its pid and, if it fails, its exit code
    (on stderr, in one write), and a failing rank ends the world at once (MPI_Abort) instead of
    leaving the others waiting in a collective."""
    import runpy
    import traceback

    options, script = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    profile_dir = next(a.split("=", 1)[1] for a in options if a.startswith("--profile-dir="))
    from mpi4py import MPI

    from tnt_notebook.engine_hooks import watch_this_host

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    host = socket.gethostname()

    def status(state: str) -> None:
        os.write(2, f"{RANK_STATUS} rank={rank} pid={os.getpid()} host={host} {state}\n".encode())

    status("started")
    watch_this_host(comm, profile_dir)
    # whole lines in one write each (also under PYTHONUNBUFFERED): ranks' lines do not mix
    sys.stdout.reconfigure(line_buffering=True, write_through=False)
    if rank != 0 and os.environ.get("TNT_OUTPUT_ON_ALL_DEVICES") != "1":
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    sys.argv = list(script)
    sys.path.insert(0, os.path.dirname(os.path.abspath(script[0])))
    code = 0
    try:
        runpy.run_path(script[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the rank's failure, reported and turned into its code
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        status(f"exit={code}")
        if comm.Get_size() > 1:
            # MPI_Abort tears the launcher's proxies down at once, and a proxy on another host
            # drops what it has not forwarded yet (the status line above): give it that long.
            time.sleep(ABORT_GRACE_S)
            comm.Abort(code)
    sys.exit(code)


if __name__ == "__main__":
    if "--pin-to-socket" in sys.argv[1:2]:
        _pin_main(sys.argv)
    elif "--run-script" in sys.argv[1:2]:
        _run_script_main(sys.argv[2:])
    else:
        sys.exit("usage: python -m tnt_notebook.launch --pin-to-socket|--run-script ...")

"""A cluster of MPI ranks that are ipyparallel engines: launch plan, start, stop, status.

One :class:`Cluster` owns an ipyparallel controller and one MPI launcher (``mpiexec``) whose
ranks run ``ipyparallel.engine --mpi``, so engine id == MPI rank. The controller and the
launcher start concurrently: the engine connection info (key, registration port) is chosen
here before either starts and reaches the engines through their inherited environment, so
no rank waits for a connection file. Everything lives in an owner-only temporary profile
directory that is removed at stop; the controller and the launcher die with this process
(``PR_SET_PDEATHSIG`` plus an ``atexit`` hook) even if it is SIGKILLed.

Usable without IPython::

    with Cluster(n=2) as c:
        print(c.view.apply_sync(lambda: 42))
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tnt_notebook import tf_logs
from tnt_notebook.exit_order import ExitOrder
from tnt_notebook.hostfile import (
    HostfileError,
    all_local,
    is_local_host,
    read_hostfile,
    validate_n_per_node,
)

DEFAULT_STARTUP_TIMEOUT = 60.0
DEFAULT_COLLECTIVE_TIMEOUT = 30.0
HEARTBEAT_MS = 500  # hub ping period: engines finish registering within ~1 period
HEARTBEAT_MISSES = 20  # an engine silent for 10 s is declared dead by the hub
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_PR_SET_PDEATHSIG = 1
# the controller draws its engine-facing ports in this order (ipyparallel.controller.app)
ENGINE_PORT_NAMES = ("registration", "control", "mux", "task", "iopub", "hb_ping", "hb_pong")
BROADCAST_LEAVES = 2  # 2**IPController.broadcast_scheduler_depth (default depth 1)


class PlanError(ValueError):
    """Options that do not make a launchable cluster (one-line message)."""


class ClusterError(RuntimeError):
    """Base class of cluster failures at run time."""

    def _render_traceback_(self) -> list[str]:
        """IPython shows the message itself, not this package's call stack."""
        return [f"\x1b[1;31m{type(self).__name__}\x1b[0m: {self}"]


class ClusterStartError(ClusterError):
    """The cluster did not come up; nothing of it is left running."""


class ClusterDeadError(ClusterError):
    """A rank or the launcher died: the MPI world is gone and must be restarted."""


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


@dataclass
class LaunchPlan:
    """Everything needed to launch a cluster; validated on construction, starts nothing.

    Either ``n`` ranks on this machine, or a ``hostfile`` with ``n_per_node`` ranks per host.
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
    hosts: list[str] = field(default_factory=list, init=False)

    def __post_init__(self) -> None:
        if self.hostfile is not None:
            if self.n is not None:
                raise PlanError("give either -n N (one machine) or --hostfile FILE, not both")
            self.n_per_node = validate_n_per_node(1 if self.n_per_node is None else self.n_per_node)
            self.hosts = read_hostfile(self.hostfile)
        else:
            if self.n_per_node is not None:
                raise HostfileError("--n-per-node needs --hostfile (use -n N on one machine)")
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
        if self.pin_to_socket and shutil.which("numactl") is None:
            raise PlanError("--pin-to-socket needs numactl, which is not installed on this machine")
        if self.flavor is None:
            self.flavor = (
                "hydra"
                if self.mpiexec == str(Path(sys.executable).parent / "mpiexec")
                else _launcher_flavor(self.mpiexec)
            )

    @property
    def size(self) -> int:
        """Number of ranks in the world."""
        if self.hostfile is not None:
            return len(self.hosts) * int(self.n_per_node or 1)
        return int(self.n or 1)

    @property
    def local(self) -> bool:
        """True when every rank runs on this machine (controller stays on loopback)."""
        return all_local(self.hosts)

    @property
    def controller_ip(self) -> str:
        """Where the controller listens: loopback, or all interfaces for other hosts."""
        return "127.0.0.1" if self.local else "0.0.0.0"

    def host_of_rank(self, rank: int) -> str:
        """The host a rank is placed on (block placement, as mpiexec -ppn does)."""
        if self.hostfile is None:
            return "localhost"
        return self.hosts[min(rank // int(self.n_per_node or 1), len(self.hosts) - 1)]

    def env_exports(self) -> dict[str, str]:
        """Variables exported on every rank (COMMON contract 2) plus the user's -x values."""
        env = {"TNT_NOTEBOOK_ENGINE": "1", "TNT_COLLECTIVE_TIMEOUT": f"{self.collective_timeout:g}"}
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
        env.update(self.exports)
        return env

    def controller_command(
        self, profile_dir: str, cluster_id: str, ports: list[int] | None = None
    ) -> list[str]:
        """ipyparallel controller, with the engine-facing ports and the key chosen by us."""
        ports = ports or [0] * (len(ENGINE_PORT_NAMES) + BROADCAST_LEAVES)
        return [
            sys.executable,
            "-m",
            "ipyparallel.controller",
            f"--profile-dir={profile_dir}",
            f"--cluster-id={cluster_id}",
            f"--ip={self.controller_ip}",
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
        if self.pin_to_socket:
            cmd = [self.python, "-m", "tnt_notebook.cluster", "--pin-to-socket", "--", *cmd]
        return cmd

    def launcher_command(self, profile_dir: str, cluster_id: str) -> list[str]:
        """mpiexec with the world size, placement, exported variables and the engine command."""
        cmd = [self.mpiexec]
        env = self.env_exports()
        if self.flavor == "openmpi":
            if self.hostfile is not None:
                hostfile = os.path.join(profile_dir, "hostfile")
                cmd += ["--hostfile", hostfile, "--npernode", str(self.n_per_node)]
            cmd += ["-n", str(self.size), "--wdir", self.cwd, "-x", "IPP_CONNECTION_INFO"]
            for k, v in env.items():
                cmd += ["-x", f"{k}={v}"]
        else:
            cmd += ["-n", str(self.size)]
            if self.hostfile is not None:
                cmd += ["-f", os.path.join(profile_dir, "hostfile"), "-ppn", str(self.n_per_node)]
            cmd += ["-wdir", self.cwd]
            for k, v in env.items():
                cmd += ["-genv", k, v]
        return cmd + self.engine_command(profile_dir, cluster_id)

    def commands(
        self, profile_dir: str = "PROFILE_DIR", cluster_id: str = "CLUSTER_ID", ports: Any = None
    ) -> list[list[str]]:
        """The exact commands start() runs: [controller, launcher] (both start concurrently)."""
        return [
            self.controller_command(profile_dir, cluster_id, ports),
            self.launcher_command(profile_dir, cluster_id),
        ]

    def describe(self) -> str:
        """Human-readable launch plan for --dry-run."""
        where = (
            f"{len(self.hosts)} host(s) from {self.hostfile} x {self.n_per_node} per node"
            if self.hostfile is not None
            else "this machine"
        )
        lines = [
            f"tnt cluster launch plan: {self.size} rank(s) on {where}",
            f"  hosts: {', '.join(self.hosts)}",
            f"  controller listens on {self.controller_ip}; MPI launcher {self.mpiexec}"
            f" ({self.flavor})",
            f"  engines' working directory: {self.cwd}",
            f"  start-up timeout: {self.timeout:g} s",
            "  exported on every rank:",
            *(f"    {k}={v!r}" for k, v in self.env_exports().items()),
            "  (the engine connection info reaches the ranks in IPP_CONNECTION_INFO, inherited)",
            "commands (started concurrently):",
        ]
        ports = [f"PORT{i}" for i in range(len(ENGINE_PORT_NAMES) + BROADCAST_LEAVES)]
        for cmd in self.commands(ports=ports):
            lines.append("  " + shlex.join(cmd))
        return "\n".join(lines)


@dataclass
class RankInfo:
    """One rank as the readiness check saw it."""

    rank: int
    host: str
    pid: int
    alive: bool = True
    local: bool = True  # on this machine: its pid can be watched directly


def _rank_info() -> dict[str, Any]:
    """Runs on every engine at start-up: who am I in the MPI world."""
    import os
    import socket

    from mpi4py import MPI  # already initialised by `ipyparallel.engine --mpi`

    from tnt_notebook import tf_logs
    from tnt_notebook.remote import guard_engine_interrupts

    guard_engine_interrupts()
    tf_logs.quiet_import()
    comm = MPI.COMM_WORLD
    return {
        "rank": comm.Get_rank(),
        "size": comm.Get_size(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
    }


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the notebook kernel dies, even by SIGKILL."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


_PROFILE_PREFIX = "tnt-cluster-"


def _owner_stamp(pid: int) -> str:
    import psutil

    try:
        return f"{pid} {psutil.Process(pid).create_time():.3f}"
    except psutil.Error:
        return f"{pid} 0"


def _remove_stale_profile_dirs() -> None:
    """Profile dirs of kernels that were SIGKILLed (no atexit ran): their owner is gone."""
    for d in Path(tempfile.gettempdir()).glob(_PROFILE_PREFIX + "*"):
        try:
            if d.stat().st_uid != os.getuid():
                continue
            pid = int((d / "owner").read_text().split()[0])
            if _owner_stamp(pid) != (d / "owner").read_text() or not _pid_alive(pid):
                shutil.rmtree(d, ignore_errors=True)
        except (OSError, ValueError, IndexError):
            continue


def _controller_child() -> None:
    """preexec_fn of the controller: dies with us, and writes owner-only files."""
    os.umask(0o077)
    _die_with_parent()


def _free_ports(ip: str, n: int) -> list[int]:
    """n distinct ports free right now (all held open together so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((ip if ip != "0.0.0.0" else "", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _write_private(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    text = text.strip()
    return text if len(text) <= limit else "...\n" + text[-limit:]


_HYDRA_DEAD_RE = re.compile(
    r"PID (\d+) RUNNING AT (\S+)\s*\n=\s*KILLED BY SIGNAL: (\d+)|"
    r"PID (\d+) RUNNING AT (\S+)\s*\n=\s*EXIT CODE: (\d+)"
)

_RUNNING: weakref.WeakSet[Cluster] = weakref.WeakSet()


@atexit.register
def _stop_all_clusters() -> None:
    # the kernel's manager kills a kernel that takes long to exit: be quick, not polite
    for c in list(_RUNNING):
        try:
            c.kill("the notebook kernel exited")
        except Exception:  # noqa: BLE001 - interpreter exit: best effort, never raise
            pass


class Cluster:
    """An MPI world of ipyparallel engines; a context manager that always cleans up."""

    def __init__(self, plan: LaunchPlan | None = None, **options: Any) -> None:
        if plan is not None and options:
            raise TypeError("give a LaunchPlan or keyword options, not both")
        self.plan = plan if plan is not None else LaunchPlan(**options)
        self.client: Any = None
        self.view: Any = None
        self.ranks: list[RankInfo] = []
        self.profile_dir: str | None = None
        self.cluster_id = ""
        self.startup_seconds: float | None = None
        self.dead_reason: str | None = None
        self._controller: subprocess.Popen | None = None
        self._launcher: subprocess.Popen | None = None
        self._lock = threading.RLock()
        self._tracked: list[Any] = []  # psutil.Process of every descendant seen at start
        self._exits: ExitOrder | None = None  # which local rank exited first, once one has

    # ----------------------------------------------------------------- lifecycle
    @property
    def running(self) -> bool:
        """True between a successful start() and stop() (even if a rank has died since)."""
        return self.client is not None

    @property
    def size(self) -> int:
        return self.plan.size

    def start(self) -> Cluster:
        """Launch controller and ranks, wait until every rank answers; on failure leave nothing."""
        with self._lock:
            if self.running or self._launcher is not None:
                raise ClusterError("this cluster is already running; stop() or restart() it first")
            t0 = time.perf_counter()
            self.dead_reason = None
            for attempt in (1, 2):
                try:
                    self._launch()
                    self._wait_ready(t0 + self.plan.timeout)
                    break
                except ClusterStartError as e:
                    self._teardown(polite=False)
                    # ports are chosen free, then bound by the controller: another process
                    # may take one in between; that (only) is worth a second try
                    if attempt == 2 or "Address already in use" not in str(e):
                        raise
                except BaseException:
                    self._teardown(polite=False)
                    raise
            self.startup_seconds = time.perf_counter() - t0
            _RUNNING.add(self)
            return self

    def _launch(self) -> None:
        plan = self.plan
        _remove_stale_profile_dirs()
        self.profile_dir = tempfile.mkdtemp(prefix=_PROFILE_PREFIX)  # mode 0700
        _write_private(os.path.join(self.profile_dir, "owner"), _owner_stamp(os.getpid()))
        security = os.path.join(self.profile_dir, "security")
        for sub in ("security", "log", "startup", "pid", "static"):  # owner-only, before
            os.mkdir(os.path.join(self.profile_dir, sub), 0o700)  # ipyparallel creates them
        self.cluster_id = uuid.uuid4().hex[:12]
        key = uuid.uuid4().hex
        _write_private(os.path.join(security, "key"), key)
        if plan.hostfile is not None:
            _write_private(os.path.join(self.profile_dir, "hostfile"), "\n".join(plan.hosts) + "\n")
        ports = _free_ports(plan.controller_ip, len(ENGINE_PORT_NAMES) + BROADCAST_LEAVES)
        location = "127.0.0.1" if plan.local else socket.gethostname()
        interface = "127.0.0.1" if plan.local else _routable_ip()
        engine_info = {
            "key": key,
            "signature_scheme": "hmac-sha256",
            "location": location,
            "interface": f"tcp://{interface}",
            **dict(zip(ENGINE_PORT_NAMES, ports, strict=False)),
            "broadcast": ports[len(ENGINE_PORT_NAMES) :],
            "pack": "json",
            "unpack": "json",
            "ssh": "",
        }
        controller_cmd, launcher_cmd = plan.commands(self.profile_dir, self.cluster_id, ports)
        env = dict(os.environ)
        env.pop("IPP_CONNECTION_INFO", None)
        ctrl_log = open(os.path.join(self.profile_dir, "controller.log"), "wb")  # noqa: SIM115
        os.chmod(ctrl_log.name, 0o600)
        self._ctrl_log_path = ctrl_log.name
        with ctrl_log:
            self._controller = subprocess.Popen(
                controller_cmd,
                stdin=subprocess.DEVNULL,
                stdout=ctrl_log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.profile_dir,
                start_new_session=True,
                preexec_fn=_controller_child,
            )
        env["IPP_CONNECTION_INFO"] = json.dumps(engine_info)
        env["PYTHONUNBUFFERED"] = "1"
        self._out_path = os.path.join(self.profile_dir, "launcher.out")
        self._err_path = os.path.join(self.profile_dir, "launcher.err")
        with open(self._out_path, "wb") as out, open(self._err_path, "wb") as err:
            os.chmod(out.name, 0o600)
            os.chmod(err.name, 0o600)
            self._launcher = subprocess.Popen(
                launcher_cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                env=env,
                cwd=plan.cwd,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )

    def _launch_failure(self, what: str, missing: list[int] | None = None) -> ClusterStartError:
        parts = [what]
        if missing:
            hosts = sorted({self.plan.host_of_rank(r) for r in missing})
            parts.append(
                f"rank(s) {_ranges(missing)} on host(s) {', '.join(hosts)} did not come up"
            )
        launcher = self._launcher
        if launcher is not None and launcher.poll() is not None and "launcher exited" not in what:
            parts.append(f"the MPI launcher exited with code {launcher.returncode}")
        stderr = _tail(self._err_path) if hasattr(self, "_err_path") else ""
        stdout = _tail(self._out_path, 2000) if hasattr(self, "_out_path") else ""
        msg = "; ".join(parts)
        if stderr:
            msg += f"\n--- launcher stderr ---\n{stderr}"
        if stdout:
            msg += f"\n--- launcher stdout ---\n{stdout}"
        ctrl = self._controller
        ctrl_log = _tail(getattr(self, "_ctrl_log_path", ""))
        if ctrl is not None and (ctrl.poll() is not None or ctrl_log):
            state = "running" if ctrl.poll() is None else f"exited {ctrl.returncode}"
            msg += f"\n--- controller ({state}) ---\n{ctrl_log}"
        return ClusterStartError(msg)

    def _check_processes(self) -> str | None:
        if self._controller is not None and self._controller.poll() is not None:
            return f"the ipyparallel controller exited (code {self._controller.returncode})"
        if self._launcher is not None and self._launcher.poll() is not None:
            return f"the MPI launcher exited (code {self._launcher.returncode})"
        return None

    def _wait_ready(self, deadline: float) -> None:
        import ipyparallel as ipp

        n = self.plan.size
        url_file = os.path.join(
            self.profile_dir or "", "security", f"ipcontroller-{self.cluster_id}-client.json"
        )
        while True:  # the controller writes its client file once it listens
            problem = self._check_processes()
            if problem:
                raise self._launch_failure(f"start-up failed: {problem}", list(range(n)))
            try:
                with open(url_file) as f:
                    connection_info = json.load(f)
                break
            except (OSError, ValueError):
                pass
            if time.perf_counter() > deadline:
                raise self._launch_failure(
                    f"the controller did not start within {self.plan.timeout:g} s", list(range(n))
                )
            time.sleep(0.01)
        self.client = ipp.Client(connection_info, timeout=max(1.0, deadline - time.perf_counter()))
        while len(self.client.ids) < n:
            problem = self._check_processes()
            if problem:
                missing = sorted(set(range(n)) - set(self.client.ids))
                raise self._launch_failure(f"start-up failed: {problem}", missing)
            if time.perf_counter() > deadline:
                missing = sorted(set(range(n)) - set(self.client.ids))
                raise self._launch_failure(
                    f"only {len(self.client.ids)} of {n} ranks registered within "
                    f"{self.plan.timeout:g} s",
                    missing,
                )
            time.sleep(0.01)
        ids = sorted(self.client.ids)
        if ids != list(range(n)):
            raise self._launch_failure(f"engine ids {ids} are not the MPI ranks 0..{n - 1}")
        self.view = self.client.direct_view(targets=ids)
        self.view.block = False
        ar = self.view.apply_async(_rank_info)
        try:
            infos = ar.get(timeout=max(0.1, deadline - time.perf_counter()))
        except Exception as e:
            raise self._launch_failure(f"the readiness check failed: {e}") from None
        bad = [
            (eid, i)
            for eid, i in zip(ids, infos, strict=True)
            if i["rank"] != eid or i["size"] != n
        ]
        if bad:
            raise self._launch_failure(
                "engine id != MPI rank: "
                + ", ".join(f"engine {e} is rank {i['rank']} of {i['size']}" for e, i in bad)
            )
        self.ranks = [
            RankInfo(i["rank"], i["host"], i["pid"], local=is_local_host(i["host"])) for i in infos
        ]
        self._tracked = _descendants([self._launcher, self._controller])
        self._exits = ExitOrder({r.pid: r.rank for r in self.ranks if r.local})

    def stop(self) -> None:
        """Shut down engines and controller, then signal, then kill; remove every file."""
        with self._lock:
            _RUNNING.discard(self)
            self._teardown(polite=self.dead_reason is None)

    def kill(self, reason: str) -> None:
        """Take the world down at once (a rank died or hangs); status() reports it dead."""
        with self._lock:
            _RUNNING.discard(self)
            self._teardown(polite=False, term_grace=0.5)
            self.dead_reason = reason

    def restart(self) -> Cluster:
        """Stop (if running) and start again with the same plan."""
        self.stop()
        return self.start()

    def _teardown(self, polite: bool, term_grace: float = 2.0) -> None:
        client, self.client, self.view = self.client, None, None
        asked = False
        if client is not None and polite:
            try:
                # Engines only, without waiting: with hub=True ipyparallel waits for every
                # engine's reply with no deadline, and a rank stuck in C code never replies.
                client.shutdown(targets="all", block=False)
                asked = True
            except Exception:  # noqa: BLE001 - dead engines: fall through to signals
                pass
        procs = [p for p in (self._launcher, self._controller) if p is not None]
        tracked = self._tracked + _descendants(procs)
        # the processes have read all they need: remove the files first, so that a kernel
        # killed during a slow shutdown leaves nothing behind
        profile_dir, self.profile_dir = self.profile_dir, None
        if profile_dir:
            shutil.rmtree(profile_dir, ignore_errors=True)
        if asked and self._launcher is not None:  # the ranks exit, and with them mpiexec
            _wait_until(self._launcher, time.monotonic() + 2.0)
        # The controller is stopped by SIGTERM, as ipyparallel's own launchers do; ranks that
        # had to be signalled count as forced: they may not have reached MPI_Finalize.
        forced = not polite
        for sig, grace in ((signal.SIGTERM, term_grace), (signal.SIGKILL, 5.0)):
            alive = [p for p in procs if p.poll() is None or _group_alive(p.pid)]
            if not alive:
                break
            forced = forced or self._launcher in alive
            for p in alive:
                _killpg(p.pid, sig)
            deadline = time.monotonic() + grace
            for p in alive:
                _wait_until(p, deadline)
                while _group_alive(p.pid) and time.monotonic() < deadline:
                    time.sleep(0.02)
        for p in procs:
            try:
                p.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        _terminate(tracked)  # e.g. engine nannies, which run in sessions of their own
        self._tracked = []
        if self._exits is not None:  # a death was reported before the teardown
            self._exits.close()
            self._exits = None
        if profile_dir:  # again: a controller slow to exit may have written into it meanwhile
            shutil.rmtree(profile_dir, ignore_errors=True)
        if forced and procs:  # ranks that never reached MPI_Finalize leave MPICH's segments
            from tnt_notebook.cleanup import remove_orphaned_mpi_segments

            try:
                remove_orphaned_mpi_segments()
            except OSError:
                pass
        if client is not None:
            try:
                client.close(linger=0)
            except Exception:  # noqa: BLE001
                pass
        self._launcher = self._controller = None
        for r in self.ranks:
            r.alive = False

    def __enter__(self) -> Cluster:
        if not self.running:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __del__(self) -> None:
        if getattr(self, "_launcher", None) is not None:
            try:
                self.stop()
            except Exception:  # noqa: BLE001
                pass

    # ----------------------------------------------------------------- health
    def check_alive(self, first_hint: int | None = None) -> str | None:
        """None while the world is intact, else (and from then on) why it is dead, naming the
        rank that died first: seen exiting first, else ``first_hint`` (the rank whose engine the
        hub lost first, for ranks on other hosts)."""
        if self.dead_reason is not None:
            return self.dead_reason
        if self.client is None:
            return None
        reason = None
        launcher = self._launcher
        if launcher is not None and launcher.poll() is not None:
            reason = self._describe_death()
        elif self._controller is not None and self._controller.poll() is not None:
            reason = f"the ipyparallel controller exited (code {self._controller.returncode})"
        else:
            missing = sorted(set(range(self.size)) - set(self.client.ids))
            dead_local = [r.rank for r in self.ranks if r.local and not _pid_alive(r.pid)]
            gone = sorted(set(missing) | set(dead_local))
            if gone:
                reason = f"rank(s) {_ranges(gone)} died" + _where(self.ranks, gone)
        if reason is not None:
            first = self._exits.first(timeout=0.1) if self._exits is not None else None
            first = first_hint if first is None else first
            if first is not None and not reason.startswith((f"rank {first} ", f"rank(s) {first} ")):
                reason = f"rank {first} died first; {reason}"
            self.dead_reason = reason
            for r in self.ranks:
                r.alive = False
        return reason

    def _describe_death(self) -> str:
        stderr = _tail(getattr(self, "_err_path", ""), 20000)
        by_pid = {r.pid: r for r in self.ranks}
        for m in _HYDRA_DEAD_RE.finditer(stderr):
            pid = int(m.group(1) or m.group(4))
            r = by_pid.get(pid)
            if r is not None:
                how = (
                    f"killed by signal {_signame(int(m.group(3)))}"
                    if m.group(3)
                    else f"exit code {m.group(6)}"
                )
                return f"rank {r.rank} (pid {r.pid} on {r.host}) died ({how})"
        dead = [r.rank for r in self.ranks if r.local and not _pid_alive(r.pid)]
        code = self._launcher.returncode if self._launcher is not None else None
        if dead:
            return (
                f"rank(s) {_ranges(dead)} died{_where(self.ranks, dead)}; mpiexec exited ({code})"
            )
        return f"the MPI launcher exited (code {code})"

    def status(self) -> list[RankInfo]:
        """The ranks with an up-to-date alive flag."""
        self.check_alive()
        ids = set(self.client.ids) if self.client is not None else set()
        for r in self.ranks:
            r.alive = (
                self.dead_reason is None and r.rank in ids and (not r.local or _pid_alive(r.pid))
            )
        return list(self.ranks)

    def status_text(self) -> str:
        """The table that %tnt_cluster status prints."""
        if self.dead_reason is not None and not self.running:
            return (
                f"tnt cluster ({self.size} rank(s)) is DEAD: {self.dead_reason}\n"
                "restart it with: %tnt_cluster restart"
            )
        if not self.running:
            return "no tnt cluster is running (start one with %tnt_cluster -n N)"
        rows = self.status()
        state = "DEAD: " + self.dead_reason if self.dead_reason else "running"
        lines = [
            f"tnt cluster: {self.size} rank(s), {state}",
            f"{'rank':>4}  {'host':<24} {'pid':>8}  alive",
        ]
        lines += [
            f"{r.rank:>4}  {r.host:<24} {r.pid:>8}  {'yes' if r.alive else 'NO'}" for r in rows
        ]
        if self.dead_reason:
            lines.append("restart it with: %tnt_cluster restart")
        return "\n".join(lines)

    # ----------------------------------------------------------------- data
    def _require_alive(self) -> None:
        if self.dead_reason is not None:
            raise ClusterDeadError(
                f"{self.dead_reason}; the cluster is dead. Restart it with: %tnt_cluster restart"
            )
        if not self.running:
            raise ClusterError("no tnt cluster is running (start one with %tnt_cluster -n N)")
        reason = self.check_alive()
        if reason:
            raise ClusterDeadError(
                f"{reason}; the cluster is dead. Restart it with: %tnt_cluster restart"
            )

    def push(
        self, namespace: dict[str, Any], targets: list[int] | None = None, timeout: float = 60
    ) -> None:
        """Send notebook values to the ranks' namespaces (all ranks by default)."""
        self._require_alive()
        view = self.client.direct_view(targets=self._targets(targets))
        view.push(namespace, block=False).get(timeout=timeout)

    def pull(
        self,
        name: str,
        all_ranks: bool = False,
        targets: list[int] | None = None,
        timeout: float = 60,
    ) -> Any:
        """The master rank's value of `name`, or every (targeted) rank's value as a list."""
        self._require_alive()
        tg = self._targets(targets)
        if not all_ranks:
            tg = tg[:1]
        from ipyparallel.error import CompositeError, RemoteError

        ar = self.client.direct_view(targets=tg).pull(name, block=False)
        try:
            values = ar.get(timeout=timeout)
        except (CompositeError, RemoteError) as e:
            if "NameError" in str(e):
                failed = [
                    t
                    for t, r in zip(tg, ar.get(return_exceptions=True), strict=True)
                    if isinstance(r, RemoteError)
                ]
                raise NameError(f"{name!r} is not defined on rank(s) {_ranges(failed)}") from None
            raise
        return values if all_ranks else values[0]

    def _targets(self, targets: list[int] | None) -> list[int]:
        if targets is None:
            return list(range(self.size))
        bad = [t for t in targets if not 0 <= t < self.size]
        if bad:
            raise ValueError(f"no rank(s) {bad} in a world of {self.size}")
        return sorted(set(targets))


def _routable_ip() -> str:
    """This host's address as other hosts see it (the route to a public address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    out: list[str] = []
    ranks = sorted(set(ranks))
    i = 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ",".join(out)


def _where(ranks: list[RankInfo], which: list[int]) -> str:
    info = [f"rank {r.rank}: pid {r.pid} on {r.host}" for r in ranks if r.rank in which]
    return f" ({'; '.join(info)})" if info else ""


def _signame(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return str(num)


def _pid_alive(pid: int) -> bool:
    try:
        import psutil

        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except Exception:  # noqa: BLE001 - NoSuchProcess, AccessDenied
        return False


def _wait_until(p: subprocess.Popen, deadline: float) -> None:
    try:
        p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass


def _killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # zombies of our own children still count; Popen.wait reaps them
    return True


def _descendants(procs: list[subprocess.Popen | None]) -> list[Any]:
    import psutil

    out = []
    for p in procs:
        if p is None:
            continue
        try:
            out += psutil.Process(p.pid).children(recursive=True)
        except psutil.Error:
            pass
    return out


def _terminate(procs: list[Any]) -> None:
    """SIGTERM, then SIGKILL after a grace period, whatever of `procs` still runs."""
    import psutil

    alive = [p for p in procs if _running(p)]
    for sig_fn in ("terminate", "kill"):
        if not alive:
            return
        for p in alive:
            try:
                getattr(p, sig_fn)()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(alive, timeout=2.0)
        alive = [p for p in alive if _running(p)]


def _running(p: Any) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _pin_main(argv: list[str]) -> None:
    """`python -m tnt_notebook.cluster --pin-to-socket -- CMD...`: exec CMD under numactl,
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


if __name__ == "__main__":
    if "--pin-to-socket" in sys.argv:
        _pin_main(sys.argv)
    else:
        sys.exit("usage: python -m tnt_notebook.cluster --pin-to-socket -- COMMAND...")

"""The launch plan: which hosts, how many ranks where, what each rank gets, and the exact
commands that start a cluster. Validated on construction, starts nothing; shared by
``%tnt_cluster`` and ``tnt-run`` (:mod:`tnt_notebook.cluster.options`).

Ranks run on this machine (``-n``), on the hosts of a hostfile reached with ssh, or on the nodes
of the Slurm allocation this process runs in (neither ``-n`` nor ``--hostfile`` given): there they
are one job step, started by Hydra's Slurm bootstrap (``mpiexec -launcher slurm``: srun starts
its proxies) or by ``srun`` itself, one rank per task (``--launcher srun``); a hostfile naming only
nodes of the allocation is launched through Slurm too. Which launcher backend starts them is
:mod:`tnt_notebook.cluster.launchers`' choice.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import sys
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from tnt_notebook import settings
from tnt_notebook.cluster.addresses import address_hosts_reach, ssh_target
from tnt_notebook.cluster.devices import Devices, choose_devices
from tnt_notebook.cluster.errors import HostfileError, PlanError
from tnt_notebook.cluster.gpu_inventory import Gpu, node_inventories, offered
from tnt_notebook.cluster.hostfile import all_local, read_hostfile, validate_n_per_node
from tnt_notebook.cluster.launchers import (
    LAUNCHERS,
    Launcher,
    default_mpiexec,
    launcher_flavor,
    launcher_for,
)
from tnt_notebook.cluster.slurm import SlurmAllocation, SlurmError, step_name
from tnt_notebook.rank import pin_to_socket, run_script, tf_logs
from tnt_notebook.transport import built_transports, mpi_env_defaults, require

DEFAULT_STARTUP_TIMEOUT = 60.0
DEFAULT_COLLECTIVE_TIMEOUT = settings.COLLECTIVE_TIMEOUT.default
HEARTBEAT_MS = 500  # hub ping period: engines finish registering within ~1 period
HEARTBEAT_MISSES = 20  # an engine silent for 10 s is declared dead by the hub
LOG_LEVELS = settings.LOG_LEVEL.kind
_ENV_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# the controller draws its engine-facing ports in this order (ipyparallel.controller.app)
ENGINE_PORT_NAMES = ("registration", "control", "mux", "task", "iopub", "hb_ping", "hb_pong")
BROADCAST_LEAVES = 2  # 2**IPController.broadcast_scheduler_depth (default depth 1)


def kb_to_bytes(kb: float) -> int:
    """``--fusion-threshold`` counts KB (Tarantella's unit, 1024 bytes); the ranks count bytes."""
    return int(round(kb * 1024))


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
    fusion_threshold_kb: float | None = None  # Tarantella's unit; the ranks get bytes
    no_gpu: bool = False
    reproducible: bool = False  # tnt.Model's reproducible mode on every rank
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
    transport: str = field(
        default_factory=lambda: os.environ.get(settings.TRANSPORT.name, "") or "mpi"
    )
    launcher: str = "mpiexec"
    slurm: SlurmAllocation | None = None  # default: the allocation this process runs in
    hosts: list[str] = field(default_factory=list, init=False)
    devices: Devices = field(init=False, repr=False)  # ranks per node and their devices
    launch: Launcher = field(init=False, repr=False)  # the backend that starts the ranks

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
            requested = None if self.n_per_node is None else validate_n_per_node(self.n_per_node)
            self.hosts = read_hostfile(self.hostfile)
            if self.slurm is not None and not set(self.hosts) <= set(self.slurm.nodes):
                self.slurm = None  # hosts outside the allocation: reached with ssh
        elif self.slurm is not None:
            self.hosts = list(self.slurm.nodes)
            requested = None if self.n_per_node is None else validate_n_per_node(self.n_per_node)
        else:
            if self.n_per_node is not None:
                raise HostfileError(
                    "--n-per-node needs --hostfile or a Slurm allocation (use -n N on one machine)"
                )
            requested = self.n
            if requested is not None and (
                isinstance(requested, bool) or not isinstance(requested, int) or requested < 1
            ):
                raise PlanError(f"-n must be a positive integer, got {self.n!r}")
            self.hosts = ["localhost"]
        for name, value in self.exports.items():
            if not _ENV_NAME_RE.match(name):
                raise PlanError(f"-x {name}={value}: {name!r} is not an environment variable name")
        if self.fusion_threshold_kb is not None:
            try:
                settings.FUSION_THRESHOLD.check(
                    self.fusion_threshold_kb, "--fusion-threshold", "KB"
                )
            except ValueError as e:
                raise PlanError(str(e)) from None
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
        if self.transport not in settings.TRANSPORT.kind:
            raise PlanError(f"--transport must be one of {', '.join(settings.TRANSPORT.kind)}")
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
        self.devices = self._choose_devices(requested)
        if self.per_host:
            self.n_per_node = self.devices.per_node
        else:
            self.n = self.devices.per_node
        if self.flavor is None:
            self.flavor = launcher_flavor(self.mpiexec)
        self.launch = launcher_for(self)

    def _choose_devices(self, requested: int | None) -> Devices:
        """Tarantella's launch rules (:mod:`tnt_notebook.cluster.devices`) on the GPUs each host
        offers: inside Slurm those it grants per node, else those probed on each host that
        ``CUDA_VISIBLE_DEVICES`` (-x, else this process's, which the ranks inherit) leaves."""
        if self.no_gpu:
            found: dict[str, list[Gpu] | str] = {}
        elif self.slurm is not None:
            granted = [Gpu(i, "granted by Slurm") for i in range(self.slurm.gpus_granted())]
            found = {h: granted for h in self.hosts}
        else:
            inherited = os.environ.get("CUDA_VISIBLE_DEVICES")
            visible = self.exports.get("CUDA_VISIBLE_DEVICES", inherited)
            probed = node_inventories(self.hosts, self.remote_command, self.python)
            found = {h: g if isinstance(g, str) else offered(g, visible) for h, g in probed.items()}
        gpus_found = any(g and not isinstance(g, str) for g in found.values())
        slurm_default = self.slurm is not None and self.hostfile is None and requested is None
        return choose_devices(
            found,
            requested,
            no_gpu=self.no_gpu,
            cpu_default=self.slurm.per_node() if slurm_default and not gpus_found else 1,
            warn_without_gpus=self.slurm is None,
        )

    def device_of_rank(self, rank: int) -> str:
        """The device a rank trains on, in words (dry run, status)."""
        return self.devices.of(self.host_of_rank(rank), rank % self.devices.per_node)

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

    def env_exports(self, notebook: bool = True) -> dict[str, str]:
        """The settings (:mod:`tnt_notebook.settings`) the options give every rank, plus the
        user's -x values; ranks that are a script's (tnt-run), not a notebook's, are not told
        they are a notebook's."""
        pairs: list[tuple[settings.Setting, Any]] = (
            [(settings.NOTEBOOK_RANK, True)] if notebook else []
        )
        pairs += [
            (settings.COLLECTIVE_TIMEOUT, self.collective_timeout),
            (settings.TRANSPORT, self.transport),
        ]
        if self.fusion_threshold_kb is not None:
            pairs.append((settings.FUSION_THRESHOLD, kb_to_bytes(self.fusion_threshold_kb)))
        if self.log_level:
            pairs.append((settings.LOG_LEVEL, self.log_level))
        if self.output_on_all_devices:
            pairs.append((settings.OUTPUT_ON_ALL_DEVICES, True))
        if self.no_gpu:
            pairs.append((settings.NO_GPU, True))
        if self.devices.gpus is not None:
            pairs.append((settings.GPU_PER_RANK, True))
        if self.reproducible:
            pairs.append((settings.REPRODUCIBLE, True))
        env = settings.exported(pairs)
        env.update(tf_logs.log_environment(self.log_level))
        if self.devices.gpus is None:  # the CPU: no rank initialises a GPU, nor reserves memory
            env["CUDA_VISIBLE_DEVICES"] = ""
        else:  # each rank's GPU memory grows as it needs, beside the node's other ranks
            env["TF_FORCE_GPU_ALLOW_GROWTH"] = "true"
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

    def notebook_rank_command(self, profile_dir: str, cluster_id: str) -> list[str]:
        """One rank of a notebook's cluster: an ipyparallel engine in MPI mode (engine id == MPI
        rank)."""
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
        runner = [self.python, "-m", run_script.__name__]
        runner += [f"--profile-dir={profile_dir}", f"--cluster-id={cluster_id}", "--"]
        return self._pinned([*runner, *script])

    def _pinned(self, cmd: list[str]) -> list[str]:
        if self.pin_to_socket:
            return [self.python, "-m", pin_to_socket.__name__, "--", *cmd]
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
        """The owner-only files the launcher reads (the hostfile, the wrapper through which
        Hydra reaches hosts that are other machines: srun inside a Slurm allocation, else ssh)."""
        self.launch.write_files(profile_dir, cluster_id)

    def launcher_command(
        self,
        profile_dir: str,
        cluster_id: str,
        address: str | None = None,
        program: list[str] | None = None,
    ) -> list[str]:
        """mpiexec (or srun) with the world size, placement, exported variables and the notebook
        rank's command (or `program`, a script's ranks for tnt-run)."""
        env = self.env_exports(notebook=program is None)
        program = program or self.notebook_rank_command(profile_dir, cluster_id)
        return self.launch.command(profile_dir, cluster_id, env, program, address)

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
        lines = [*head, *self._device_lines(), "  exported on every rank:"]
        lines += [f"    {k}={v!r}" for k, v in self.env_exports(notebook=script is None).items()]
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

    def _device_lines(self) -> list[str]:
        """Each rank's device (one line for ranks all on the CPU) and the rules' warning."""
        lines = [f"  WARNING: {self.devices.warning}"] if self.devices.warning else []
        if self.devices.gpus is None:
            return [*lines, "  devices: every rank on the CPU (CUDA_VISIBLE_DEVICES='')"]
        lines.append("  devices: one GPU per rank, memory growth on (TF_FORCE_GPU_ALLOW_GROWTH)")
        return lines + [
            f"    rank {r} on {self.host_of_rank(r)}: {self.device_of_rank(r)}"
            for r in range(self.size)
        ]

"""A cluster of MPI ranks that are ipyparallel engines: start, stop, restart, status, health.

One :class:`Cluster` runs a :class:`~tnt_notebook.cluster.plan.LaunchPlan`: it owns an ipyparallel
controller and one MPI launcher (``mpiexec``) whose ranks run ``ipyparallel.engine --mpi``, so
engine id == MPI rank. The controller and the launcher start concurrently: the engine connection
info (key, registration port) is chosen here before either starts and reaches the engines through
their inherited environment, so no rank waits for a connection file. Everything lives in an
owner-only temporary profile directory that is removed at stop; the controller and the launcher
die with this process (``PR_SET_PDEATHSIG`` plus an ``atexit`` hook) even if it is SIGKILLed.

Security: on loopback, messages are signed (HMAC key). When a rank is on another host, the
controller listens only on the address the hosts reach, and every ZeroMQ connection is also
encrypted with CurveZMQ; the client and the engines must know the controller's public key, which
travels like the HMAC key (owner-only files here, the launcher's environment to the ranks).

Over 500 lines: one class, whose start, watch and teardown share the processes it owns.

Usable without IPython::

    with Cluster(n=2) as c:
        print(c.view.apply_sync(lambda: 42))
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from typing import Any

from tnt_notebook.cluster import ipyparallel_compat
from tnt_notebook.cluster.addresses import free_ports
from tnt_notebook.cluster.cleanup import OWNER_FILE, PROFILE_PREFIX, end_leftover_ranks_on_hosts
from tnt_notebook.cluster.hostfile import is_local_host
from tnt_notebook.cluster.launchers import write_private
from tnt_notebook.cluster.plan import BROADCAST_LEAVES, ENGINE_PORT_NAMES, LaunchPlan
from tnt_notebook.cluster.processes import (
    ExitOrder,
    descendants,
    die_with_parent,
    group_alive,
    killpg,
    owner_only_child,
    pid_alive,
    terminate,
    wait_until,
)
from tnt_notebook.cluster.profile_dir import (
    owner_stamp,
    remove_stale_profile_dirs,
    write_curve_config,
)
from tnt_notebook.cluster.rank_ranges import rank_ranges
from tnt_notebook.cluster.reports import hydra_deaths, srun_deaths, srun_launch_error, ssh_failures
from tnt_notebook.cluster.slurm import step_name
from tnt_notebook.cluster.stacks import DEFAULT_WAIT, StackReport, gather
from tnt_notebook.rank.device import in_words as device_in_words
from tnt_notebook.rank.ipyparallel_hooks import rank_info, start_native_engine


class ClusterError(RuntimeError):
    """Base class of cluster failures at run time."""

    def _render_traceback_(self) -> list[str]:
        """IPython shows the message itself, not this package's call stack."""
        return [f"\x1b[1;31m{type(self).__name__}\x1b[0m: {self}"]


class ClusterStartError(ClusterError):
    """The cluster did not come up; nothing of it is left running."""


class ClusterDeadError(ClusterError):
    """A rank or the launcher died: the MPI world is gone and must be restarted."""


@dataclass
class RankInfo:
    """One rank as the readiness check saw it."""

    rank: int
    host: str
    pid: int
    alive: bool = True
    local: bool = True  # on this machine: its pid can be watched directly
    device: str = "CPU"  # what it trains on, in words


def _tail(path: str, limit: int = 4000) -> str:
    try:
        with open(path, errors="replace") as f:
            text = f.read()
    except OSError:
        return ""
    text = text.strip()
    return text if len(text) <= limit else "...\n" + text[-limit:]


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
        self._lost: list[int] = []  # the ranks whose engines the hub lost, in its order

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
                    self._end_remote_ranks()
                    # ports are chosen free, then bound by the controller: another process
                    # may take one in between; that (only) is worth a second try
                    if attempt == 2 or "Address already in use" not in str(e):
                        raise
                except BaseException:
                    self._teardown(polite=False)
                    self._end_remote_ranks()
                    raise
            self.startup_seconds = time.perf_counter() - t0
            _RUNNING.add(self)
            return self

    def _launch(self) -> None:
        plan = self.plan
        remove_stale_profile_dirs()
        self.profile_dir = tempfile.mkdtemp(prefix=PROFILE_PREFIX)  # mode 0700
        write_private(os.path.join(self.profile_dir, OWNER_FILE), owner_stamp(os.getpid()))
        security = os.path.join(self.profile_dir, "security")
        for sub in ("security", "log", "startup", "pid", "static"):  # owner-only, before
            os.mkdir(os.path.join(self.profile_dir, sub), 0o700)  # ipyparallel creates them
        self.cluster_id = uuid.uuid4().hex[:12]
        key = uuid.uuid4().hex
        write_private(os.path.join(security, "key"), key)
        plan.write_launch_files(self.profile_dir, self.cluster_id)
        address = plan.listen_address
        ports = free_ports(address, len(ENGINE_PORT_NAMES) + BROADCAST_LEAVES)
        engine_info = {
            "key": key,
            "signature_scheme": "hmac-sha256",
            "location": address,
            "interface": f"tcp://{address}",
            **dict(zip(ENGINE_PORT_NAMES, ports, strict=False)),
            "broadcast": ports[len(ENGINE_PORT_NAMES) :],
            "pack": "json",
            "unpack": "json",
            "ssh": "",
        }
        if not plan.local:
            engine_info["curve_serverkey"] = write_curve_config(self.profile_dir, key)
        controller_cmd, launcher_cmd = plan.commands(
            self.profile_dir, self.cluster_id, ports, address
        )
        env = plan.launch.environment(os.environ)
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
                env={**env, "PYTHONFAULTHANDLER": "1"},  # see _dump_silent_controller
                cwd=self.profile_dir,
                start_new_session=True,
                preexec_fn=owner_only_child,
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
                preexec_fn=die_with_parent,
            )

    def _launch_failure(self, what: str, missing: list[int] | None = None) -> ClusterStartError:
        stderr = _tail(self._err_path) if hasattr(self, "_err_path") else ""
        unreachable = ssh_failures(stderr, self.plan.hosts, self.plan.ssh_command)
        parts = [f"ssh cannot reach {', '.join(unreachable)}"] if unreachable else []
        parts.append(what)
        if missing:
            hosts = sorted({self.plan.host_of_rank(r) for r in missing})
            parts.append(
                f"rank(s) {rank_ranges(missing)} on host(s) {', '.join(hosts)} did not come up"
            )
        launcher = self._launcher
        if launcher is not None and launcher.poll() is not None and "launcher exited" not in what:
            parts.append(f"the MPI launcher exited with code {launcher.returncode}")
        stdout = _tail(self._out_path, 2000) if hasattr(self, "_out_path") else ""
        msg = "; ".join(parts)
        if stderr:
            msg += f"\n--- launcher stderr ---\n{stderr}"
        if stdout:
            msg += f"\n--- launcher stdout ---\n{stdout}"
        ctrl = self._controller
        ctrl_log = _tail(getattr(self, "_ctrl_log_path", ""), 16000)  # a whole stack dump
        if ctrl is not None and (ctrl.poll() is not None or ctrl_log):
            state = "running" if ctrl.poll() is None else f"exited {ctrl.returncode}"
            msg += f"\n--- controller ({state}) ---\n{ctrl_log}"
        return ClusterStartError(msg)

    def _check_processes(self) -> str | None:
        if self._controller is not None and self._controller.poll() is not None:
            return f"the ipyparallel controller exited (code {self._controller.returncode})"
        if self._launcher is not None and self._launcher.poll() is not None:
            return f"the MPI launcher exited (code {self._launcher.returncode})"
        if self.plan.slurm is not None:  # mpiexec would wait forever for proxies never started
            error = srun_launch_error(_tail(getattr(self, "_err_path", "")))
            if error:
                return f"Slurm could not start the ranks: {error}"
        return None

    def _dump_silent_controller(self) -> None:
        """A controller alive but not listening after the whole start-up time: SIGABRT makes
        its fault handler write every thread's stack to its log, for the error to show."""
        ctrl = self._controller
        if ctrl is not None and ctrl.poll() is None:
            ctrl.send_signal(signal.SIGABRT)
            wait_until(ctrl, time.monotonic() + 2.0)

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
                self._dump_silent_controller()
                raise self._launch_failure(
                    f"the controller did not start within {self.plan.timeout:g} s", list(range(n))
                )
            time.sleep(0.01)
        self.client = ipp.Client(connection_info, timeout=max(1.0, deadline - time.perf_counter()))
        self._record_losses()
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
        ar = self.view.apply_async(rank_info)
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
            RankInfo(
                i["rank"],
                i["host"],
                i["pid"],
                local=is_local_host(i["host"]),
                device=self._device_in_words(i["rank"], i["visible"]),
            )
            for i in infos
        ]
        if self.plan.transport != "mpi":
            ar = self.view.apply_async(start_native_engine)
            what = f"the {self.plan.transport} transport did not start"
            try:
                errors = [e for e in ar.get(timeout=max(0.1, deadline - time.perf_counter())) if e]
            except Exception as e:
                raise self._launch_failure(f"{what}: {e}") from None
            if errors:
                raise self._launch_failure(f"{what}: {errors[0]}")
        self._tracked = descendants([self._launcher, self._controller])
        self._exits = ExitOrder({r.pid: r.rank for r in self.ranks if r.local})

    def _record_losses(self) -> None:
        """Keep the order in which the hub loses engines: each rank's nanny tells it at once when
        its rank exits, on any host, so the first is the rank that died, not one that the
        launcher ended after it. (The client's own handler of the notice, wrapped.)"""
        self._lost = []
        ipyparallel_compat.on_engine_lost(self.client, self._lost.append)

    def _device_in_words(self, rank: int, visible: str | None) -> str:
        """A rank's device as it kept it, named from the plan's inventory when it is the GPU the
        rules gave it (inside Slurm: one of those Slurm granted, in Slurm's numbering)."""
        devices = self.plan.devices
        planned = devices.gpu_of(self.plan.host_of_rank(rank), rank % devices.per_node)
        if planned is not None and self.plan.slurm is not None:
            return f"{device_in_words(visible)} ({planned.name})"
        if planned is not None and visible in (str(planned.index), planned.uuid):
            return str(planned)
        return device_in_words(visible)

    def stop(self) -> None:
        """Shut down engines and controller, then signal, then kill; remove every file. After a
        death, ranks on other hosts that the launcher could not take down (a host cut off) are
        ended through Slurm (the cluster's job step is cancelled on every node) or ssh, as far
        as the hosts can be reached; then what they left there is removed."""
        with self._lock:
            _RUNNING.discard(self)
            self._teardown(polite=self.dead_reason is None)
            if self.dead_reason is not None:
                self._end_remote_ranks()

    def _end_remote_ranks(self) -> None:
        """After a death or a failed start, the launcher may not have taken down ranks (and
        Hydra proxies, with their files) on other hosts: a host cut off, a proxy still
        starting. End those of this cluster through Slurm or ssh, as far as hosts answer."""
        if not self.cluster_id:
            return
        slurm = self.plan.slurm
        if slurm is not None:
            slurm.cancel_steps(step_name(self.cluster_id))
            if slurm.state() != "RUNNING":  # the job is over: Slurm ended all it ran
                return
        if not self.plan.local:
            end_leftover_ranks_on_hosts(self.plan, only=[self.cluster_id], timeout=15)

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
        tracked = self._tracked + descendants(procs)
        # the processes have read all they need: remove the files first, so that a kernel
        # killed during a slow shutdown leaves nothing behind
        profile_dir, self.profile_dir = self.profile_dir, None
        if profile_dir:
            shutil.rmtree(profile_dir, ignore_errors=True)
        if asked and self._launcher is not None:  # the ranks exit, and with them mpiexec
            wait_until(self._launcher, time.monotonic() + 2.0)
        # The controller is stopped by SIGTERM, as ipyparallel's own launchers do; ranks that
        # had to be signalled count as forced: they may not have reached MPI_Finalize.
        forced = not polite
        for sig, grace in ((signal.SIGTERM, term_grace), (signal.SIGKILL, 5.0)):
            alive = [p for p in procs if p.poll() is None or group_alive(p.pid)]
            if not alive:
                break
            forced = forced or self._launcher in alive
            for p in alive:
                killpg(p.pid, sig)
            deadline = time.monotonic() + grace
            for p in alive:
                wait_until(p, deadline)
                while group_alive(p.pid) and time.monotonic() < deadline:
                    time.sleep(0.02)
        for p in procs:
            try:
                p.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
        terminate(tracked)  # e.g. engine nannies, which run in sessions of their own
        self._tracked = []
        if self._exits is not None:  # a death was reported before the teardown
            self._exits.close()
            self._exits = None
        if profile_dir:  # again: a controller slow to exit may have written into it meanwhile
            shutil.rmtree(profile_dir, ignore_errors=True)
        if forced and procs:  # ranks that never reached MPI_Finalize leave MPICH's segments
            from tnt_notebook.cluster.cleanup import remove_orphaned_mpi_files

            try:
                remove_orphaned_mpi_files()
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
            dead_local = [r.rank for r in self.ranks if r.local and not pid_alive(r.pid)]
            gone = sorted(set(missing) | set(dead_local))
            if gone:
                reason = f"rank(s) {rank_ranges(gone)} died" + _where(self.ranks, gone)
        ended = self._job_ended() if reason is not None else None
        if ended:  # not a rank's fault: Slurm ended them all
            reason = ended
        elif reason is not None:
            first = self._first_death(first_hint)
            if first is not None and not reason.startswith((f"rank {first} ", f"rank(s) {first} ")):
                reason = f"rank {first} died first; {reason}"
        if reason is not None:
            self.dead_reason = reason
            for r in self.ranks:
                r.alive = False
        return reason

    def _job_ended(self) -> str | None:
        """Why the ranks are gone when the Slurm job they ran in has ended (None otherwise)."""
        slurm = self.plan.slurm
        state = slurm.final_state() if slurm is not None else ""
        if slurm is None or state in ("", "RUNNING"):
            return None
        hows = {"CANCELLED": "was cancelled (scancel)", "COMPLETING": "is ending (COMPLETING)"}
        how = hows.get(state, f"ended ({state})")
        return (
            f"Slurm job {slurm.job_id} {how}: Slurm ended its ranks; "
            "a new cluster needs a new allocation"
        )

    def _first_death(self, hint: int | None = None, named: tuple[int, ...] = ()) -> int | None:
        """The rank that died first: seen exiting first where every rank is on this machine (of
        ranks seen ending together, the first the hub lost, else one the launcher's report
        names: `named`), else the first whose engine the hub lost (any host), else `hint`."""
        together = self._exits.first_together(timeout=0.1) if self._exits is not None else []
        if together and all(r.local for r in self.ranks):
            evidence = [r for r in (*self._lost, *named) if r in together]
            return (evidence or together)[0]
        if self._lost and 0 <= self._lost[0] < len(self.ranks):
            return self._lost[0]
        return hint if hint is not None else (together[0] if together else None)

    def _describe_death(self) -> str:
        """The launcher has exited: the rank that died first, its host and its cause as the
        launcher reports it (Hydra writes its report to stdout, srun to stderr)."""
        code = self._launcher.returncode if self._launcher is not None else None
        report = _tail(getattr(self, "_err_path", ""), 20000)
        report += "\n" + _tail(getattr(self, "_out_path", ""), 20000)
        deaths = srun_deaths(report) + hydra_deaths(report)
        ranks = (self._rank_at(d.host, d.pid, d.rank) for d in deaths)
        found = [r.rank for r in ranks if r is not None]
        first = self._first_death(named=tuple(found))
        if first is None:  # nothing seen: as the launcher names it (srun exactly, Hydra by pid)
            first = next(iter(found), None)
        if first is None:
            return f"the MPI launcher exited (code {code})"
        r = self.ranks[first]
        # (srun names each task; Hydra one process per host, not always the one that died)
        hows = [
            d.how()
            for d in deaths
            if d.rank == r.rank or (d.pid == r.pid and _same_host(d.host, r.host))
        ]
        cause = f": {hows[0]}" if hows else ""
        return (
            f"rank {r.rank} on {r.host} died{cause} (pid {r.pid}); "
            f"the launcher ended the other ranks (exit code {code})"
        )

    def _rank_at(self, host: str, pid: int | None, rank: int | None = None) -> RankInfo | None:
        """The rank with `pid` on `host` as Hydra names it (pids repeat across hosts), or the
        rank that srun names."""
        if rank is not None:
            return self.ranks[rank] if 0 <= rank < len(self.ranks) else None
        same = [r for r in self.ranks if r.pid == pid]
        if len(same) > 1:
            same = [r for r in same if _same_host(r.host, host)]
        return same[0] if len(same) == 1 else None

    def status(self) -> list[RankInfo]:
        """The ranks with an up-to-date alive flag."""
        self.check_alive()
        ids = set(self.client.ids) if self.client is not None else set()
        for r in self.ranks:
            r.alive = (
                self.dead_reason is None and r.rank in ids and (not r.local or pid_alive(r.pid))
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
            f"transport between nodes: {self.plan.transport}",
            *([f"from {self.plan.origin}"] if self.plan.slurm is not None else []),
            f"{'rank':>4}  {'host':<24} {'pid':>8}  alive  device",
        ]
        lines += [
            f"{r.rank:>4}  {r.host:<24} {r.pid:>8}  {'yes' if r.alive else 'NO ':<5}  {r.device}"
            for r in rows
        ]
        if self.dead_reason:
            lines.append("restart it with: %tnt_cluster restart")
        return "\n".join(lines)

    def stacks(self, targets: list[int] | None = None, wait: float = DEFAULT_WAIT) -> StackReport:
        """Where each rank is now (its main thread's innermost frames, the collective it waits
        in, the ranks that have not arrived there), asked while cells run; a rank that does not
        answer within `wait` seconds is named. ``.text()`` renders it, identical ranks once."""
        if not self.running:
            raise ClusterError("no tnt cluster is running (start one with %tnt_cluster -n N)")
        return gather(self.client, self._targets(targets), wait)

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

    def apply(
        self, func: Any, *args: Any, targets: list[int] | None = None, timeout: float = 60
    ) -> list[Any]:
        """``func(*args)`` on the ranks (all by default; ``func`` importable there): their
        results in rank order."""
        self._require_alive()
        view = self.client.direct_view(targets=self._targets(targets))
        return view.apply_async(func, *args).get(timeout=timeout)

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
                where = rank_ranges(failed)
                raise NameError(f"{name!r} is not defined on rank(s) {where}") from None
            raise
        return values if all_ranks else values[0]

    def _targets(self, targets: list[int] | None) -> list[int]:
        if targets is None:
            return list(range(self.size))
        bad = [t for t in targets if not 0 <= t < self.size]
        if bad:
            raise ValueError(f"no rank(s) {bad} in a world of {self.size}")
        return sorted(set(targets))


def _same_host(a: str, b: str) -> bool:
    """Whether two names of hosts (short or qualified) name the same host."""
    return a.split(".")[0] == b.split(".")[0]


def _where(ranks: list[RankInfo], which: list[int]) -> str:
    info = [f"rank {r.rank}: pid {r.pid} on {r.host}" for r in ranks if r.rank in which]
    return f" ({'; '.join(info)})" if info else ""

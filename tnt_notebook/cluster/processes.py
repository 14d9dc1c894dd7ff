"""Starting, watching and reaping the processes of a cluster.

Children die with the notebook kernel (``PR_SET_PDEATHSIG``) even if it is SIGKILLed; process
groups and psutil trees are signalled in stages (SIGTERM, then SIGKILL after a grace period);
:class:`ExitOrder` records which local rank exited first (pidfds).

Once one rank dies, mpiexec kills the others within milliseconds; afterwards neither the pids nor
MPICH's report (which may name rank 0 when rank 2 killed itself) tell which rank went first. A
thread waiting on a pidfd per rank (Linux 5.3+) records the order at the moment each one ends.
Elsewhere, or for ranks on other hosts, ``ExitOrder.first()`` stays None and callers fall back on
the hub.
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

_PR_SET_PDEATHSIG = 1


@dataclass
class HostResult:
    """What a command run on one host printed, or why it could not run there."""

    host: str
    returncode: int
    stdout: str
    stderr: str


def run_on_hosts(commands: dict[str, list[str]], timeout: float = 30) -> list[HostResult]:
    """Run each host's command (``{host: argv}``, e.g. through ssh or srun) at once; each run
    is bounded by `timeout`."""

    def one(host: str) -> HostResult:
        cmd = commands[host]
        try:
            r = subprocess.run(
                cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
            )
            return HostResult(host, r.returncode, r.stdout, r.stderr)
        except subprocess.TimeoutExpired:
            return HostResult(host, -1, "", f"no answer within {timeout:g} s")
        except OSError as e:
            return HostResult(host, -1, "", str(e))

    with ThreadPoolExecutor(max_workers=min(32, max(1, len(commands)))) as pool:
        return list(pool.map(one, commands))


def die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when its parent (the notebook kernel, a benchmark) dies,
    even by SIGKILL."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def owner_only_child() -> None:
    """preexec_fn of the controller: dies with us, and writes owner-only files."""
    os.umask(0o077)
    die_with_parent()


def pid_alive(pid: int) -> bool:
    try:
        import psutil

        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE
    except Exception:  # noqa: BLE001 - NoSuchProcess, AccessDenied
        return False


def wait_until(p: subprocess.Popen, deadline: float) -> None:
    try:
        p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        pass


def killpg(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    # zombies of our own children still count; Popen.wait reaps them
    return True


def descendants(procs: list[subprocess.Popen | None]) -> list[Any]:
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


def terminate(procs: list[Any]) -> None:
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


class ExitOrder:
    """Watches the given ``{pid: rank}``; ``first()`` is the rank that exited first, if any.

    The watcher wakes as a process ends; where it woke too late to tell two exits apart (a loaded
    machine, a launcher that ended the others within a millisecond), ``first_together()`` holds
    all the ranks it found ended at once."""

    def __init__(self, ranks_by_pid: dict[int, int]) -> None:
        self._batches: list[list[int]] = []  # ranks found ended at each wake, in order
        self._seen = threading.Event()  # set once a rank's exit is recorded
        self._fds: dict[int, int] = {}  # pidfd -> rank
        if hasattr(os, "pidfd_open"):
            for pid, rank in ranks_by_pid.items():
                try:
                    self._fds[os.pidfd_open(pid)] = rank
                except OSError:  # already reaped, or pidfds not supported by this kernel
                    pass
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._watch, name="tnt-exit-order", daemon=True)
        self._thread.start()

    def first_together(self, timeout: float = 0.0) -> list[int]:
        """The ranks found ended first (one, unless they ended too close together to tell),
        waiting up to ``timeout`` s for the watcher to record one (a caller that has just seen a
        rank dead may be ahead of the watcher thread)."""
        if timeout > 0:
            self._seen.wait(timeout)
        batches = self._batches  # appended by the watcher only; a list read is atomic
        return list(batches[0]) if batches else []

    def first(self, timeout: float = 0.0) -> int | None:
        """The first rank to exit (of those ended together, the lowest)."""
        together = self.first_together(timeout)
        return together[0] if together else None

    def _watch(self) -> None:
        poller = select.poll()
        for fd in (*self._fds, self._wake_r):
            poller.register(fd, select.POLLIN)
        pending = len(self._fds)
        while pending:
            ready = [fd for fd, _ in poller.poll()]
            if self._wake_r in ready:
                return
            batch = sorted(self._fds[fd] for fd in ready)
            for fd in ready:
                poller.unregister(fd)
            pending -= len(ready)
            self._batches.append(batch)
            self._seen.set()

    def close(self) -> None:
        """Stop watching and release the descriptors (idempotent)."""
        if self._wake_w < 0:
            return
        os.write(self._wake_w, b"x")
        self._thread.join(5.0)
        for fd in (*self._fds, self._wake_r, self._wake_w):
            os.close(fd)
        self._fds = {}
        self._wake_w = -1

"""The order in which a world's local ranks exit, seen as it happens.

Once one rank dies, mpiexec kills the others within milliseconds; afterwards neither the pids nor
MPICH's report (which may name rank 0 when rank 2 killed itself) tell which rank went first. A
thread waiting on a pidfd per rank (Linux 5.3+) records the order at the moment each one ends.
Elsewhere, or for ranks on other hosts, ``first()`` stays None and callers fall back on the hub.
"""

from __future__ import annotations

import os
import select
import threading


class ExitOrder:
    """Watches the given ``{pid: rank}``; ``first()`` is the rank that exited first, if any."""

    def __init__(self, ranks_by_pid: dict[int, int]) -> None:
        self._order: list[int] = []
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

    def first(self, timeout: float = 0.0) -> int | None:
        """The first rank to exit, waiting up to ``timeout`` s for the watcher to record one (a
        caller that has just seen a rank dead may be ahead of the watcher thread)."""
        if timeout > 0:
            self._seen.wait(timeout)
        order = self._order  # appended by the watcher only; a list read is atomic
        return order[0] if order else None

    def _watch(self) -> None:
        poller = select.poll()
        for fd in (*self._fds, self._wake_r):
            poller.register(fd, select.POLLIN)
        pending = len(self._fds)
        while pending:
            ready = [fd for fd, _ in poller.poll()]
            if self._wake_r in ready:
                return
            for fd in sorted(ready, key=self._fds.__getitem__):  # same instant: lower rank first
                self._order.append(self._fds[fd])
                self._seen.set()
                poller.unregister(fd)
                pending -= 1

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

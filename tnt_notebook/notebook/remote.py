"""Running a cell on ranks: live output, merged per-rank output, grouped errors, fail fast.

The client's IO thread only enqueues iopub messages and reply events; the calling (notebook)
thread drains the queue, so everything displayed goes through IPython from the cell's own
thread, in the order each rank produced it.

Output: the master rank's live, or every rank's merged (``notebook/rank_output.py``).

Errors: one traceback per distinct error, labelled with its ranks; the cell raises
:class:`RemoteCellError` (or :class:`~tnt_notebook.cluster.lifecycle.ClusterDeadError`) so the cell
fails. Fail fast: when a rank fails while others still run (likely waiting in a collective), the
others are interrupted (SIGINT through their nanny); ranks that do not stop within
``fail_fast_timeout`` get the world killed, and the error says so and how to restart.
"""

from __future__ import annotations

import queue
import re
import signal
import threading
import time
from typing import Any

from tnt_notebook.cluster.ipyparallel_compat import call_on_io_thread, message_futures
from tnt_notebook.cluster.lifecycle import Cluster, ClusterDeadError, ClusterError, rank_ranges
from tnt_notebook.notebook import progress_views
from tnt_notebook.notebook.rank_output import OutputRouter

DEFAULT_FAIL_FAST_TIMEOUT = 10.0
RESTART_HINT = "Restart it with: %tnt_cluster restart"
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
_CELL_RE = re.compile(r"(Cell In|Input In)\s*\[\d+\]")
_FAIL_FAST_GRACE = 0.5  # ranks failing together get this long to report before SIGINT
_OUTPUT_GRACE = 2.0  # after the last reply, how long outputs may still trail in
_RESET_TIMEOUT = 10.0  # how long the ranks may take to drop their native engines after a failure
_STACKS_GRACE = 1.0  # a cell interrupted after running this long shows where its ranks were


class RemoteCellError(Exception):
    """The cell raised on one or more ranks; renders one traceback per distinct error."""

    def __init__(self, groups: list[tuple[list[int], Any]], note: str = "") -> None:
        self.groups = groups  # [(ranks, RemoteError)]
        self.note = note
        first_ranks, first = groups[0]
        summary = f"{first.ename}: {first.evalue} (rank {rank_ranges(first_ranks)})"
        if len(groups) > 1:
            summary += f" and {len(groups) - 1} other error(s)"
        super().__init__(summary + (f"; {note}" if note else ""))

    @property
    def ranks(self) -> list[int]:
        return sorted(r for ranks, _ in self.groups for r in ranks)

    def _render_traceback_(self) -> list[str]:
        lines: list[str] = []
        for ranks, err in self.groups:
            label = "rank" if len(ranks) == 1 else "ranks"
            head = f"\x1b[1;31m[{label} {rank_ranges(ranks)}]\x1b[0m"
            lines.append(f"{head} {err.ename}: {err.evalue}")
            tb = err.traceback if isinstance(err.traceback, str) else "\n".join(err.traceback or [])
            lines.extend(tb.splitlines())
            lines.append("")
        if self.note:
            lines.append(self.note)
        return lines

    def __str__(self) -> str:
        return "\n".join(_ANSI_RE.sub("", line) for line in self._render_traceback_())


class CellTimeoutError(TimeoutError):
    """The cell ran past its --timeout; the ranks were interrupted."""

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[1;31mCellTimeoutError\x1b[0m: {self}"]


def _error_key(err: Any) -> tuple[str, str, str]:
    tb = err.traceback if isinstance(err.traceback, str) else "\n".join(err.traceback or [])
    return (err.ename, str(err.evalue), _CELL_RE.sub(r"\1[*]", _ANSI_RE.sub("", tb)))


def group_errors(errors: dict[int, Any]) -> list[tuple[list[int], Any]]:
    """Identical errors (same type, message and traceback) merged, ordered by first rank."""
    groups: dict[tuple[str, str, str], tuple[list[int], Any]] = {}
    for rank in sorted(errors):
        key = _error_key(errors[rank])
        groups.setdefault(key, ([], errors[rank]))[0].append(rank)
    return list(groups.values())


def run_cell(
    cluster: Cluster,
    code: str,
    *,
    targets: list[int] | None = None,
    all_ranks: bool | None = None,
    timeout: float | None = None,
    fail_fast_timeout: float = DEFAULT_FAIL_FAST_TIMEOUT,
) -> None:
    """Run `code` on the ranks, showing output live; raise if any rank failed or died."""
    from ipyparallel.error import RemoteError

    if not cluster.running and cluster.dead_reason is None:
        raise ClusterError("no tnt cluster is running (start one with %tnt_cluster -n N)")
    cluster._require_alive()
    tg = cluster._targets(targets)
    if all_ranks is None:
        all_ranks = cluster.plan.output_on_all_devices
    router = OutputRouter(tg, all_ranks)
    q: queue.SimpleQueue = queue.SimpleQueue()
    error_summary: str | None = "interrupted"
    try:
        ar = cluster.client.direct_view(targets=tg).execute(code, silent=False, block=False)
        children = message_futures(ar, tg)
        _hook_iopub(cluster.client, children, q)
        for rank, child in children.items():
            child.add_done_callback(lambda f, r=rank: q.put(("reply", r, None)))
            child.output.add_done_callback(lambda f, r=rank: q.put(("idle", r, None)))
        _drive(cluster, children, router, q, timeout, fail_fast_timeout, RemoteError)
        error_summary = None
    except BaseException as e:
        error_summary = str(e).splitlines()[0] if str(e) else type(e).__name__
        if cluster.running and cluster.dead_reason is None:
            _reset_native_engines(cluster)
        raise
    finally:
        router.finish()
        progress_views.end_of_cell(error_summary)


def _reset_native_engines(cluster: Cluster) -> None:
    """After a failed cell every rank drops its native engine (ipyparallel_hooks.after_failed_cell):
    fail fast interrupts ranks in a collective while the rank that failed kept its native engine,
    and the next collective must find every rank in the same state."""
    from tnt_notebook.rank.ipyparallel_hooks import after_failed_cell

    view = cluster.client.direct_view(targets=cluster._targets(None))
    try:
        view.apply_async(after_failed_cell).get(timeout=_RESET_TIMEOUT)
    except Exception:  # noqa: BLE001 - the cell's own error is raised; a rank that does not
        pass  # answer is found by the next cell's health check


def _hook_iopub(client: Any, children: dict[int, Any], q: queue.SimpleQueue) -> None:
    """Route every iopub message of the cell to `q`, none lost and none twice.

    A fast rank can publish before execute() returns here, so the hook runs inside the
    client's IO thread (where iopub messages are handled): what arrived so far is replayed
    from the futures' metadata, then the callbacks take over.
    """
    done = threading.Event()

    def hook() -> None:
        try:
            for rank, child in children.items():
                md = child.output.metadata
                early: list[tuple[str, dict]] = []
                if md.get("execute_input"):
                    early.append(("execute_input", {"code": md["execute_input"]}))
                early += [("stream", {"name": n, "text": md[n]}) for n in ("stdout", "stderr")]
                early += [("display_data", out) for out in md.get("outputs") or []]
                if md.get("execute_result"):
                    early.append(("execute_result", md["execute_result"]))
                for mtype, content in early:
                    if mtype != "stream" or content["text"]:
                        q.put(("iopub", rank, {"header": {"msg_type": mtype}, "content": content}))
                child.iopub_callbacks.append(lambda msg, r=rank: q.put(("iopub", r, msg)))
        finally:
            done.set()

    call_on_io_thread(client, hook)
    if not done.wait(30):
        raise ClusterError("the ipyparallel client's IO thread does not respond")


def _drive(
    cluster: Cluster,
    children: dict[int, Any],
    router: OutputRouter,
    q: queue.SimpleQueue,
    timeout: float | None,
    fail_fast_timeout: float,
    remote_error: type,
) -> None:
    start = time.monotonic()
    waiting_reply = set(children)
    waiting_output = set(children)
    errors: dict[int, Any] = {}
    interrupted_at: float | None = None  # when we sent SIGINT to the still-running ranks
    interrupt_reason = ""
    user_interrupt = False
    failed_at: tuple[float, str] | None = None
    died: list[int] = []  # ranks whose engine died, in the order the hub reported them
    last_reply = start
    next_health = start + 0.1  # run_cell just checked

    started: set[int] = set()  # ranks whose engine announced the cell (execute_input)
    signalled: set[int] = set()
    stacks = ""  # where the ranks were when a collective timed out or the cell was interrupted

    def take_stacks(when: str) -> None:
        nonlocal stacks
        if stacks or not waiting_reply:
            return
        try:
            report = cluster.stacks(sorted(children)).text()
            stacks = f"Where the ranks were when {when}:\n{report}"
        except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - the cell's error goes on
            stacks = f"(no stack report: {type(e).__name__}: {e})"

    def signal_started() -> None:
        # only ranks running the cell's code: see guard_cell_interrupts()
        started.update(r for r in waiting_reply if children[r].output.metadata.get("execute_input"))
        ranks = sorted((started & waiting_reply) - signalled)
        if ranks:
            signalled.update(ranks)
            try:
                cluster.client.send_signal(signal.SIGINT, targets=ranks, block=False)
            except Exception:  # noqa: BLE001 - a dead engine is caught by the health check
                pass

    def interrupt(reason: str) -> None:
        nonlocal interrupted_at, interrupt_reason
        if interrupted_at is None and waiting_reply:
            if not reason.startswith("rank") and time.monotonic() - start >= _STACKS_GRACE:
                take_stacks(reason)  # (before SIGINT moves them)
            interrupted_at = time.monotonic()
            interrupt_reason = reason
            signal_started()

    while waiting_reply or waiting_output:
        try:
            try:
                kind, rank, msg = q.get(timeout=0.05)
            except queue.Empty:
                kind = ""
            if kind == "iopub":
                if msg["header"]["msg_type"] == "execute_input":
                    started.add(rank)
                    if interrupted_at is not None:
                        signal_started()
                router.handle(rank, msg)
            elif kind == "reply":
                waiting_reply.discard(rank)
                last_reply = time.monotonic()
                res = children[rank].result() if children[rank].exception() is None else None
                if isinstance(res, remote_error) and res.ename == "EngineError":
                    died.append(rank)  # the hub saw this rank's engine go away
                    next_health = 0.0
                elif isinstance(res, remote_error) or children[rank].exception() is not None:
                    errors[rank] = res if res is not None else children[rank].exception()
                    if not user_interrupt and res is not None and res.ename != "KeyboardInterrupt":
                        failed_at = failed_at or (time.monotonic(), f"rank {rank} failed")
                    if res is not None and "timed out after" in str(res.evalue):
                        take_stacks(f"rank {rank}'s collective timed out")
            elif kind == "idle":
                waiting_output.discard(rank)
                router.rank_done(rank)
            now = time.monotonic()
            if failed_at and now - failed_at[0] > _FAIL_FAST_GRACE:
                interrupt(failed_at[1])  # the others are likely blocked in a collective
            if not waiting_reply and waiting_output and now - last_reply > _OUTPUT_GRACE:
                break  # replies are in; a lost 'idle' must not hold the cell
            if now >= next_health or (not waiting_reply and died):
                next_health = now + 0.1
                reason = _death_reason(cluster, died)
                if reason:
                    _kill(cluster, reason)
                    raise ClusterDeadError(
                        f"{reason}; the cluster is dead. {RESTART_HINT}" + _error_tail(errors)
                    )
            if timeout is not None and now - start > timeout and interrupted_at is None:
                interrupt(f"the cell exceeded its --timeout of {timeout:g} s")
            if interrupted_at is not None and waiting_reply:
                signal_started()  # ranks that announced the cell since the interrupt
                if now - interrupted_at > fail_fast_timeout:
                    stuck = sorted(waiting_reply)
                    reason = (
                        f"rank(s) {rank_ranges(stuck)} did not stop within {fail_fast_timeout:g} s "
                        f"of being interrupted ({interrupt_reason}); the cluster was stopped"
                    )
                    take_stacks("they did not stop")
                    _kill(cluster, reason)
                    if errors and not user_interrupt:
                        raise _cell_error(errors, f"{reason}. {RESTART_HINT}", stacks)
                    raise ClusterDeadError(f"{reason}. {RESTART_HINT}\n{stacks}".strip())
        except KeyboardInterrupt:
            if user_interrupt:  # second interrupt: stop waiting, escalate now
                stuck = sorted(waiting_reply)
                if stuck:
                    reason = (
                        f"rank(s) {rank_ranges(stuck)} did not stop after interrupt; "
                        "the cluster was stopped"
                    )
                    _kill(cluster, reason)
                    raise ClusterDeadError(f"{reason}. {RESTART_HINT}") from None
                raise
            user_interrupt = True
            interrupt("interrupted by the user")
            if interrupted_at is not None:
                # the user should not wait as long as for a failing collective
                fail_fast_timeout = min(fail_fast_timeout, 5.0)

    if died:  # the loop ended on a lost 'idle' before the health check ran
        reason = _death_reason(cluster, died)
        _kill(cluster, reason)
        raise ClusterDeadError(f"{reason}; the cluster is dead. {RESTART_HINT}")
    tail = f"\n{stacks}" if stacks else ""
    if user_interrupt:
        raise KeyboardInterrupt(f"interrupted ranks {rank_ranges(sorted(children))}{tail}")
    primary = [r for r, e in errors.items() if getattr(e, "ename", "") != "KeyboardInterrupt"]
    if primary:
        note = ""
        if interrupted_at is not None and interrupt_reason.startswith("rank"):
            note = f"(the other ranks were interrupted because {interrupt_reason})"
        raise _cell_error(errors, note, stacks)
    if interrupted_at is not None:
        raise CellTimeoutError(f"{interrupt_reason}; the ranks were interrupted{tail}")
    if errors:
        raise _cell_error(errors, "", stacks)


# What ranks raise because another rank failed (fail fast interrupted them, or a failing rank
# aborted the collectives they waited in), and how the cell's error says so
_CONSEQUENCES = {
    "KeyboardInterrupt": "were interrupted",
    "CollectiveAbortedError": "had their collectives aborted",
}


def _cell_error(errors: dict[int, Any], note: str, stacks: str = "") -> RemoteCellError:
    """Primary errors first; ranks merely interrupted by fail-fast become a one-line note; the
    stack report, if one was taken, last."""
    primary = {r: e for r, e in errors.items() if getattr(e, "ename", "") not in _CONSEQUENCES}
    if primary and len(primary) < len(errors):
        consequences = []
        for ename, what in _CONSEQUENCES.items():
            ranks_ = sorted(r for r, e in errors.items() if getattr(e, "ename", "") == ename)
            if ranks_:
                consequences.append(f"rank(s) {rank_ranges(ranks_)} {what}")
        note = (note + " " if note else "") + "; ".join(consequences) + "."
    note = "\n".join(part for part in (note.strip(), stacks) if part)
    return RemoteCellError(group_errors(primary or errors), note)


def _error_tail(errors: dict[int, Any]) -> str:
    if not errors:
        return ""
    return "\n" + str(_cell_error(errors, ""))


def _death_reason(cluster: Cluster, died: list[int]) -> str | None:
    """Why the world is dead (None while it is not). The cluster names the rank it saw exit first;
    the order in which the hub lost the engines is its fallback (ranks on other hosts). Both the
    health check and the end of a cell use it."""
    reason = cluster.check_alive(first_hint=died[0] if died else None)
    if died and not reason:
        reason = f"rank(s) {rank_ranges(died)} died (engine stopped)"
    return reason


def _kill(cluster: Cluster, reason: str) -> None:
    """Take the whole world down (nothing left running), remembering why it is dead."""
    cluster.kill(reason)

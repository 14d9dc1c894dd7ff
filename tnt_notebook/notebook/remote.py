"""Running a cell on ranks: live output, merged per-rank output, grouped errors, fail fast.

The client's IO thread only enqueues iopub messages and reply events; the calling (notebook)
thread drains the queue, so everything displayed goes through IPython from the cell's own
thread, in the order each rank produced it.

Output design:

* default: the master rank's (lowest target's) stdout, stderr and rich output are shown live,
  exactly as produced; other ranks' output is not shown.
* ``all_ranks``: every rank's output is merged line by line. Line k of a stream is shown once
  every still-running rank has produced its line k (or finished), so output stays live while the
  ranks advance together; identical lines are printed once under a label of the ranks that
  produced them (``[stdout:0-3]``), a new label only when the set of ranks changes. Rich outputs
  are merged the same way (k-th display of every rank, identical data shown once).
* display messages always go to ``progress_views.handle_display``
  first (master rank only); it consumes the progress widget's messages.

Errors: one traceback per distinct error, labelled with its ranks; the cell raises
:class:`RemoteCellError` (or :class:`~tnt_notebook.cluster.lifecycle.ClusterDeadError`) so the cell
fails. Fail fast: when a rank fails while others still run (likely waiting in a collective), the
others are interrupted (SIGINT through their nanny); ranks that do not stop within
``fail_fast_timeout`` get the world killed, and the error says so and how to restart.
"""

from __future__ import annotations

import json
import queue
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tnt_notebook.cluster.lifecycle import Cluster, ClusterDeadError, ClusterError, rank_ranges
from tnt_notebook.notebook import progress_views

DEFAULT_FAIL_FAST_TIMEOUT = 10.0
RESTART_HINT = "Restart it with: %tnt_cluster restart"
_ANSI_RE = re.compile(r"\x1b\[[0-9;]*m")
_CELL_RE = re.compile(r"(Cell In|Input In)\s*\[\d+\]")
_FAIL_FAST_GRACE = 0.5  # ranks failing together get this long to report before SIGINT
_OUTPUT_GRACE = 2.0  # after the last reply, how long outputs may still trail in
_RESET_TIMEOUT = 10.0  # how long the ranks may take to drop their engines after a failed cell


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


def _label(stream: str, ranks: list[int]) -> str:
    return f"[{stream}:{rank_ranges(ranks)}]"


def _publish(data: dict, metadata: dict, display_id: str | None, update: bool) -> None:
    """Show rich output in the notebook (or its text form without IPython)."""
    from IPython import get_ipython

    if get_ipython() is None:
        text = data.get("text/plain")
        if text is not None:
            print(text)
        return
    from IPython.display import publish_display_data

    kwargs: dict[str, Any] = {"metadata": metadata or {}}
    if display_id:
        kwargs["transient"] = {"display_id": display_id}
        kwargs["update"] = update
    publish_display_data(data, **kwargs)


@dataclass
class _RankStreams:
    lines: dict[str, list[str]] = field(default_factory=lambda: {"stdout": [], "stderr": []})
    partial: dict[str, str] = field(default_factory=lambda: {"stdout": "", "stderr": ""})
    displays: list[tuple[dict, dict]] = field(default_factory=list)
    done: bool = False


class OutputRouter:
    """Turns ranks' iopub messages into notebook output (see module docstring)."""

    def __init__(self, targets: list[int], all_ranks: bool) -> None:
        self.targets = targets
        self.master = targets[0]
        self.all_ranks = all_ranks and len(targets) > 1
        self.ranks = {r: _RankStreams() for r in targets}
        self.cursor = {"stdout": 0, "stderr": 0, "display": 0}
        self.last_label = {"stdout": "", "stderr": "", "display": ""}
        self.result_shown = False

    # -- message entry point (notebook thread)
    def handle(self, rank: int, msg: dict) -> None:
        mtype = msg["header"]["msg_type"]
        content = msg.get("content", {})
        if mtype == "stream":
            self._stream(rank, content.get("name", "stdout"), content.get("text", ""))
        elif mtype in ("display_data", "update_display_data", "execute_result"):
            self._display(rank, mtype, content)
        elif mtype == "clear_output" and rank == self.master and not self.all_ranks:
            from IPython.display import clear_output

            clear_output(wait=content.get("wait", False))

    def _stream(self, rank: int, name: str, text: str) -> None:
        name = "stderr" if name == "stderr" else "stdout"
        if not self.all_ranks:
            if rank == self.master:
                f = sys.stderr if name == "stderr" else sys.stdout
                f.write(text)
                f.flush()
            return
        st = self.ranks[rank]
        buf = st.partial[name] + text
        *complete, st.partial[name] = buf.split("\n")
        st.lines[name].extend(complete)
        self._emit_lines(name)

    def _display(self, rank: int, mtype: str, content: dict) -> None:
        data = content.get("data", {})
        metadata = content.get("metadata", {})
        display_id = (content.get("transient") or {}).get("display_id")
        update = mtype == "update_display_data"
        if rank == self.master and progress_views.handle_display(
            data, metadata, display_id, update
        ):
            return
        if not self.all_ranks or update or display_id:
            # updatable displays belong to the master rank's view of the cell
            if rank == self.master:
                _publish(data, metadata, display_id, update)
            return
        self.ranks[rank].displays.append((data, metadata))
        self._emit_displays()

    # -- merging (all-ranks mode)
    def _ready(self, k: int, get: Callable[[_RankStreams], list]) -> bool:
        return all(len(get(st)) > k or st.done for st in self.ranks.values())

    def _emit_lines(self, name: str, final: bool = False) -> None:
        out = sys.stderr if name == "stderr" else sys.stdout
        while True:
            k = self.cursor[name]
            have = [r for r, st in self.ranks.items() if len(st.lines[name]) > k]
            if not have or not (final or self._ready(k, lambda st: st.lines[name])):
                break
            groups: dict[str, list[int]] = {}
            for r in have:
                groups.setdefault(self.ranks[r].lines[name][k], []).append(r)
            for text, ranks in groups.items():
                label = _label(name, ranks)
                if label != self.last_label[name]:
                    out.write(label + "\n")
                    self.last_label[name] = label
                out.write(text + "\n")
            out.flush()
            self.cursor[name] = k + 1

    def _emit_displays(self, final: bool = False) -> None:
        while True:
            k = self.cursor["display"]
            have = [r for r, st in self.ranks.items() if len(st.displays) > k]
            if not have or not (final or self._ready(k, lambda st: st.displays)):
                break
            groups: dict[str, list[int]] = {}
            items: dict[str, tuple[dict, dict]] = {}
            for r in have:
                item = self.ranks[r].displays[k]
                key = json.dumps(item[0], sort_keys=True, default=str)
                groups.setdefault(key, []).append(r)
                items.setdefault(key, item)
            for key, ranks in groups.items():
                sys.stdout.write(_label("output", ranks) + "\n")
                sys.stdout.flush()
                self.last_label["stdout"] = ""
                data, metadata = items[key]
                _publish(data, metadata, None, False)
            self.cursor["display"] = k + 1

    def rank_done(self, rank: int) -> None:
        """The rank's output is complete: flush its partial lines, release merged output."""
        if not self.all_ranks:
            return
        st = self.ranks[rank]
        st.done = True
        for name in ("stdout", "stderr"):
            if st.partial[name]:
                st.lines[name].append(st.partial[name])
                st.partial[name] = ""
            self._emit_lines(name)
        self._emit_displays()

    def finish(self) -> None:
        """Flush everything still buffered (ranks that never finished included)."""
        if not self.all_ranks:
            return
        for st in self.ranks.values():
            st.done = True
            for name in ("stdout", "stderr"):
                if st.partial[name]:
                    st.lines[name].append(st.partial[name])
                    st.partial[name] = ""
        for name in ("stdout", "stderr"):
            self._emit_lines(name, final=True)
        self._emit_displays(final=True)


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
        # ipyparallel's AsyncResult keeps one MessageFuture per target, in target order (it
        # is what its own stream_output() iterates).
        children = dict(zip(tg, ar._children, strict=True))
        _hook_iopub(cluster.client, children, q)
        for rank, child in children.items():
            child.add_done_callback(lambda f, r=rank: q.put(("reply", r, None)))
            child.output.add_done_callback(lambda f, r=rank: q.put(("idle", r, None)))
        _drive(cluster, children, router, q, timeout, fail_fast_timeout, RemoteError)
        error_summary = None
    except BaseException as e:
        error_summary = str(e).splitlines()[0] if str(e) else type(e).__name__
        if cluster.running and cluster.dead_reason is None:
            _reset_engines(cluster)
        raise
    finally:
        router.finish()
        progress_views.end_of_cell(error_summary)


def _reset_engines(cluster: Cluster) -> None:
    """After a failed cell every rank drops its native engine (ipyparallel_hooks.after_failed_cell):
    fail fast interrupts ranks in a collective while the rank that failed kept its engine, and the
    next collective must find every rank in the same state."""
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

    client._io_loop.add_callback(hook)
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
                    _kill(cluster, reason)
                    if errors and not user_interrupt:
                        raise _cell_error(errors, f"{reason}. {RESTART_HINT}")
                    raise ClusterDeadError(f"{reason}. {RESTART_HINT}")
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
    if user_interrupt:
        raise KeyboardInterrupt(f"interrupted ranks {rank_ranges(sorted(children))}")
    primary = [r for r, e in errors.items() if getattr(e, "ename", "") != "KeyboardInterrupt"]
    if primary:
        note = ""
        if interrupted_at is not None and interrupt_reason.startswith("rank"):
            note = f"(the other ranks were interrupted because {interrupt_reason})"
        raise _cell_error(errors, note)
    if interrupted_at is not None:
        raise CellTimeoutError(f"{interrupt_reason}; the ranks were interrupted")
    if errors:
        raise _cell_error(errors, "")


# What ranks raise because another rank failed (fail fast interrupted them, or a failing rank
# aborted the collectives they waited in), and how the cell's error says so
_CONSEQUENCES = {
    "KeyboardInterrupt": "were interrupted",
    "CollectiveAbortedError": "had their collectives aborted",
}


def _cell_error(errors: dict[int, Any], note: str) -> RemoteCellError:
    """Primary errors first; ranks merely interrupted by fail-fast become a one-line note."""
    primary = {r: e for r, e in errors.items() if getattr(e, "ename", "") not in _CONSEQUENCES}
    if primary and len(primary) < len(errors):
        consequences = []
        for ename, what in _CONSEQUENCES.items():
            ranks_ = sorted(r for r, e in errors.items() if getattr(e, "ename", "") == ename)
            if ranks_:
                consequences.append(f"rank(s) {rank_ranges(ranks_)} {what}")
        note = (note + " " if note else "") + "; ".join(consequences) + "."
    return RemoteCellError(group_errors(primary or errors), note.strip())


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

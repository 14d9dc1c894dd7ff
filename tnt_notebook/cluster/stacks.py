"""Who is stuck where: every rank's main-thread stack and the collective it waits in, asked of the
ranks while they run, with the ranks that have not arrived named, and identical ranks grouped.

Each rank answers a control message (tnt_notebook/rank/stack_report.py) on its engine's control
thread, so a rank blocked in a collective (which releases the GIL) answers at once; the ranks
that do not answer within the wait are named as silent. Which ranks have arrived at a collective
follows from the numbers of the collectives each rank's engine entered: the n-th collective is
the same call on every rank.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tnt_notebook.cluster import ipyparallel_compat
from tnt_notebook.cluster.rank_ranges import rank_ranges
from tnt_notebook.rank.stack_report import REQUEST

DEFAULT_WAIT = 1.5  # seconds the ranks get to answer


@dataclass
class StackReport:
    """What each rank said (``ranks``: rank -> its report), and the ranks that did not answer
    within the wait (``silent``: rank -> why)."""

    ranks: dict[int, dict[str, Any]] = field(default_factory=dict)
    silent: dict[int, str] = field(default_factory=dict)

    def missing_at(self, rank: int) -> list[int]:
        """The ranks that have not arrived at the collective that `rank` waits in, or last failed
        in (the silent ones aside: unknown)."""
        here = _focus(self.ranks[rank])
        if here is None:
            return []
        return [r for r, said in sorted(self.ranks.items()) if not _arrived(said, here["seq"])]

    def text(self) -> str:
        """One block per group of ranks in the same place: where, what they wait in, who is
        missing, then their innermost frames (outermost first)."""
        groups: dict[tuple, list[int]] = {}
        for rank in sorted(self.ranks):
            groups.setdefault(self._key(rank), []).append(rank)
        lines = []
        for key, ranks in groups.items():
            label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"
            lines.append(f"{label}: {self._headline(ranks)}")
            lines += [f"    {frame}" for frame in key[-1]]
        lines += [f"rank {rank}: {why}" for rank, why in sorted(self.silent.items())]
        return "\n".join(lines)

    def _key(self, rank: int) -> tuple:
        """What ranks grouped together share: everything but the seconds waited (and, for those
        leaving a cell after a failed collective, the frames of their error's formatting)."""
        said = self.ranks[rank]
        if _gave_up(said):
            return ("failed", said["failed"]["seq"], tuple(self.missing_at(rank)), ())
        calls = tuple(
            None if c is None else (c["seq"], c["kind"], c["bytes"], c["dtype"], c["op"])
            for c in (said.get("collective"), said.get("failed"))
        )
        frames = tuple(_frame_line(f) for f in said["frames"] if said["in_cell"])
        awaited = self._awaited_elsewhere(rank)
        awaited_text = describe(awaited) if awaited is not None else ""
        return (said["in_cell"], calls, tuple(self.missing_at(rank)), awaited_text, frames)

    def _awaited_elsewhere(self, rank: int) -> dict[str, Any] | None:
        """The collective that other ranks wait in (or failed in) and `rank` has not reached."""
        for other in sorted(self.ranks):
            c = _focus(self.ranks[other])
            if other != rank and c is not None and rank in self.missing_at(other):
                return {k: c[k] for k in ("seq", "kind", "bytes", "dtype", "op", "bucket")}
        return None

    def _headline(self, ranks: list[int]) -> str:
        said = self.ranks[ranks[0]]
        current, failed = said.get("collective"), said.get("failed")
        site = _call_site(said["frames"])
        missing = self.missing_at(ranks[0])
        who = f"rank(s) {rank_ranges(missing)} have not arrived" if missing else ""
        if current is not None:
            seconds = max(self.ranks[r]["collective"]["seconds"] for r in ranks)
            where = f"waiting {seconds:.1f} s in {describe(current)} at {site}"
            return f"{where}; {who or 'every rank has arrived'}"
        if _gave_up(said):
            return f"left {describe(failed)} when it failed; {who}"
        now = f"at {site}" if said["in_cell"] else "idle (its cell has ended)"
        awaited = self._awaited_elsewhere(ranks[0])
        if awaited is not None:
            return f"{now}, has not arrived at {describe(awaited)}"
        return f"{now}, in no collective" if said["in_cell"] else now


def _gave_up(said: dict[str, Any]) -> bool:
    """Whether a rank's report centres on a collective it failed in (a time-out), not one it is
    in: it is leaving its cell with that error."""
    failed = said.get("failed")
    if said.get("collective") is not None or failed is None:
        return False
    return failed["seq"] == said["entered"]


def _focus(said: dict[str, Any]) -> dict[str, Any] | None:
    """The collective a rank's report centres on: the one it is in, else the last that failed."""
    return said.get("collective") or said.get("failed")


def _arrived(said: dict[str, Any], seq: int) -> bool:
    """Whether a rank reached collective number `seq` (0: the engine's start-up, which every rank
    with an engine has reached)."""
    entered = said.get("entered")
    return entered is not None and entered >= seq


def describe(c: dict[str, Any]) -> str:
    """'allreduce #17 (4.2 MB float32 sum, bucket 2)', 'barrier #3', 'the engine's start-up'."""
    if c["seq"] == 0:
        return "the engine's start-up (the first collective)"
    head = f"{c['kind']} #{c['seq']}"
    if c["kind"] == "allreduce":
        bucket = f", bucket {c['bucket']}" if c["bucket"] >= 0 else ""
        return f"{head} ({_size(c['bytes'])} {c['dtype']} {c['op']}{bucket})"
    if c["kind"] == "broadcast":
        return f"{head} (from rank {c['bucket']})"
    return head


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def _frame_line(f: dict[str, Any]) -> str:
    if "gap" in f:
        return f"... ({f['gap']} frame(s) left out)"
    return f"{f['file']}:{f['line']} in {f['function']}" + (f": {f['code']}" if f["code"] else "")


def _call_site(frames: list[dict[str, Any]]) -> str:
    """Where user code called in: the innermost frame of the cell, else the innermost outside
    this package, else the innermost."""
    real = [f for f in frames if "gap" not in f]
    cells = [f for f in real if f["file"] == "<cell>"]
    outside = [f for f in real if not f["file"].startswith("tnt_notebook/")]
    f = (cells or outside or real or [{"file": "?", "line": 0}])[-1]
    return f"{f['file']}:{f['line']}"


def gather(client: Any, targets: list[int], wait: float = DEFAULT_WAIT) -> StackReport:
    """Ask `targets` where they are; at most `wait` seconds."""
    report = StackReport()
    registered = set(client.ids)
    futures = {}
    for rank in targets:
        if rank in registered:
            futures[rank] = ipyparallel_compat.send_control_request(client, [rank], REQUEST, {})
        else:
            report.silent[rank] = "gone (its engine is no longer registered)"
    deadline = time.monotonic() + wait
    for rank, future in futures.items():
        try:
            msg = future.result(timeout=max(0.0, deadline - time.monotonic()))[0]
        except Exception:  # noqa: BLE001 - a rank that does not answer in time is named
            report.silent[rank] = (
                f"did not answer within {wait:g} s (it holds the GIL in native code, or is stopped)"
            )
            continue
        content = msg["content"]
        if content.get("status") == "ok":
            report.ranks[rank] = content["report"]
        else:
            report.silent[rank] = f"could not say: {content.get('evalue', content)}"
    return report

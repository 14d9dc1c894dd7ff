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
        """The ranks that have not arrived at the collective that `rank` waits in (the silent
        ones aside: unknown)."""
        here = self.ranks[rank].get("collective")
        if here is None:
            return []
        return [r for r, said in sorted(self.ranks.items()) if not _arrived(said, here["seq"])]

    def text(self) -> str:
        """One block per group of ranks in the same place: where, what they wait in, who is
        missing, then their innermost frames."""
        groups: dict[tuple, list[int]] = {}
        for rank in sorted(self.ranks):
            groups.setdefault(self._key(rank), []).append(rank)
        blocks = []
        for key, ranks in groups.items():
            label = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {rank_ranges(ranks)}"
            blocks.append(f"{label}: {self._headline(ranks)}")
            blocks += [f"    {line}" for line in key[-1]]
        for rank in sorted(self.silent):
            blocks.append(f"rank {rank}: {self.silent[rank]}")
        return "\n".join(blocks)

    def _key(self, rank: int) -> tuple:
        r = self.ranks[rank]
        c = r.get("collective")
        call = None if c is None else (c["seq"], c["kind"], c["bytes"], c["dtype"], c["op"])
        frames = tuple(
            f"{f['file']}:{f['line']} in {f['function']}" + (f": {f['code']}" if f["code"] else "")
            for f in r["frames"]
        )
        awaited = self._awaited_by_others(rank)
        return (r["in_cell"], call, tuple(self.missing_at(rank)), awaited, frames)

    def _awaited_by_others(self, rank: int) -> tuple[int, str] | None:
        """The collective that other ranks wait in and `rank` has not arrived at, if any."""
        for other in sorted(self.ranks):
            c = self.ranks[other].get("collective")
            if other != rank and c is not None and rank in self.missing_at(other):
                return (c["seq"], c["kind"])
        return None

    def _headline(self, ranks: list[int]) -> str:
        r = self.ranks[ranks[0]]
        c = r.get("collective")
        site = _call_site(r["frames"])
        if c is not None:
            seconds = max(self.ranks[x]["collective"]["seconds"] for x in ranks)
            missing = self.missing_at(ranks[0])
            who = (
                f"rank(s) {rank_ranges(missing)} have not arrived"
                if missing
                else "every rank has arrived"
            )
            return f"waiting {seconds:.1f} s in {describe(c)} at {site}; {who}"
        awaited = self._awaited_by_others(ranks[0])
        if awaited is not None:
            seq, kind = awaited
            what = "the engine's start-up" if seq == 0 else f"{kind} #{seq}"
            return f"at {site}, has not arrived at {what}"
        if not r["in_cell"]:
            return "idle (no cell running)"
        return f"at {site}, in no collective"


def _arrived(said: dict[str, Any], seq: int) -> bool:
    """Whether a rank reached collective number `seq` (0: the engine's start-up, which every rank
    with an engine has reached)."""
    entered = said.get("entered")
    return entered is not None and entered >= seq


def describe(c: dict[str, Any]) -> str:
    """'allreduce #17 (4.2 MB float32 sum, bucket 2)', 'barrier #3', 'the engine's start-up'."""
    if c["seq"] == 0:
        return "the engine's start-up (its first collective)"
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


def _call_site(frames: list[dict[str, Any]]) -> str:
    """The innermost frame outside this package (where user code called in), else the innermost."""
    outside = [f for f in frames if not f["file"].startswith("tnt_notebook/")]
    f = (outside or frames or [{"file": "?", "line": 0}])[-1]
    return f"{f['file']}:{f['line']}"


def gather(client: Any, targets: list[int], wait: float = DEFAULT_WAIT) -> StackReport:
    """Ask `targets` where they are; at most `wait` seconds."""
    send = getattr(client, "_send_control_request", None)
    if send is None:  # (ipyparallel's own control messages go this way: signals, abort)
        raise RuntimeError("this ipyparallel client cannot send control messages to the ranks")
    report = StackReport()
    registered = set(client.ids)
    futures = {}
    for rank in targets:
        if rank in registered:
            futures[rank] = send([rank], REQUEST, {}, block=False)
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

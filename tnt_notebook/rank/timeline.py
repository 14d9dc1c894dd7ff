"""The timeline: what each rank did during a few sampled train steps, gathered on the master rank.

``tnt.timeline(True, steps=20)`` on every rank (``%tnt_timeline on`` does it from the notebook;
``TNT_TIMELINE=DIR``, ``tnt-run --timeline DIR``, from the start) makes each later ``fit`` record
``steps`` train steps after its first two (which trace): the native engine records each
collective's begin and end (``_native.timeline_take``), the step's marks record when its batch
exists and when the optimizer's update is done, and Keras's callbacks when the step was called
and returned (:mod:`tnt_notebook.keras.timeline_recorder`). Outside the sampled steps nothing is
recorded. After the fit, the ranks' records are gathered once (two allreduces) and the master
rank turns them into a sample (:mod:`tnt_notebook.timeline_report`), which
``tnt.timeline_summary()`` summarises, and which ``TNT_TIMELINE``'s directory receives as files.
"""

from __future__ import annotations

import functools
import json
import os
import socket
import statistics
import time

import numpy as np

from tnt_notebook import settings, timeline_report
from tnt_notebook.rank import api as ranks

#: The train step's marks (``TntTimelineMark``'s labels).
BATCH_READY, UPDATED = 0, 1
#: The first steps of each fit trace their functions: the sample starts after them.
SKIPPED_STEPS = 2

#: A record of a step's call and return (beside the native engine's kinds, ``_codes()``).
_STEP = 10
#: How each allreduce path reads in a trace.
_PATH_WORDS = {
    "engine": "engine",
    "mpi_allreduce": "MPI_Allreduce",
    "posted": "posted MPI messages",
}
_HOST_BYTES = 64

_on: bool | None = None  # None: as TNT_TIMELINE says
_steps: int | None = None
_sample: dict | None = None


@functools.cache
def _codes() -> tuple[dict[str, int], dict[int, str]]:
    """The native engine's record kinds by name, and its path codes' words."""
    native = ranks.native_core()
    paths = {code: _PATH_WORDS[name] for name, code in native.timeline_paths.items()}
    return dict(native.timeline_kinds), paths


def timeline(on: bool = True, steps: int | None = None) -> None:
    """Record the timeline of ``steps`` train steps (default ``TNT_TIMELINE_STEPS``, 20) of each
    later fit, after its first two; ``on=False`` stops. Call it on every rank alike."""
    global _on, _steps
    if steps is not None:
        settings.TIMELINE_STEPS.check(steps, "steps")
    _on, _steps = bool(on), steps


def recording_steps() -> int:
    """How many steps the next fit samples; 0 while the timeline is off."""
    on = _on if _on is not None else bool(settings.TIMELINE.read())
    return (_steps or settings.TIMELINE_STEPS.read()) if on else 0


def timeline_sample() -> dict | None:
    """The last fit's sample on the master rank (spans per rank and step), None before one."""
    return _sample


def timeline_summary() -> dict | None:
    """On the master rank, the last sample's breakdown as plain data: ``"straggler"`` (the rank
    the others wait for, or None), ``"straggler_lag_s"``, ``"step_s"`` and ``"ranks"``: per rank
    ``"rank"``, ``"compute_s"``, ``"communication_s"``, ``"exposed_communication_s"``,
    ``"wait_s"`` (and input, update, step) in seconds per sampled step, with ``"steps"``, each
    sampled step's own. None before a sampled fit."""
    return None if _sample is None else timeline_report.summary(_sample)


class Recorder:
    """One fit's sampled steps on this rank (driven by the fit's callback)."""

    def __init__(self, steps: int):
        self.steps, self.seen = steps, 0
        self.rows: list[np.ndarray] = []
        self.begin_ns = 0
        ranks.native_core().timeline_recording(False)
        ranks.native_core().timeline_take()  # (what a failed fit left)

    def sampled(self) -> int:
        return self.seen - SKIPPED_STEPS

    def begin_step(self) -> None:
        if 0 <= self.sampled() < self.steps:
            ranks.native_core().timeline_recording(True)
            self.begin_ns = time.monotonic_ns()

    def end_step(self) -> None:
        k = self.sampled()
        self.seen += 1
        if not 0 <= k < self.steps:
            return
        end_ns = time.monotonic_ns()
        native = ranks.native_core()
        native.timeline_recording(False)
        records, _ = native.timeline_take()
        rows = np.empty((len(records) + 1, 7), dtype=np.float64)
        rows[0] = (k, _STEP, 0, -1, 0, self.begin_ns, end_ns)
        rows[1:, 0] = k
        rows[1:, 1:] = records
        self.rows.append(rows)

    def finish(self) -> None:
        """After the fit, on every rank (collective): gather, build and keep the sample."""
        global _sample
        if not self.rows:
            return
        mine = np.concatenate(self.rows)
        size, rank = ranks.get_size(), ranks.get_rank()
        longest = int(ranks.allreduce(np.array([len(mine)], dtype=np.int64), op="max")[0])
        table = np.zeros((size, longest, 7), dtype=np.float64)
        table[rank, : len(mine)] = mine
        table[rank, len(mine) :, 1] = -1  # (no record)
        hosts = np.zeros((size, _HOST_BYTES), dtype=np.int32)
        name = socket.gethostname().encode()[:_HOST_BYTES]
        hosts[rank, : len(name)] = np.frombuffer(name, dtype=np.uint8)
        table, hosts = ranks.allreduce(table), ranks.allreduce(hosts)
        if not ranks.is_master_rank():
            return
        names = [bytes(h.astype(np.uint8)).rstrip(b"\0").decode() for h in hosts]
        per_rank = [t[t[:, 1] != -1] for t in table]
        _sample = build_sample(per_rank, names)
        directory = settings.TIMELINE.read()
        if directory:
            write_files(_sample, directory)


def build_sample(per_rank: list[np.ndarray], hosts: list[str]) -> dict:
    """The sample of the ranks' records (rows: step, kind, path, bucket, bytes, begin_ns,
    end_ns): spans per rank and step in seconds on one time axis (see
    :mod:`tnt_notebook.timeline_report`)."""
    steps = [_steps_of(rows) for rows in per_rank]
    _set_waits(steps)
    offsets = _clock_offsets(steps, hosts)
    origin = min((s["begin"] + offsets[r] for r, rs in enumerate(steps) for s in rs[:1]), default=0)
    out = []
    for r, rank_steps in enumerate(steps):
        shift = offsets[r] - origin
        out.append({"rank": r, "host": hosts[r],
                    "steps": [_spans(step, shift) for step in rank_steps]})  # fmt: skip
    first = min((int(rows[0, 0]) for rows in per_rank if len(rows)), default=0)
    return {
        "world_size": len(per_rank),
        "hosts": hosts,
        "across_hosts": len(set(hosts)) > 1,
        "first_step": SKIPPED_STEPS + first,
        "ranks": out,
    }


def _steps_of(rows: np.ndarray) -> list[dict]:
    out = []
    for k in sorted({int(v) for v in rows[:, 0]}):
        mine = rows[rows[:, 0] == k]
        step = mine[mine[:, 1] == _STEP][0]
        kinds, _ = _codes()
        calls = mine[np.isin(mine[:, 1], (kinds["whole"], kinds["start"], kinds["finish"]))]
        calls = calls[np.argsort(calls[:, 5], kind="stable")]
        marks = {int(m[2]): m[5] for m in mine[mine[:, 1] == kinds["mark"]]}
        out.append(
            {"begin": step[5], "end": step[6], "calls": calls, "marks": marks, "waits": None}
        )
    return out


def _set_waits(steps: list[list[dict]]) -> None:
    """Each call's wait: its time less the least any rank spent in the same call (the k-th call
    of the same step on every rank; a step whose ranks made different calls waits nothing)."""
    for k in range(min(len(s) for s in steps)):
        calls = [s[k]["calls"] for s in steps]
        if len({len(c) for c in calls}) != 1:
            for s in steps:
                s[k]["waits"] = np.zeros(len(s[k]["calls"]))
            continue
        durations = np.array([c[:, 6] - c[:, 5] for c in calls])
        least = durations.min(axis=0)
        for s, d in zip(steps, durations, strict=True):
            s[k]["waits"] = d - least
    for rank_steps in steps:
        for s in rank_steps:
            if s["waits"] is None:
                s["waits"] = np.zeros(len(s["calls"]))


def _clock_offsets(steps: list[list[dict]], hosts: list[str]) -> list[float]:
    """Per rank, what puts its clock on rank 0's: 0 on rank 0's host (one clock), else the
    median lag of the ends of the steps' last collectives, which the ranks leave together."""
    offsets = [0.0] * len(steps)
    for r in range(1, len(steps)):
        if hosts[r] == hosts[0]:
            continue
        diffs = [
            a["calls"][-1, 6] - b["calls"][-1, 6]
            for a, b in zip(steps[0], steps[r], strict=False)
            if len(a["calls"]) and len(b["calls"])
        ]
        offsets[r] = statistics.median(diffs) if diffs else 0.0
    return offsets


def _spans(step: dict, shift: float) -> dict:
    """One step's spans in seconds (``shift``: ns to add to this rank's clock)."""

    def t(ns: float) -> float:
        return (ns + shift) / 1e9

    begin, end, calls, marks = step["begin"], step["end"], step["calls"], step["marks"]
    kinds, paths = _codes()
    spans: list[dict] = []

    def add(name: str, cat: str, b: float, e: float, args: dict | None = None) -> None:
        if e > b:
            spans.append({"name": name, "cat": cat, "begin": t(b), "end": t(e),
                          "args": args or {}})  # fmt: skip

    ready = min(max(marks.get(BATCH_READY, begin), begin), end)
    updated = marks.get(UPDATED)
    inside = (calls[:, 5] >= begin) & (calls[:, 6] <= end)
    in_step, waits = calls[inside], step["waits"][inside]
    add("input pipeline", "input", begin, ready)
    cursor = ready
    started: dict[int, float] = {}
    for call, wait in zip(in_step, waits, strict=True):
        kind, path, bucket, nbytes, b, e = (int(v) for v in call[1:])
        add("forward and backward", "compute", cursor, b)
        what = {kinds["whole"]: "allreduce", kinds["start"]: "allreduce start",
                kinds["finish"]: "allreduce finish"}[kind]  # fmt: skip
        args = {"bucket": bucket, "bytes": int(nbytes), "path": paths.get(path, str(path))}
        add(f"waiting for others ({what} bucket {bucket})", "wait", b, b + wait, args)
        add(f"{what} bucket {bucket}", "allreduce", b + wait, e, args)
        if kind == kinds["start"]:
            started[bucket] = e
        elif kind == kinds["finish"] and bucket in started:
            add(f"bucket {bucket} in flight", "in flight", started.pop(bucket), b, args)
        cursor = max(cursor, e)
    if not len(in_step):  # (one rank: no collectives)
        stop = updated if updated is not None else end
        add("forward and backward", "compute", cursor, stop)
        cursor = stop
    elif updated is not None and cursor <= updated <= end:
        add("optimizer update", "update", cursor, updated)
        cursor = updated
    add("other (metrics, Keras)", "other", cursor, end)
    spans.sort(key=lambda s: s["begin"])
    return {"begin": t(begin), "end": t(end), "spans": spans}


def write_files(sample: dict, directory: str) -> list[str]:
    """``timeline_summary.json`` and ``.txt``, ``timeline_trace.json`` (Chrome/Perfetto) and
    ``timeline.svg`` in ``directory`` (made if missing); their paths."""
    os.makedirs(directory, exist_ok=True)
    report = timeline_report.summary(sample)
    files = {
        "timeline_summary.json": json.dumps(report, indent=1),
        "timeline_summary.txt": timeline_report.text_table(report) + "\n",
        "timeline_trace.json": timeline_report.trace_json(sample),
        "timeline.svg": timeline_report.svg(sample),
    }
    paths = []
    for name, text in files.items():
        path = os.path.join(directory, name)
        with open(path, "w") as f:
            f.write(text)
        paths.append(path)
    return paths

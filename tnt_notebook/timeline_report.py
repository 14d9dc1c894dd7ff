"""What a timeline sample says, for the notebook, ``tnt-run``'s files and scripts alike.

A *sample* is what the master rank gathers after the sampled train steps of a fit
(:mod:`tnt_notebook.rank.timeline` builds it): plain data, so that it travels to the notebook as
it is. Per rank and step, spans on one time axis (seconds from the sample's start, the ranks'
clocks aligned on the ends of their collectives) of these categories:

- ``input``: from the step's call until its batch exists (the input pipeline);
- ``compute``: forward and backward pass, the time of the step outside its collectives until its
  last one ends;
- ``wait``: the part of a collective this rank spent waiting for the slowest rank: its time in the
  call less the least time any rank spent in that call (the last to arrive waits for nobody);
- ``allreduce``: the rest of a collective's call (one per fusion bucket, start and finish apart
  where a bucket travels in two halves), with its bucket, bytes and path;
- ``in flight``: a bucket between its start and its finish (overlapped with compute);
- ``update``: from the last collective to the optimizer's update done;
- ``other``: the rest of the step (metrics, Keras's own work until the step returns).

Imports nothing heavy: the notebook kernel renders these, never TensorFlow.
"""

from __future__ import annotations

import html
import json
import statistics

CATEGORIES = ("input", "compute", "wait", "allreduce", "in flight", "update", "other")
COLORS = {
    "input": "#8c6bb1",
    "compute": "#4c9be8",
    "wait": "#e8554c",
    "allreduce": "#f2b134",
    "in flight": "#f7dc9a",
    "update": "#52b36b",
    "other": "#b8b8b8",
}
#: A rank is named the straggler when the others wait for it this share of a step or more.
STRAGGLER_SHARE = 0.1
#: The Chrome trace holds at most this many spans (about 150 bytes each: under 5 MB).
MAX_TRACE_EVENTS = 25_000


def summary(sample: dict) -> dict:
    """Per rank the mean seconds per sampled step of each part (see the module's categories),
    each step's own, and the straggler: the rank that waits least, named where the others wait
    for it ``STRAGGLER_SHARE`` of a step or more (``straggler_lag_s``: by how much)."""
    ranks = []
    for r in sample["ranks"]:
        steps = [_step_parts(step) for step in r["steps"]]
        mean = {k: statistics.fmean(s[k] for s in steps) if steps else 0.0 for k in _PARTS}
        ranks.append({"rank": r["rank"], "host": r["host"], **mean, "steps": steps})
    step_s = statistics.median(r["step_s"] for r in ranks) if ranks else 0.0
    straggler, lag = None, 0.0
    if len(ranks) > 1:
        least = min(ranks, key=lambda r: r["wait_s"])
        others = [r["wait_s"] for r in ranks if r is not least]
        lag = statistics.median(others) - least["wait_s"]
        if lag > 0 and lag >= STRAGGLER_SHARE * step_s:
            straggler = least["rank"]
    return {
        "straggler": straggler,
        "straggler_lag_s": lag,
        "step_s": step_s,
        "first_step": sample["first_step"],
        "steps_sampled": max((len(r["steps"]) for r in sample["ranks"]), default=0),
        "across_hosts": sample["across_hosts"],
        "ranks": ranks,
    }


_PARTS = (
    "step_s",
    "input_s",
    "compute_s",
    "communication_s",
    "exposed_communication_s",
    "wait_s",
    "update_s",
    "other_s",
)
_SHOWN = _PARTS[:-1]  # the tables' columns (other work is what remains of a step)


def _step_parts(step: dict) -> dict:
    total = dict.fromkeys(CATEGORIES, 0.0)
    for span in step["spans"]:
        total[span["cat"]] += span["end"] - span["begin"]
    return {
        "step_s": step["end"] - step["begin"],
        "input_s": total["input"],
        "compute_s": total["compute"],
        "communication_s": total["allreduce"] + total["in flight"],
        "exposed_communication_s": total["allreduce"],
        "wait_s": total["wait"],
        "update_s": total["update"],
        "other_s": total["other"],
    }


def chrome_trace(sample: dict) -> dict:
    """The sample as a Chrome/Perfetto trace (``chrome://tracing``, ui.perfetto.dev): one
    process per rank, at most ``MAX_TRACE_EVENTS`` spans (the first steps that fit)."""
    events: list[dict] = []
    for r in sample["ranks"]:
        events.append(
            {"name": "process_name", "ph": "M", "pid": r["rank"],
             "args": {"name": f"rank {r['rank']} ({r['host']})"}}
        )  # fmt: skip
    steps = max((len(r["steps"]) for r in sample["ranks"]), default=0)
    budget = MAX_TRACE_EVENTS
    for s in range(steps):
        step_events = []
        for r in sample["ranks"]:
            if s >= len(r["steps"]):
                continue
            step = r["steps"][s]
            step_events.append(_event(r["rank"], f"step {sample['first_step'] + s}", "step",
                                      step["begin"], step["end"], {}, tid=0))  # fmt: skip
            for span in step["spans"]:
                step_events.append(_event(r["rank"], span["name"], span["cat"], span["begin"],
                                          span["end"], span.get("args", {}), tid=1))  # fmt: skip
        if len(step_events) > budget:
            break
        budget -= len(step_events)
        events.extend(step_events)
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _event(pid: int, name: str, cat: str, begin: float, end: float, args: dict, tid: int) -> dict:
    ts, dur = round(begin * 1e6, 1), round((end - begin) * 1e6, 1)
    return {"name": name, "cat": cat, "ph": "X", "pid": pid, "tid": tid, "ts": ts, "dur": dur,
            "args": args}  # fmt: skip


def trace_json(sample: dict) -> str:
    return json.dumps(chrome_trace(sample), separators=(",", ":"))


def svg(sample: dict, width: int = 960) -> str:
    """The sampled steps as stacked spans on one time axis, one row per rank, with a legend."""
    left, row, top = 110, 24, 30
    ranks = sample["ranks"]
    end = max((st["end"] for r in ranks for st in r["steps"]), default=0.0) or 1e-9
    scale = (width - left - 20) / end
    height = top + row * len(ranks) + 60
    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="12">',
        f'<rect width="{width}" height="{height}" fill="white"/>',
        f'<text x="{left}" y="18">{html.escape(_title(sample))}</text>',
    ]
    for i, r in enumerate(ranks):
        y = top + i * row
        out.append(f'<text x="4" y="{y + 16}">rank {r["rank"]}</text>')
        for step in r["steps"]:
            for span in step["spans"]:
                x, w = left + span["begin"] * scale, (span["end"] - span["begin"]) * scale
                if w >= 0.05:
                    out.append(
                        f'<rect x="{x:.2f}" y="{y + 2}" width="{w:.2f}" height="{row - 4}" '
                        f'fill="{COLORS[span["cat"]]}"><title>{html.escape(span["name"])} '
                        f"{(span['end'] - span['begin']) * 1e3:.3f} ms</title></rect>"
                    )
    axis_y = top + row * len(ranks) + 4
    out.append(f'<line x1="{left}" y1="{axis_y}" x2="{width - 20}" y2="{axis_y}" stroke="#444"/>')
    for k in range(6):
        t = end * k / 5
        x = left + t * scale
        out.append(
            f'<text x="{x:.1f}" y="{axis_y + 16}" text-anchor="middle">{t * 1e3:.0f} ms</text>'
        )
    x = left
    for cat in CATEGORIES:
        out.append(f'<rect x="{x}" y="{axis_y + 28}" width="12" height="12" fill="{COLORS[cat]}"/>')
        out.append(f'<text x="{x + 16}" y="{axis_y + 38}">{cat}</text>')
        x += 24 + 7 * len(cat)
    out.append("</svg>")
    return "\n".join(out)


def _title(sample: dict) -> str:
    steps = max((len(r["steps"]) for r in sample["ranks"]), default=0)
    first = sample["first_step"]
    return f"train steps {first}-{first + steps - 1} of the last fit, ranks as rows"


def text_table(report: dict) -> str:
    """The summary as a plain-text table (milliseconds per step), with the straggler's line."""
    head = ("rank", "step", "input", "compute", "comm", "exposed", "wait", "update")
    lines = ["  ".join(f"{h:>8}" for h in head)]
    for r in report["ranks"]:
        lines.append("  ".join([f"{r['rank']:>8}", *(f"{r[k] * 1e3:>8.2f}" for k in _SHOWN)]))
    return "\n".join([*lines, straggler_line(report)])


def html_table(report: dict) -> str:
    head = ("rank", "host", "step", "input", "compute", "communication", "exposed comm.",
            "waiting for others", "update")  # fmt: skip
    rows = [
        "<tr>" + f"<td>{r['rank']}</td><td>{html.escape(r['host'])}</td>"
        + "".join(f"<td>{r[k] * 1e3:.2f}</td>" for k in _SHOWN) + "</tr>"
        for r in report["ranks"]
    ]  # fmt: skip
    return (
        "<table><thead><tr>" + "".join(f"<th>{h}</th>" for h in head)
        + "</tr></thead><tbody>" + "".join(rows) + "</tbody></table>"
        + f"<p>ms per sampled step. {html.escape(straggler_line(report))}</p>"
    )  # fmt: skip


def straggler_line(report: dict) -> str:
    if report["straggler"] is None:
        return "No rank stands out: the ranks wait for each other little or alike."
    return (
        f"Straggler: rank {report['straggler']}; the others wait for it "
        f"{report['straggler_lag_s'] * 1e3:.2f} ms per step "
        f"({report['straggler_lag_s'] / report['step_s']:.0%} of a step)."
    )

"""Notebook views of the progress payloads published by the master rank.

:class:`WidgetProgressView` is the live display (stock ipywidgets: HTML header, epoch and step
bars, metrics, a small loss chart). When the call ends, its output is replaced by a static HTML +
plain-text summary with the final values, green when done, red when failed, so a saved notebook
stays readable in any frontend (widget state is usually not saved with the notebook, and a widget
without its state renders as an error when the notebook is reopened).
:class:`TextProgressView` renders the same payloads as plain text only.
"""

from __future__ import annotations

import base64
import contextlib
import html
import json
from typing import Any

from tnt_notebook import settings
from tnt_notebook.progress_payload import (
    PAYLOAD_VERSION,
    PROGRESS_MIME,
    display_publish,
    format_duration,
    format_logs,
    format_value,
    ordered,
    ranks_text,
    text_line,
)

GREEN = "#2e7d32"
RED = "#c62828"
GREY = "#757575"
BLUE = "#1565c0"
ORANGE = "#ef6c00"
STATUS_TEXT = {"running": "running", "done": "done", "failed": "failed", "stopped": "stopped"}


def default_view_class() -> type:
    """Widgets, unless TNT_PROGRESS_VIEW=text asks for text or ipywidgets is missing."""
    if settings.PROGRESS_VIEW.read() == "text":
        return TextProgressView
    try:
        import ipywidgets  # noqa: F401
    except ImportError:
        return TextProgressView
    return WidgetProgressView


class _View:
    """What both views share: the state, the display id, finishing and the final summary."""

    publish = staticmethod(display_publish)

    def __init__(self, state: dict[str, Any]) -> None:
        self.state = dict(state)
        self.display_id = f"{state['id']}-view"
        self.finished = False

    def update(self, state: dict[str, Any]) -> None:
        if self.finished:
            return
        self.state = dict(state)
        if state.get("status") in ("done", "failed"):
            self.finish(state.get("error") if state.get("status") == "failed" else None)
        else:
            self._render()

    def finish(self, error: str | None = None) -> None:
        """Final state: ``done`` if the rank said so, ``failed`` with an error, else ``stopped``.

        The summary replaces the live view in the output (the view itself is not updated to the
        final state: no frontend would show it, and its messages cost the training cores).
        """
        if self.finished:
            return
        if error is not None:
            self.state["status"] = "failed"
            self.state["error"] = error
        elif self.state.get("status") == "running":
            self.state["status"] = "stopped"
        self.state["eta"] = 0.0
        self.finished = True
        self.publish(
            {"text/html": summary_html(self.state), "text/plain": summary_text(self.state)},
            self.display_id,
            True,
        )

    def _render(self) -> None:
        raise NotImplementedError


class TextProgressView(_View):
    """Plain-text progress: one line, updated in place; the summary at the end."""

    def __init__(self, state: dict[str, Any]) -> None:
        super().__init__(state)
        self.publish({"text/plain": text_line(self.state)}, self.display_id, False)
        if state.get("status") in ("done", "failed"):
            self.finish(state.get("error"))

    @property
    def text(self) -> str:
        return summary_text(self.state) if self.finished else text_line(self.state)

    def _render(self) -> None:
        self.publish({"text/plain": text_line(self.state)}, self.display_id, True)


class WidgetProgressView(_View):
    """Live ipywidgets view; ``widgets`` exposes every widget so tests can read their state.

    tqdm's shape: HTML, then the epoch and step bars (their counts in the bars' descriptions),
    then HTML for metrics and the chart. Built lean, because the notebook kernel builds and
    updates it while the ranks train on the same cores: widgets are created with their first
    values and share their Layout and Style models (11 comm messages per view instead of 38, and
    3.7 instead of 10.3 ms of kernel CPU), and an update sends one message per widget that
    changed (usually the step bar and the metrics).
    """

    def __init__(self, state: dict[str, Any]) -> None:
        import ipywidgets as w
        from ipywidgets.widgets.widget_int import ProgressStyle
        from ipywidgets.widgets.widget_string import HTMLStyle

        super().__init__(state)
        self._chart_points = -1
        values = self._values()
        plain, text_style = w.Layout(), HTMLStyle()
        bar_style = ProgressStyle(description_width="10em")
        bar_layout = w.Layout(width="460px")
        epoch_layout = bar_layout if state.get("mode") == "fit" else w.Layout(display="none")
        self.widgets: dict[str, Any] = {
            "header": w.HTML(**values["header"], layout=plain, style=text_style),
            "epoch_bar": w.IntProgress(**values["epoch_bar"], layout=epoch_layout, style=bar_style),
            "step_bar": w.IntProgress(**values["step_bar"], layout=bar_layout, style=bar_style),
            "metrics": w.HTML(**values["metrics"], layout=plain, style=text_style),
            "chart": w.HTML(**values["chart"], layout=plain, style=text_style),
        }
        self.box = w.VBox(
            list(self.widgets.values()),
            layout=w.Layout(padding="4px 8px", border_left=f"4px solid {BLUE}"),
            _dom_classes=["tnt-progress"],
        )
        bundle = self.box._repr_mimebundle_()
        bundle["text/plain"] = text_line(self.state)
        self.publish(bundle, self.display_id, False)
        if state.get("status") in ("done", "failed"):
            self.finish(state.get("error"))

    def _render(self) -> None:
        # one comm message per widget and update, however many of its traits change
        values = self._values()
        with contextlib.ExitStack() as stack:
            for name in values:
                stack.enter_context(self.widgets[name].hold_sync())
            for name, traits in values.items():
                for trait, value in traits.items():
                    setattr(self.widgets[name], trait, value)

    def _values(self) -> dict[str, dict[str, Any]]:
        """What the view shows of the running call: trait values by widget (the end shows in
        the summary)."""
        s = self.state
        epochs = s.get("epochs") or 1
        steps = s.get("steps")
        step = s.get("step", 0)
        top = max(steps if steps is not None else step, 1)
        step_name = "Step" if s.get("mode") == "fit" else "Batch"
        values: dict[str, dict[str, Any]] = {
            "header": {"value": header_html(s)},
            "epoch_bar": {
                "description": f"Epoch {epoch_label(s)}/{epochs}",
                "max": epochs,
                "value": min(s.get("epochs_done") or 0, epochs),
            },
            "step_bar": {
                "description": f"{step_name} {step}/{steps if steps is not None else '?'}",
                "max": top,
                "value": min(step, top),
            },
            "metrics": {"value": metrics_html(s)},
        }
        points = len(s.get("history", {}).get("loss", []))
        if points != self._chart_points:  # the chart changes at epoch ends only
            values["chart"] = {"value": chart_html(s.get("history", {}))}
            self._chart_points = points
        return values


# --------------------------------------------------------------------------- HTML and text


def epoch_label(s: dict[str, Any]) -> int:
    """The running epoch (1-based, as Keras prints it) while running, else the epochs done."""
    if s.get("status") == "running" and s.get("epoch"):
        return min(s["epoch"], s.get("epochs") or s["epoch"])
    return s.get("epochs_done") or 0


def header_html(s: dict[str, Any]) -> str:
    status = s.get("status", "running")
    icon = {"done": "&#10004;", "failed": "&#10008;", "stopped": "&#9632;"}.get(status, "&#9654;")
    color = {"done": GREEN, "failed": RED, "stopped": GREY}.get(status, BLUE)
    what = f"<b>{html.escape(str(s.get('mode')))}</b>"
    details = []
    if s.get("world_size"):
        details.append(html.escape(ranks_text(s["world_size"], s.get("devices"))))
    if s.get("batch_size"):
        details.append(f"global batch {s['batch_size']}")
    phase = " (validating)" if status == "running" and s.get("phase") == "validate" else ""
    line = (
        f'<span style="color:{color}">{icon} {what} {STATUS_TEXT.get(status, status)}{phase}</span>'
    )
    if details:
        line += " &middot; " + " &middot; ".join(details)
    if s.get("error"):
        line += f'<br><span style="color:{RED}">{html.escape(str(s["error"]))}</span>'
    return f'<div class="tnt-progress-header">{line}</div>'


def metrics_html(s: dict[str, Any]) -> str:
    rows = []
    logs = s.get("logs") or {}
    if logs:
        rows.append(_kv_line(logs))
    val = {k: v for k, v in (s.get("epoch_logs") or {}).items() if k.startswith("val_")}
    if val:
        rows.append(_kv_line(val))
    timing = []
    if s.get("samples_per_s"):
        timing.append(f"<b>{s['samples_per_s']:,.0f}</b> samples/s")
    elif s.get("steps_per_s"):
        timing.append(f"<b>{s['steps_per_s']:,.1f}</b> steps/s")
    timing.append(f"elapsed <b>{format_duration(s.get('elapsed'))}</b>")
    if s.get("status") == "running":
        timing.append(f"ETA <b>{format_duration(s.get('eta'))}</b>")
    rows.append(" &middot; ".join(timing))
    return '<div class="tnt-progress-metrics">' + "<br>".join(rows) + "</div>"


def _kv_line(logs: dict[str, Any]) -> str:
    return " &middot; ".join(
        f"{html.escape(k)} <b>{html.escape(format_value(v))}</b>" for k, v in ordered(logs).items()
    )


def chart_svg(history: dict[str, list[float]], width: int = 320, height: int = 110) -> str | None:
    """A small line chart of loss (and val_loss) per epoch; None until there is a point."""
    series = [  # nan / inf arrive as strings and are left out
        (k, [v for v in history[k] if isinstance(v, float)], c)
        for k, c in (("loss", BLUE), ("val_loss", ORANGE))
        if any(isinstance(v, float) for v in history.get(k, []))
    ]
    if not series:
        return None
    values = [v for _, vs, _ in series for v in vs]
    lo, hi = min(values), max(values)
    if hi - lo < 1e-12:
        lo, hi = lo - 0.5, hi + 0.5
    n = max(len(vs) for _, vs, _ in series)
    left, right, top, bottom = 44, 8, 8, 20
    pw, ph = width - left - right, height - top - bottom

    def xy(i: int, v: float) -> tuple[float, float]:
        x = left + (pw * i / (n - 1) if n > 1 else pw / 2)
        return x, top + ph * (hi - v) / (hi - lo)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'font-family="sans-serif" font-size="10">',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#bbb"/>',
        f'<text x="{left - 4}" y="{top + 8}" text-anchor="end">{format_value(hi)}</text>',
        f'<text x="{left - 4}" y="{top + ph}" text-anchor="end">{format_value(lo)}</text>',
        f'<text x="{left}" y="{height - 6}">epoch 1</text>',
        f'<text x="{left + pw}" y="{height - 6}" text-anchor="end">{n}</text>',
    ]
    for k, (name, vs, color) in enumerate(series):
        pts = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(i, v) for i, v in enumerate(vs)))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
        for i, v in enumerate(vs):
            x, y = xy(i, v)
            parts.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>')
        lx = left + pw - 70
        parts.append(f'<text x="{lx}" y="{top + 14 + 12 * k}" fill="{color}">{name}</text>')
    parts.append("</svg>")
    return "".join(parts)


def chart_html(history: dict[str, list[float]]) -> str:
    """The chart as an <img> with an SVG data URI (kept by HTML sanitizers that drop <svg>)."""
    svg = chart_svg(history)
    if svg is None:
        return ""
    data = base64.b64encode(svg.encode()).decode()
    return (
        f'<img class="tnt-progress-chart" alt="loss per epoch" '
        f'src="data:image/svg+xml;base64,{data}"/>'
    )


def _bar_html(label: str, done: int, total: int | None, color: str) -> str:
    frac = 1.0 if not total else min(done / total, 1.0)
    return (
        '<div style="display:flex;align-items:center;gap:8px;margin:2px 0">'
        f'<span style="width:5.5em">{label}</span>'
        '<span style="display:inline-block;width:320px;height:12px;background:#e0e0e0">'
        f'<span style="display:block;width:{100 * frac:.1f}%;height:100%;background:{color}">'
        "</span></span>"
        f"<span>{done}/{total if total is not None else '?'}</span></div>"
    )


def summary_html(s: dict[str, Any]) -> str:
    """Static final summary (what a saved notebook shows): header, bars, metrics, history, chart."""
    status = s.get("status", "done")
    color = {"done": GREEN, "failed": RED}.get(status, GREY)
    parts = [
        f'<div class="tnt-progress tnt-progress-summary" data-status="{status}" '
        f'style="border-left:4px solid {color};padding:4px 8px">',
        header_html(s),
    ]
    if s.get("mode") == "fit":
        parts.append(_bar_html("Epoch", s.get("epochs_done") or 0, s.get("epochs"), color))
    label = "Step" if s.get("mode") == "fit" else "Batch"
    parts.append(_bar_html(label, s.get("step", 0), s.get("steps"), color))
    parts.append(metrics_html(s))
    history = s.get("history") or {}
    if history:
        names = list(history)
        n = max(len(v) for v in history.values())
        head = "".join(f"<th>{html.escape(k)}</th>" for k in names)
        rows = "".join(
            f"<tr><td>{i + 1}</td>"
            + "".join(
                f"<td>{format_value(history[k][i]) if i < len(history[k]) else ''}</td>"
                for k in names
            )
            + "</tr>"
            for i in range(n)
        )
        parts.append(
            '<table class="tnt-progress-history" style="font-size:90%">'
            f"<tr><th>epoch</th>{head}</tr>{rows}</table>"
        )
        parts.append(chart_html(history))
    parts.append("</div>")
    return "".join(parts)


def summary_text(s: dict[str, Any]) -> str:
    """Multi-line plain-text final summary: the status line, then the per-epoch history."""
    lines = [text_line(s)]
    history = s.get("history") or {}
    if history:
        names = list(history)
        n = max(len(v) for v in history.values())
        width = max(10, *(len(k) + 2 for k in names))
        lines.append("epoch".ljust(7) + "".join(k.rjust(width) for k in names))
        for i in range(n):
            cells = "".join(
                (format_value(history[k][i]) if i < len(history[k]) else "").rjust(width)
                for k in names
            )
            lines.append(str(i + 1).ljust(7) + cells)
    elif s.get("mode") != "fit" and s.get("logs"):
        lines.append(format_logs(s["logs"]))
    return "\n".join(lines)


class ProgressDisplays:
    """The notebook's live progress views, one per fit / evaluate / predict of the running cell.

    ``view_class`` is swappable (tqdm-style): it is called with the first payload and must
    provide ``update(state)``, ``finish(error)`` and ``finished``.
    """

    def __init__(self, view_class: type | None = None) -> None:
        self.view_class = view_class
        self.views: dict[str, Any] = {}
        self._cell: list[str] = []

    def handle(self, data: dict, metadata: dict, display_id: str | None, update: bool) -> bool:
        """Consume one display message from a rank; False if it carries no progress payload."""
        if PROGRESS_MIME not in data:
            return False
        state = data[PROGRESS_MIME]
        if isinstance(state, str | bytes):
            state = json.loads(state)
        if not isinstance(state, dict) or state.get("version") != PAYLOAD_VERSION:
            return False
        key = state.get("id") or display_id
        if not key:
            return False
        view = self.views.get(key)
        if view is None:
            view = self._new_view(state)
            self.views[key] = view
            self._cell.append(key)
        else:
            view.update(state)
        return True

    def end_of_cell(self, error: str | None) -> None:
        """Finish every view of the cell that is still running: failed if the cell failed."""
        for key in self._cell:
            view = self.views.get(key)
            if view is not None and not view.finished:
                view.finish(error)
        self._cell.clear()

    def _new_view(self, state: dict) -> Any:
        cls = self.view_class
        if cls is None:
            cls = default_view_class()
        return cls(state)


displays = ProgressDisplays()


def handle_display(data: dict, metadata: dict, display_id: str | None, update: bool) -> bool:
    """Render a rank's display message as the notebook's progress view; False if it is not ours."""
    return displays.handle(data, metadata, display_id, update)


def end_of_cell(error: str | None) -> None:
    """Called by remote.py when a %%tnt cell ends; unfinished views fail when error is set."""
    displays.end_of_cell(error)

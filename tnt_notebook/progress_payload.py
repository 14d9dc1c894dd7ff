"""The progress payload, the contract between the master rank that publishes it
(:mod:`tnt_notebook.rank.progress_publisher`) and the notebook that renders it
(:mod:`tnt_notebook.notebook.progress_views`): its MIME type and version, its text rendering, and
how a bundle is sent on a kernel's iopub. Imports nothing heavy; both sides import it.
"""

from __future__ import annotations

import math
from typing import Any

PROGRESS_MIME = "application/vnd.tnt-notebook.progress+json"
PAYLOAD_VERSION = 1
MODES = ("fit", "evaluate", "predict")


def display_publish(bundle: dict, display_id: str, update: bool) -> None:
    """Publish a raw MIME bundle under a display id on this kernel's (an engine's) iopub.

    In an ipykernel-based shell the message is sent straight through the display publisher's
    session and socket: ``IPython.display.display`` would first flush stdout and stderr, a
    round trip to the IO thread that costs milliseconds on a busy machine, at every update.
    Anywhere else it falls back to ``IPython.display.display``.
    """
    from IPython.core.interactiveshell import InteractiveShell

    pub = InteractiveShell.instance().display_pub if InteractiveShell.initialized() else None
    session, socket = getattr(pub, "session", None), getattr(pub, "pub_socket", None)
    if session is None or socket is None:
        from IPython.display import display

        display(bundle, raw=True, display_id=display_id, update=update)
        return
    content = {"data": bundle, "metadata": {}, "transient": {"display_id": display_id}}
    msg_type = "update_display_data" if update else "display_data"
    session.send(socket, msg_type, content, parent=pub.parent_header, ident=pub.topic)


def format_duration(seconds: float | None) -> str:
    """``mm:ss`` (or ``h:mm:ss``); ``?`` when unknown."""
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes:02d}:{secs:02d}"


def format_value(value: Any) -> str:
    """Metric values the way Keras prints them (4 significant decimals)."""
    if isinstance(value, float):
        return f"{value:.4e}" if value != 0 and abs(value) < 1e-3 else f"{value:.4f}"
    return str(value)


def ordered(logs: dict[str, Any]) -> dict[str, Any]:
    """Loss first, then the other metrics, then their validation counterparts."""

    def rank(item: tuple[int, str]) -> tuple[bool, bool, int]:
        index, key = item
        base = key.removeprefix("val_")
        return key.startswith("val_"), base != "loss", index

    keys = [k for _, k in sorted(enumerate(logs), key=rank)]
    return {k: logs[k] for k in keys}


def format_logs(logs: dict[str, Any]) -> str:
    return " - ".join(f"{k}: {format_value(v)}" for k, v in ordered(logs).items())


def ranks_text(world_size: int, devices: str | None = None) -> str:
    """The world and its devices in words: "2 ranks on CPU", "4 ranks, one GPU each (NAME)"."""
    ranks = f"{world_size} rank{'s' if world_size != 1 else ''}"
    if not devices:
        return ranks
    return f"{ranks} on {devices}" if devices == "CPU" else f"{ranks}, {devices}"


def text_line(state: dict[str, Any]) -> str:
    """One-line plain-text rendering of a payload (the fallback of frontends without widgets)."""
    parts = [state["mode"]]
    if state.get("status") != "running":
        parts[0] += f" {state['status']}"
    if state.get("epochs"):
        running = state.get("status") == "running" and state.get("epoch")
        epoch = min(state["epoch"], state["epochs"]) if running else state.get("epochs_done") or 0
        parts.append(f"epoch {epoch}/{state['epochs']}")
    steps = state.get("steps")
    parts.append(f"step {state.get('step', 0)}/{steps if steps is not None else '?'}")
    # the latest training values, and the validation values of the last finished epoch
    epoch_logs = state.get("epoch_logs", {})
    train = state.get("logs") or {k: v for k, v in epoch_logs.items() if not k.startswith("val_")}
    logs = {**train, **{k: v for k, v in epoch_logs.items() if k.startswith("val_")}}
    if logs:
        parts.append(format_logs(logs))
    if state.get("samples_per_s"):
        parts.append(f"{state['samples_per_s']:,.0f} samples/s")
    timing = format_duration(state.get("elapsed"))
    if state.get("status") == "running":
        timing += f" elapsed, ETA {format_duration(state.get('eta'))}"
    else:
        timing += " total"
    parts.append(timing)
    if state.get("error"):
        parts.append(f"error: {state['error']}")
    return " | ".join(parts)


def normalize_verbose(verbose: int | str) -> int:
    if verbose == "auto":
        return 1
    try:
        return int(verbose)
    except (TypeError, ValueError):
        raise ValueError(f"verbose must be 0, 1, 2 or 'auto', not {verbose!r}") from None


def finite_floats(logs: dict | None) -> dict[str, Any]:
    """Numeric log values as floats (nan / inf as strings: the payload is strict JSON)."""
    out: dict[str, Any] = {}
    for key, value in (logs or {}).items():
        try:
            number = float(value)
        except (TypeError, ValueError):
            continue
        out[str(key)] = number if math.isfinite(number) else str(number)
    return out

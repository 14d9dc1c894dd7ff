"""Where this rank is now, for the stack report (``%tnt_cluster stacks``, ``Cluster.stacks()``):
the top frames of its main thread and the collective its native engine is in.

The request comes as a control message: ipyparallel's engine answers those on a thread of its
own while the main thread runs a cell, and the collectives release the GIL while they wait, so
a rank blocked in one answers within milliseconds. A rank whose main thread holds the GIL in
native code cannot answer; the notebook names it as silent after a bounded wait.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

REQUEST = "tnt_stacks_request"
REPLY = "tnt_stacks_reply"
FRAMES = 6  # the main thread's innermost frames that a report shows

_CELL = {"running": False}  # set while a cell's own code runs (ipyparallel_hooks)


def set_cell_running(running: bool) -> None:
    _CELL["running"] = running


def _place(filename: str, shell: Any) -> str:
    """A frame's file as the user knows it: ``<cell>`` for a notebook cell, else relative to the
    longest entry of sys.path that holds it (site-packages, the working directory)."""
    if shell is not None and shell.compile.format_code_name(filename):
        return "<cell>"
    best = ""
    for entry in sys.path:
        root = os.path.abspath(entry or os.getcwd())
        if filename.startswith(root + os.sep) and len(root) > len(best):
            best = root
    return filename[len(best) + 1 :] if best else filename


def main_thread_frames(limit: int = FRAMES) -> list[dict[str, Any]]:
    """The main thread's innermost frames, outermost first (file, line, function, source line),
    from the cell's own code inward when a cell runs (IPython's frames around it left out); where
    more lie between the innermost cell frame and the `limit` innermost, that cell frame, then
    how many were left out (``{"gap": n}``)."""
    import linecache

    from IPython import get_ipython

    shell = get_ipython()
    frame = sys._current_frames().get(threading.main_thread().ident)
    frames = []
    while frame is not None:
        code = frame.f_code
        frames.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    places = [_place(name, shell) for name, _, _ in frames]
    keep = list(range(min(limit, len(frames))))  # (innermost first)
    if "<cell>" in places:
        keep = [i for i in keep if i <= len(places) - 1 - places[::-1].index("<cell>")]
        cell = places.index("<cell>")  # the innermost cell frame
        if cell >= limit:
            keep = [*range(limit - 1), -(cell - limit + 1), cell]
    shown: list[dict[str, Any]] = []
    for i in keep:
        if i < 0:
            shown.append({"gap": -i})
            continue
        name, line, function = frames[i]
        code = linecache.getline(name, line).strip()
        shown.append({"file": places[i], "line": line, "function": function, "code": code})
    return shown[::-1]


def where_this_rank_is() -> dict[str, Any]:
    """This rank's report: frames, whether a cell runs, the collective it is in, the last one
    that failed, and how many its engine entered (None: no engine yet)."""
    ranks = sys.modules.get("tnt_notebook.rank.api")
    engine = getattr(ranks, "_engine", None)
    return {
        "frames": main_thread_frames(),
        "in_cell": _CELL["running"],
        "collective": engine.current_call if engine is not None else None,
        "failed": engine.failed_call if engine is not None else None,
        "entered": engine.calls_entered if engine is not None else None,
    }


def answer_stack_requests() -> None:
    """Registers the control message handler on this rank's ipyparallel engine kernel."""
    from IPython import get_ipython

    kernel = getattr(get_ipython(), "kernel", None)
    if kernel is None:
        return

    def handle(stream: Any, idents: list[bytes], parent: dict[str, Any]) -> None:
        try:
            content = {"status": "ok", "report": where_this_rank_is()}
        except Exception as e:  # noqa: BLE001 - the notebook shows why this rank could not say
            content = {"status": "error", "evalue": f"{type(e).__name__}: {e}"}
        kernel.session.send(stream, REPLY, content, parent=parent, ident=idents)

    kernel.control_handlers[REQUEST] = handle

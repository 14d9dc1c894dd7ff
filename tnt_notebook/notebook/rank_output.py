"""What ranks print, shown in the notebook: the master rank's output live, or every rank's merged.

* default: the master rank's (lowest target's) stdout, stderr and rich output are shown live,
  exactly as produced; other ranks' output is not shown.
* ``all_ranks``: every rank's output is merged line by line. Line k of a stream is shown once
  every still-running rank has produced its line k (or finished), so output stays live while the
  ranks advance together; identical lines are printed once under a label of the ranks that
  produced them (``[stdout:0-3]``), a new label only when the set of ranks changes. Rich outputs
  are merged the same way (k-th display of every rank, identical data shown once).
* display messages always go to ``progress_views.handle_display``
  first (master rank only); it consumes the progress widget's messages.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tnt_notebook.cluster.lifecycle import rank_ranges
from tnt_notebook.notebook import progress_views


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

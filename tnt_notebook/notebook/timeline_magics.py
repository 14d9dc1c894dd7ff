"""``%tnt_timeline on [--steps K] | off | show``: the timeline of sampled train steps
(:mod:`tnt_notebook.rank.timeline`) from the notebook, shown as a plot of the ranks' spans and a
summary table (:mod:`tnt_notebook.timeline_report`)."""

from __future__ import annotations

from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from IPython.display import HTML, SVG, display

from tnt_notebook import timeline_report


@magics_class
class TimelineMagics(Magics):
    """The timeline's magic, on the cluster of ``%tnt_cluster`` (TntMagics)."""

    @magic_arguments()
    @argument(
        "action",
        choices=("on", "off", "show"),
        help="on: each later fit records its sampled steps; off; show: the last fit's plot "
        "and summary",
    )
    @argument(
        "--steps",
        type=int,
        default=None,
        metavar="K",
        help="steps sampled per fit, after its first 2 (default 20, TNT_TIMELINE_STEPS)",
    )
    @argument("--trace", default=None, metavar="FILE", help="show: also write the Chrome trace")
    @line_magic
    def tnt_timeline(self, line: str = "") -> None:
        """Record and show where each rank's train steps spend their time."""
        args = parse_argstring(self.tnt_timeline, line)
        if args.steps is not None and args.steps < 1:
            raise UsageError("--steps must be at least 1")
        cluster = self.shell.magics_manager.registry["TntMagics"].cluster
        if cluster is None:
            raise UsageError("no tnt cluster is running; start one with %tnt_cluster -n N")
        if args.action != "show":
            steps = cluster.apply(_switch, args.action == "on", args.steps)[0]
            print(f"timeline on: each fit records steps 2-{steps + 1}" if steps else "timeline off")
            return
        sample = cluster.apply(_sample, targets=[0])[0]
        if sample is None:
            raise UsageError("no timeline yet: %tnt_timeline on, then fit in a %%tnt cell")
        show(sample)
        if args.trace:
            with open(args.trace, "w") as f:
                f.write(timeline_report.trace_json(sample))
            print(f"Chrome trace written to {args.trace} (open it in ui.perfetto.dev)")


def _switch(on: bool, steps: int | None) -> int:
    """On a rank: the timeline on or off; how many steps a fit samples."""
    from tnt_notebook.rank import timeline

    timeline.timeline(on, steps)
    return timeline.recording_steps()


def _sample() -> dict | None:
    """On the master rank: the last fit's sample."""
    from tnt_notebook.rank import timeline

    return timeline.timeline_sample()


def show(sample: dict) -> None:
    """The plot (an SVG, kept as an image in a saved notebook) and the summary table."""
    report = timeline_report.summary(sample)
    display(SVG(timeline_report.svg(sample)))
    display(HTML(timeline_report.html_table(report)))


def load(ipython: Any) -> None:
    ipython.register_magics(TimelineMagics)

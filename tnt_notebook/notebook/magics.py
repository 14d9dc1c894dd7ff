"""IPython magics: ``%tnt_cluster``, ``%%tnt``, ``%tnt_pull``, ``%tnt_push``.

Thin: arguments are parsed here and handed to :mod:`tnt_notebook.cluster.options`,
:mod:`tnt_notebook.cluster.lifecycle` and :mod:`tnt_notebook.notebook.remote`; user mistakes
become a one-line ``UsageError``.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from tnt_notebook.cluster.cleanup import end_leftover_ranks_on_hosts
from tnt_notebook.cluster.errors import HostfileError
from tnt_notebook.cluster.lifecycle import Cluster
from tnt_notebook.cluster.options import LAUNCH_OPTIONS, plan_from_options
from tnt_notebook.cluster.plan import LaunchPlan
from tnt_notebook.notebook import timeline_magics
from tnt_notebook.notebook.remote import DEFAULT_FAIL_FAST_TIMEOUT, run_cell

ACTIONS = ("start", "status", "stacks", "stop", "restart", "cleanup")


def parse_targets(text: str, size: int) -> list[int] | None:
    """'all' -> None; '0,2-3' -> [0, 2, 3]; bad input -> UsageError."""
    text = text.strip()
    if text in ("all", "*", ""):
        return None
    out: set[int] = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise UsageError(f"--targets {text!r}: use rank numbers and ranges, e.g. 0,2-3")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if hi < lo:
            raise UsageError(f"--targets {text!r}: empty range {part.strip()!r}")
        out.update(range(lo, hi + 1))
    bad = sorted(r for r in out if r >= size)
    if bad:
        raise UsageError(f"--targets {text!r}: no rank(s) {bad} in a world of {size}")
    return sorted(out)


def launch_options(func: Any) -> Any:
    """The options %tnt_cluster shares with tnt-run (cluster.options.LAUNCH_OPTIONS)."""
    for flags, kwargs in reversed(LAUNCH_OPTIONS):
        func = argument(*flags, **kwargs)(func)
    return func


@magics_class
class TntMagics(Magics):
    """Magics that launch and drive one tnt cluster per notebook kernel."""

    def __init__(self, shell: Any = None) -> None:
        super().__init__(shell)
        self.cluster: Cluster | None = None

    # ------------------------------------------------------------ %tnt_cluster
    @magic_arguments()
    @argument(
        "action",
        nargs="?",
        default="start",
        choices=ACTIONS,
        help="start (default), status, stacks (where each rank is now: its stack, the collective "
        "it waits in, the ranks that have not arrived), stop, restart (same options again unless "
        "new ones given), or cleanup (end this user's leftover ranks on the hosts, as `tarantella "
        "--cleanup`; the running cluster's ranks are kept)",
    )
    @launch_options
    @argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="start-up timeout (default 60 s)",
    )
    @argument(
        "--controller-ip",
        default=None,
        metavar="ADDRESS",
        help="address of this machine the hosts reach (default: found from the routes to them)",
    )
    @line_magic
    def tnt_cluster(self, line: str = "") -> None:
        """Start, inspect, stop or restart the notebook's MPI cluster of ipyparallel engines."""
        args = parse_argstring(self.tnt_cluster, line)
        options_given = any(tok.startswith("-") for tok in shlex.split(line))
        if args.action == "status":
            if self.cluster is None:
                print("no tnt cluster is running (start one with %tnt_cluster -n N)")
            else:
                print(self.cluster.status_text())
            return
        if args.action == "stacks":
            print(self._running_cluster().stacks().text())
            return
        if args.action == "stop":
            if self.cluster is None:
                print("no tnt cluster is running")
                return
            self.cluster.stop()
            self.cluster = None
            print("tnt cluster stopped")
            return
        if args.action == "cleanup":
            plan = self.cluster.plan if self.cluster and not options_given else self._plan(args)
            running = self.cluster is not None and self.cluster.running
            keep = (self.cluster.cluster_id,) if running else ()
            print("\n".join(end_leftover_ranks_on_hosts(plan, keep=keep)))
            return
        if args.action == "restart" and self.cluster is not None and not options_given:
            try:  # same options, re-validated (hostfile re-read), in today's working directory
                plan = dataclasses.replace(self.cluster.plan, cwd=os.getcwd())
            except ValueError as e:
                raise UsageError(str(e)) from None
        else:
            plan = self._plan(args)
        try:
            plan.listen_address  # noqa: B018 - hosts that cannot be reached are a usage error
        except ValueError as e:
            raise UsageError(str(e)) from None
        if args.dry_run:
            print(plan.describe())
            return
        if args.action == "start" and self.cluster is not None and self.cluster.running:
            raise UsageError(
                f"a tnt cluster of {self.cluster.size} rank(s) is already running; "
                "use `%tnt_cluster restart [options]` to replace it or `%tnt_cluster stop`"
            )
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None
        if plan.devices.warning:
            print(f"WARNING: {plan.devices.warning}", file=sys.stderr)
        cluster = Cluster(plan)
        cluster.start()
        self.cluster = cluster
        hosts = sorted({r.host for r in cluster.ranks})
        job = f" of Slurm job {plan.slurm.job_id}" if plan.slurm is not None else ""
        print(
            f"tnt cluster ready: {cluster.size} rank(s) on {', '.join(hosts)}{job} "
            f"(engine id == MPI rank) in {cluster.startup_seconds:.1f} s, " + plan.devices.summary
        )

    def _plan(self, args: Any) -> LaunchPlan:
        try:
            return plan_from_options(args)
        except (HostfileError, ValueError) as e:
            raise UsageError(str(e)) from None

    def _running_cluster(self) -> Cluster:
        if self.cluster is None:
            raise UsageError("no tnt cluster is running; start one with %tnt_cluster -n N")
        return self.cluster

    # ------------------------------------------------------------ %%tnt
    @magic_arguments()
    @argument("--targets", default="all", help="ranks to run on, e.g. 0 or 0,2-3 (default all)")
    @argument(
        "--all-ranks",
        action="store_true",
        help="show every rank's output, identical output merged under its ranks",
    )
    @argument(
        "--timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="interrupt the ranks when the cell runs longer",
    )
    @argument(
        "--fail-fast-timeout",
        type=float,
        default=DEFAULT_FAIL_FAST_TIMEOUT,
        metavar="SECONDS",
        help="after a rank fails, how long the others may take to stop before the "
        "cluster is stopped (default 10 s)",
    )
    @cell_magic
    def tnt(self, line: str, cell: str) -> None:
        """Run the cell on every rank (engine id == MPI rank); shows the master rank's output."""
        args = parse_argstring(self.tnt, line)
        cluster = self._running_cluster()
        targets = parse_targets(args.targets, cluster.size)
        if args.timeout is not None and args.timeout <= 0:
            raise UsageError("--timeout must be > 0 seconds")
        if args.fail_fast_timeout <= 0:
            raise UsageError("--fail-fast-timeout must be > 0 seconds")
        run_cell(
            cluster,
            cell,
            targets=targets,
            all_ranks=True if args.all_ranks else None,
            timeout=args.timeout,
            fail_fast_timeout=args.fail_fast_timeout,
        )

    # ------------------------------------------------------------ pull / push
    @magic_arguments()
    @argument("--all-ranks", action="store_true", help="a list with every rank's value")
    @argument("--targets", default="all", help="ranks to pull from (default all)")
    @argument("names", nargs="+", help="variable names on the ranks")
    @line_magic
    def tnt_pull(self, line: str) -> None:
        """Copy variables from the ranks into the notebook (master rank's value by default)."""
        args = parse_argstring(self.tnt_pull, line)
        cluster = self._running_cluster()
        targets = parse_targets(args.targets, cluster.size)
        for name in args.names:
            if not name.isidentifier():
                raise UsageError(f"{name!r} is not a variable name")
        for name in args.names:
            try:
                value = cluster.pull(name, all_ranks=args.all_ranks, targets=targets)
            except NameError as e:
                raise UsageError(str(e)) from None
            self.shell.user_ns[name] = value

    @magic_arguments()
    @argument("--targets", default="all", help="ranks to push to (default all)")
    @argument("names", nargs="+", help="notebook variable names")
    @line_magic
    def tnt_push(self, line: str) -> None:
        """Copy notebook variables to the ranks' namespaces."""
        args = parse_argstring(self.tnt_push, line)
        cluster = self._running_cluster()
        targets = parse_targets(args.targets, cluster.size)
        missing = [n for n in args.names if n not in self.shell.user_ns]
        if missing:
            raise UsageError(f"not defined in the notebook: {', '.join(missing)}")
        cluster.push({n: self.shell.user_ns[n] for n in args.names}, targets=targets)


def load_ipython_extension(ipython: Any) -> None:
    """``%load_ext tnt_notebook``: register the magics (no cluster is started)."""
    ipython.register_magics(TntMagics)
    timeline_magics.load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """Stop the running cluster so %reload_ext leaves nothing behind."""
    magics = ipython.magics_manager.registry.get("TntMagics")
    if magics is not None and magics.cluster is not None:
        magics.cluster.stop()
        magics.cluster = None

"""``python -m tnt_notebook.bench cluster``: start-up and empty-cell round trip, beside ipyparallel.

In one process, through the real magics of an in-process IPython shell:

* start-up: ``%tnt_cluster -n N`` until every rank answered, against
  ``ipyparallel.Cluster(n=N, engines="mpi").start_and_connect_sync()`` plus waiting for N engines
  (median of ``--starts`` alternating runs; stops are not timed);
  with ``--hostfile H --n-per-node K``, both start K ranks on each host of H through Hydra's ssh
  launcher (``--ssh`` or ``$HYDRA_LAUNCHER_EXEC``), ipyparallel's controller listening on the same
  address as ours (run it from a directory every host sees);
* round trip: an empty ``%%tnt`` cell against an empty ``%%px`` cell on the same N engines
  (body ``pass``: IPython rejects a cell magic with no body at all; median of ``--cells`` runs
  after ``--warmup`` untimed ones).

Prints a table with ratios (ours / ipyparallel; below 1 is faster) and writes JSON
(``--json``, default bench-results/cluster.json).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import platform
import statistics
import sys
import time
from typing import Any

from tnt_notebook.bench import write_report


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tnt_notebook.bench cluster", description=__doc__)
    ap.add_argument("-n", type=int, default=2, help="ranks / engines on this machine (default 2)")
    ap.add_argument("--hostfile", default=None, help="ranks on these hosts instead")
    ap.add_argument("--n-per-node", type=int, default=1, help="ranks per host (default 1)")
    ap.add_argument("--ssh", default=None, help="how to reach the hosts (as for %%tnt_cluster)")
    ap.add_argument("--starts", type=int, default=3, help="start-ups timed per side (default 3)")
    ap.add_argument("--cells", type=int, default=200, help="empty cells timed per side")
    ap.add_argument("--warmup", type=int, default=20, help="untimed cells first (default 20)")
    ap.add_argument("--json", default="bench-results/cluster.json", help="where to write JSON")
    return ap.parse_args(argv)


def _shell() -> Any:
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "tnt_notebook")
    return ip


def _quiet() -> contextlib.AbstractContextManager:
    return contextlib.redirect_stdout(io.StringIO())


def _time_cells(run: Any, cells: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        run()
    out = []
    for _ in range(cells):
        t = time.perf_counter()
        run()
        out.append(time.perf_counter() - t)
    return out


def _where(args: argparse.Namespace) -> str:
    """%tnt_cluster's placement options."""
    if args.hostfile is None:
        return f"-n {args.n}"
    ssh = f" --ssh {args.ssh}" if args.ssh else ""
    return f"--hostfile {args.hostfile} --n-per-node {args.n_per_node}{ssh}"


def _tnt_start(ip: Any, where: str) -> float:
    with _quiet():
        t = time.perf_counter()
        ip.run_line_magic("tnt_cluster", f"{where} --timeout 180")
        return time.perf_counter() - t


def _tnt_stop(ip: Any) -> None:
    with _quiet():
        ip.run_line_magic("tnt_cluster", "stop")


def _ipp_start(n: int, args: argparse.Namespace) -> tuple[float, Any, Any]:
    import ipyparallel as ipp
    from traitlets.config import Config

    from tnt_notebook.cluster.launchers import default_mpiexec
    from tnt_notebook.cluster.plan import LaunchPlan

    config = Config()  # the same launcher as ours, whatever is on PATH
    config.MPILauncher.mpi_cmd = [default_mpiexec()]
    options: dict[str, Any] = {}
    if args.hostfile is not None:  # the same hosts, address and ssh as ours
        plan = LaunchPlan(hostfile=args.hostfile, n_per_node=args.n_per_node, ssh=args.ssh)
        address = plan.listen_address
        mpi_args = ["-f", args.hostfile, "-ppn", str(args.n_per_node), "-localhost", address]
        if args.ssh:
            mpi_args += ["-launcher", "ssh", "-launcher-exec", args.ssh]
        config.MPIEngineSetLauncher.mpi_args = mpi_args
        options["controller_ip"] = address
    t = time.perf_counter()
    cluster = ipp.Cluster(n=n, engines="mpi", log_level=40, config=config, **options)
    client = cluster.start_and_connect_sync()
    client.wait_for_engines(n, timeout=120)
    return time.perf_counter() - t, cluster, client


def _ipp_stop(cluster: Any, client: Any) -> None:
    with contextlib.suppress(Exception):
        client.close()
    cluster.stop_cluster_sync()


def _hosts(hostfile: str) -> int:
    from tnt_notebook.cluster.hostfile import read_hostfile

    return len(read_hostfile(hostfile))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure both sides; returns the result dict written as JSON."""
    ip = _shell()
    n = args.n if args.hostfile is None else _hosts(args.hostfile) * args.n_per_node
    where = _where(args)
    tnt_starts: list[float] = []
    ipp_starts: list[float] = []
    tnt_cells: list[float] = []
    px_cells: list[float] = []
    for i in range(args.starts):
        tnt_starts.append(_tnt_start(ip, where))
        if i == 0:
            with _quiet():
                tnt_cells = _time_cells(
                    lambda: ip.run_cell_magic("tnt", "", "pass"), args.cells, args.warmup
                )
        _tnt_stop(ip)
        seconds, cluster, client = _ipp_start(n, args)
        ipp_starts.append(seconds)
        try:
            if i == 0:
                view = client[:]
                view.block = True  # %%px waits for the result, as %%tnt does
                view.activate()  # registers %%px on this shell
                with _quiet():
                    px_cells = _time_cells(
                        lambda: ip.run_cell_magic("px", "", "pass"), args.cells, args.warmup
                    )
        finally:
            _ipp_stop(cluster, client)
    ip.run_line_magic("unload_ext", "tnt_notebook")

    def med(xs: list[float]) -> float:
        return statistics.median(xs)

    return {
        "benchmark": "cluster",
        "ranks": n,
        "hosts": "this machine" if args.hostfile is None else f"{_hosts(args.hostfile)} hosts",
        "placement": where,
        "machine": {
            "platform": platform.platform(),
            "python": sys.version.split()[0],
            "cpus": os.cpu_count(),
        },
        "peer": "ipyparallel.Cluster(n, engines='mpi').start_and_connect_sync() and %%px",
        "startup_s": {
            "tnt": tnt_starts,
            "ipyparallel": ipp_starts,
            "tnt_median": med(tnt_starts),
            "ipyparallel_median": med(ipp_starts),
            "ratio": med(tnt_starts) / med(ipp_starts),
        },
        "empty_cell_ms": {
            "cells": args.cells,
            "warmup": args.warmup,
            "tnt_median": med(tnt_cells) * 1e3,
            "px_median": med(px_cells) * 1e3,
            "tnt_p90": statistics.quantiles(tnt_cells, n=10)[-1] * 1e3
            if len(tnt_cells) > 1
            else None,
            "px_p90": statistics.quantiles(px_cells, n=10)[-1] * 1e3 if len(px_cells) > 1 else None,
            "ratio": med(tnt_cells) / med(px_cells),
        },
        "targets": {"startup_ratio_max": 1.0, "empty_cell_ms_max": 20.0},
    }


def table(res: dict[str, Any]) -> str:
    s, c = res["startup_s"], res["empty_cell_ms"]
    rows = [
        ("", "tnt_notebook", "ipyparallel", "ratio"),
        (
            f"start-up, {res['ranks']} ranks on {res['hosts']} (s, median of {len(s['tnt'])})",
            f"{s['tnt_median']:.2f}",
            f"{s['ipyparallel_median']:.2f}",
            f"{s['ratio']:.2f}",
        ),
        (
            f"empty cell round trip (ms, median of {c['cells']})",
            f"{c['tnt_median']:.2f}",
            f"{c['px_median']:.2f}",
            f"{c['ratio']:.2f}",
        ),
    ]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    res = run(args)
    print(table(res))
    print("(ratio = tnt_notebook / ipyparallel; below 1 is faster; %%tnt vs %%px for cells)")
    write_report(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())

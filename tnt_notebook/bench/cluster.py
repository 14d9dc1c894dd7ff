"""``python -m tnt_notebook.bench cluster``: start-up and empty-cell round trip, beside ipyparallel.

In one process, through the real magics of an in-process IPython shell:

* start-up: ``%tnt_cluster -n N`` until every rank answered, against
  ``ipyparallel.Cluster(n=N, engines="mpi").start_and_connect_sync()`` plus waiting for N engines
  (median of ``--starts`` alternating runs; stops are not timed);
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
    ap.add_argument("-n", type=int, default=2, help="ranks / engines (default 2)")
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


def _tnt_start(ip: Any, n: int) -> float:
    with _quiet():
        t = time.perf_counter()
        ip.run_line_magic("tnt_cluster", f"-n {n} --timeout 180")
        return time.perf_counter() - t


def _tnt_stop(ip: Any) -> None:
    with _quiet():
        ip.run_line_magic("tnt_cluster", "stop")


def _ipp_start(n: int) -> tuple[float, Any, Any]:
    import ipyparallel as ipp
    from traitlets.config import Config

    from tnt_notebook.launch import default_mpiexec

    config = Config()  # the same launcher as ours, whatever is on PATH
    config.MPILauncher.mpi_cmd = [default_mpiexec()]
    t = time.perf_counter()
    cluster = ipp.Cluster(n=n, engines="mpi", log_level=40, config=config)
    client = cluster.start_and_connect_sync()
    client.wait_for_engines(n, timeout=120)
    return time.perf_counter() - t, cluster, client


def _ipp_stop(cluster: Any, client: Any) -> None:
    with contextlib.suppress(Exception):
        client.close()
    cluster.stop_cluster_sync()


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Measure both sides; returns the result dict written as JSON."""
    ip = _shell()
    n = args.n
    tnt_starts: list[float] = []
    ipp_starts: list[float] = []
    tnt_cells: list[float] = []
    px_cells: list[float] = []
    for i in range(args.starts):
        tnt_starts.append(_tnt_start(ip, n))
        if i == 0:
            with _quiet():
                tnt_cells = _time_cells(
                    lambda: ip.run_cell_magic("tnt", "", "pass"), args.cells, args.warmup
                )
        _tnt_stop(ip)
        seconds, cluster, client = _ipp_start(n)
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
            f"start-up, {res['ranks']} ranks (s, median of {len(s['tnt'])})",
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

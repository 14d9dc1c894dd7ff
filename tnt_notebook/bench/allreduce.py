"""``python -m tnt_notebook.bench allreduce``: our engine against MPI_Allreduce on the same buffers.

Started as a plain process it re-launches itself under the virtual environment's ``mpiexec``
(``--np`` ranks, default 2). Every iteration starts after an MPI barrier; its time is the slowest
rank's, and the table reports the median over iterations. Sizes below ``--fresh-from`` reuse one
buffer pair (hot caches); larger sizes rotate over a pool of buffers bigger than the last-level
cache (fresh buffers), so that caches do not flatter either engine: the two engines use different
pairs of the pool (the second one to run would otherwise find the first one's data in cache; over
the run both use every pair). The engines take turns in blocks of ``--block`` consecutive calls,
and which one starts a turn alternates: both are timed as a program calls them, one call after
another, and both see the same phases of a noisy host. (Turns of single calls slow our large
calls by 15-20 %: an MPI_Allreduce of 16 MB leaves something behind that slows the next call of
ours, which a copy, a sum or a sleep of the same length does not.) The
arrays (``comm.Allreduce(src, dst)`` and ``allreduce(src, out=dst)``) are views of two arenas
allocated and touched once, so every size runs on the same kind of memory (which pages back a
fresh allocation otherwise depends on what earlier sizes freed). ``--memory`` chooses the arenas:
ordinary numpy arrays, shared arrays (``tnt.empty``: our engine reads and writes them in place,
without staging copies; MPI gets the same arrays), or both, each size measured on both in turn.
busbw = algbw * 2(p-1)/p with algbw = bytes / time, GB = 1e9 bytes.

Across hosts (``--hostfile F --n-per-node K``: ``mpiexec -f F -ppn K``, Hydra's launcher as the
environment sets it, e.g. ``HYDRA_LAUNCHER_EXEC``) each row also gives the link's bound for N
hosts, ``2(N-1)/N * S / B``: the least time any allreduce of S bytes needs when each host sends
and receives that much over a link of B bytes/s per direction. B is ``--link-gbps`` or, without
it, measured first: 16 MiB between rank 0 and the first rank of the next host, both ways at once,
in one MPI_Sendrecv and in messages of 60 KiB (the best of 5 of each). ``ours`` is the product as
it runs (``--path auto``: each size takes the engine's own path or MPI_Allreduce, whichever it
measured faster; the row says which); ``--path engine`` or ``mpi`` forces one.

``--overlap-us T`` measures what a training step sees when a bucket's allreduce overlaps T
microseconds of computation: ours starts the call (the engine's two halves, which across hosts
may post it as fragments that travel meanwhile), computes, then finishes it; MPI runs
MPI_Iallreduce, computes, then MPI_Wait. Both are reported as the time beyond the T.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

from tnt_notebook import settings
from tnt_notebook.bench import add_transport_option, use_transport, write_report
from tnt_notebook.cluster.launchers import default_mpiexec
from tnt_notebook.cluster.processes import die_with_parent

DEFAULT_SIZES = [4**k * 1024 for k in range(1, 10)][:8]  # 4 KiB .. 64 MiB, powers of 4
CHILD_ENV = "TNT_BENCH_ALLREDUCE_CHILD"
MEMORY = ("numpy", "shared")


def parse_size(text: str) -> int:
    units = {"k": 1024, "m": 1024**2, "g": 1024**3}
    text = text.strip().lower().removesuffix("b").removesuffix("i")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tnt_notebook.bench allreduce", description=__doc__)
    ap.add_argument("--np", type=int, default=2, help="ranks to launch (default 2)")
    ap.add_argument("--hostfile", help="hosts to run on (one name per line): mpiexec -f")
    ap.add_argument("--n-per-node", default="1", help="ranks per host with --hostfile (default 1)")
    ap.add_argument(
        "--link-gbps",
        type=float,
        default=0.0,
        help="link rate per direction in Gbit/s for the bound across hosts (default: measured)",
    )
    ap.add_argument(
        "--path",
        choices=("auto", "engine", "mpi"),
        default="auto",
        help="our allreduce's path (TNT_ALLREDUCE_PATH; default auto)",
    )
    ap.add_argument(
        "--sizes",
        type=lambda s: [parse_size(x) for x in s.split(",") if x],
        default=DEFAULT_SIZES,
        help="comma-separated message sizes in bytes (4096, 64K, 16M; default 4K..64M)",
    )
    ap.add_argument("--iters", type=int, default=0, help="timed iterations (default: by size)")
    ap.add_argument("--warmup", type=int, default=0, help="warm-up iterations (default: by size)")
    ap.add_argument(
        "--fresh-from",
        type=parse_size,
        default=1024**2,
        help="sizes from here on rotate over fresh buffers (default 1M)",
    )
    ap.add_argument(
        "--pool",
        type=parse_size,
        default=192 * 1024**2,
        help="bytes of input buffers in the fresh-buffer pool (default 192M, > last-level cache)",
    )
    ap.add_argument(
        "--block",
        type=int,
        default=10,
        help="consecutive calls of one engine before the other's turn (default 10; 1 alternates "
        "every call)",
    )
    ap.add_argument(
        "--memory",
        type=lambda s: [x for x in s.split(",") if x],
        default=list(MEMORY),
        help="comma-separated kinds of arrays: numpy (ordinary arrays), shared (tnt.empty); "
        "default both",
    )
    ap.add_argument(
        "--overlap-us",
        type=float,
        default=0.0,
        help="computation between the start of each call and its end, in microseconds (ours: "
        "the engine's two halves around it; MPI: MPI_Iallreduce, then MPI_Wait); times are what "
        "is left beyond it (default 0: blocking calls)",
    )
    ap.add_argument("--json", default="bench-results/allreduce.json", help="JSON output path")
    add_transport_option(ap)
    args = ap.parse_args(argv)
    if args.block < 1:
        ap.error("--block must be at least 1")
    if not args.memory or set(args.memory) - set(MEMORY):
        ap.error(f"--memory takes {' and/or '.join(MEMORY)}")
    if args.link_gbps < 0:
        ap.error("--link-gbps must not be negative")
    if args.overlap_us < 0:
        ap.error("--overlap-us must not be negative")
    args.hosts = []
    if args.hostfile and not under_mpi():  # (the ranks need not see the launcher's hostfile)
        from tnt_notebook.cluster.errors import HostfileError
        from tnt_notebook.cluster.hostfile import read_hostfile, validate_n_per_node

        try:
            args.hosts = read_hostfile(args.hostfile)
            args.n_per_node = validate_n_per_node(args.n_per_node)
        except HostfileError as e:
            ap.error(str(e))
    return args


def under_mpi() -> bool:
    return any(k in os.environ for k in (CHILD_ENV, "PMI_RANK", "OMPI_COMM_WORLD_RANK"))


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    where = ["-n", str(args.np)]
    if args.hosts:
        n = len(args.hosts) * args.n_per_node
        where = ["-f", args.hostfile, "-ppn", str(args.n_per_node), "-n", str(n)]
    cmd = [default_mpiexec(), *where, sys.executable, "-m", "tnt_notebook.bench", "allreduce"]
    env = {**os.environ, CHILD_ENV: "1", settings.ALLREDUCE_PATH.name: args.path}
    # (the world ends with this process, even if it is killed: no benchmark left running)
    return subprocess.call([*cmd, *argv], env=env, preexec_fn=die_with_parent)


def default_iters(size: int) -> tuple[int, int]:
    """(warm-up, timed) iterations: enough for a stable median without taking minutes."""
    if size <= 256 * 1024:
        return 50, 400
    if size <= 4 * 1024**2:
        return 10, 60
    return 3, 20


def arena_bytes(args: argparse.Namespace) -> int:
    """Room for the largest pool of any size: an odd number (>= 3) of buffers covering ``pool``."""
    fresh = [s for s in args.sizes if s >= args.fresh_from]
    return max([args.pool + 2 * max(fresh), 3 * max(fresh)] if fresh else [max(args.sizes)])


def measure_size(
    comm: Any,
    size: int,
    args: argparse.Namespace,
    memory: str,
    arenas: tuple[np.ndarray, ...],
    over_mpi: Any = None,
) -> dict[str, Any]:
    """One table row: the engines on the same buffers, taking turns in blocks of calls (with
    ``over_mpi``, an engine whose step between nodes is MPI, a third one: see measure)."""
    from mpi4py import MPI

    from tnt_notebook.rank import api as ranks

    rank, p = comm.Get_rank(), comm.Get_size()
    count = max(1, size // 4)
    fresh = size >= args.fresh_from
    ways = 3 if over_mpi is not None else 2
    pool = max(3, -(-args.pool // size)) | 1 if fresh else 1  # odd: both use every pair
    if fresh and ways == 3 and pool % 3 == 0:
        pool += 2  # (and every one of three uses every pair)
    rng = np.random.default_rng(rank)
    srcs = [arenas[0][k * count : (k + 1) * count] for k in range(pool)]
    dsts = [arenas[1][k * count : (k + 1) * count] for k in range(pool)]
    for src in srcs:
        src[:] = rng.standard_normal(count, dtype=np.float32)
    warm, iters = default_iters(size)
    warm, iters = args.warmup or warm, args.iters or iters

    # Call k of ours uses buffer pair 2k, call k of MPI pair 2k+1 (with fresh buffers neither
    # finds the other's data in cache; over an odd pool both use every pair; with a third engine
    # 3k, 3k+1 and 3k+2).
    codes = (ranks.native_core().DTYPES["float32"], ranks.native_core().OPS["sum"])
    engine = ranks.current_engine()
    compute = args.overlap_us / 1e6

    def ours(k: int) -> None:
        src, dst = srcs[ways * k % pool], dsts[ways * k % pool]
        if not compute:
            ranks.allreduce(src, out=dst)
            return
        ticket = engine.start_allreduce([src], *codes)
        busy(compute)
        engine.finish_allreduce(ticket, [src], [dst], codes[0])

    def theirs(k: int) -> None:
        src, dst = srcs[(ways * k + 1) % pool], dsts[(ways * k + 1) % pool]
        if not compute:
            comm.Allreduce(src, dst, op=MPI.SUM)
            return
        request = comm.Iallreduce(src, dst, op=MPI.SUM)
        busy(compute)
        request.Wait()

    def ours_over_mpi(k: int) -> None:  # (blocking: with --overlap-us, the computation after it)
        over_mpi.allreduce1(srcs[(3 * k + 2) % pool], dsts[(3 * k + 2) % pool], *codes)
        busy(compute)

    # both engines must agree on the result of the same inputs
    ranks.allreduce(srcs[0], out=dsts[0])
    mine = dsts[0].copy()
    comm.Allreduce(srcs[0], dsts[0], op=MPI.SUM)
    verified = bool(np.allclose(mine, dsts[0], rtol=1e-5, atol=1e-5))
    times: dict[str, list[float]] = {"ours": [], "mpi": []}
    both: tuple[tuple[str, Any], ...] = (("ours", ours), ("mpi", theirs))
    if over_mpi is not None:
        over_mpi.allreduce1(srcs[0], dsts[0], *codes)
        verified = verified and bool(np.allclose(mine, dsts[0], rtol=1e-5, atol=1e-5))
        times["over_mpi"] = []
        both += (("over_mpi", ours_over_mpi),)
    waited = 0.0
    calls = warm + iters  # per engine
    for turn in range(-(-calls // args.block)):  # which engine starts a turn goes round
        for name, fn in both[turn % ways :] + both[: turn % ways]:
            for k in range(turn * args.block, min(calls, (turn + 1) * args.block)):
                comm.Barrier()
                w0 = engine.wait_seconds
                t0 = time.perf_counter()
                fn(k)
                if k >= warm:
                    times[name].append(time.perf_counter() - t0 - compute)
                    waited += engine.wait_seconds - w0 if name == "ours" else 0.0
    row: dict[str, Any] = {
        "size_bytes": count * 4,
        "buffers": "fresh" if fresh else "hot",
        "memory": memory,
        "pool": pool,
        "iters": iters,
        "verified": verified,
    }
    for name, t in times.items():
        slowest = np.empty(len(t))
        comm.Allreduce(np.asarray(t), slowest, op=MPI.MAX)  # per iteration, the slowest rank
        median = max(float(np.median(slowest)), 1e-7)  # (what overlap hid entirely: 0.1 us)
        algbw = count * 4 / median / 1e9
        row[name] = {
            "calls": len(t),
            "latency_us": median * 1e6,
            "algbw_GBps": algbw,
            "busbw_GBps": algbw * 2 * (p - 1) / p,
        }
    row["ratio"] = row["ours"]["busbw_GBps"] / row["mpi"]["busbw_GBps"]
    if over_mpi is not None:
        row["ratio_vs_over_mpi"] = row["ours"]["busbw_GBps"] / row["over_mpi"]["busbw_GBps"]
    sites = [s for s in engine.path_sites if s["count"] == count and s["bucket"] == -1]
    row["ours"]["path"] = sites[0]["path"] if sites else args.path
    if compute:  # (each call of ours is a batch of the engine's halves of its own)
        sites = [s for s in engine.posting_sites if s["count"] == count]
        forced = args.path == "mpi" and engine.overlaps_exchanges
        forced = forced and count * 4 <= engine.one_message_bytes  # (a set policy keeps no sites)
        row["ours"]["path"] = sites[0]["path"] if sites else "posted" if forced else "whole"
    # time our ranks spent waiting for each other: high on a busy machine (descheduled peers)
    row["ours"]["wait_fraction"] = waited / max(sum(times["ours"]), 1e-12)
    return row


def busy(seconds: float) -> None:
    """Computes (spins) for ``seconds``, as a training step's backprop would between the two."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def new_arena(memory: str, count: int) -> np.ndarray:
    """``count`` float32 of ordinary or shared memory, touched (no page faults later)."""
    from tnt_notebook.rank import api as ranks

    arena = ranks.empty(count, np.float32) if memory == "shared" else np.empty(count, np.float32)
    arena[:] = 1
    return arena


def measure(args: argparse.Namespace) -> dict[str, Any]:
    from mpi4py import MPI

    from tnt_notebook.rank import api as ranks

    comm = MPI.COMM_WORLD
    p = comm.Get_size()
    info = ranks.engine_info()
    warm_a, warm_b = np.ones(1024, np.float32), np.ones(1024, np.float32)
    for _ in range(2000):  # wake both engines and the cores before the first size
        ranks.allreduce(warm_a, out=warm_b)
        comm.Allreduce(warm_a, warm_b, op=MPI.SUM)
    nodes = info["num_nodes"]
    link = args.link_gbps * 1e9 / 8 if args.link_gbps else 0.0
    if nodes > 1 and not link:
        link = link_rate(comm, info["local_size"])
    count = arena_bytes(args) // 4 + 1
    arenas = {kind: (new_arena(kind, count), new_arena(kind, count)) for kind in args.memory}
    # Over another transport, the engine's path with MPI between the nodes takes turns too.
    over_mpi = None
    if nodes > 1 and info["transport"] != "mpi":
        over_mpi = ranks.new_engine(transport="mpi", path="engine")
        over_mpi.start()
    rows = [
        measure_size(comm, size, args, kind, arenas[kind], over_mpi)
        for size in args.sizes
        for kind in args.memory
    ]
    if over_mpi is not None:
        over_mpi.close()
    for row in rows:  # against MPI on whichever kind of array suits it best at that size
        best = max(r["mpi"]["busbw_GBps"] for r in rows if r["size_bytes"] == row["size_bytes"])
        row["ratio_vs_best_mpi"] = row["ours"]["busbw_GBps"] / best
        if nodes > 1:
            bound = 2 * (nodes - 1) / nodes * row["size_bytes"] / link
            row["link_bound_us"] = bound * 1e6
            row["ours"]["of_link_bound"] = bound / (row["ours"]["latency_us"] / 1e6)
    return {
        "benchmark": "allreduce",
        "ranks": p,
        "nodes": info["num_nodes"],
        "transport": info["transport"],
        "dtype": "float32",
        "op": "sum",
        "peer": "mpi4py comm.Allreduce (MPI_Allreduce) on the same MPI",
        "over_mpi": (
            "the engine's path with MPI between the nodes (TNT_TRANSPORT=mpi, "
            "TNT_ALLREDUCE_PATH=engine), a second engine taking turns on the same buffers"
            if over_mpi is not None
            else None
        ),
        "mpi_library": MPI.Get_library_version().splitlines()[0].strip(),
        "time": (
            "median over calls of the slowest rank's time; barrier before each; "
            f"the engines take turns of {args.block} calls"
        ),
        "overlap_us": args.overlap_us,
        "fresh_from_bytes": args.fresh_from,
        "block": args.block,
        "path": args.path,
        "link_GBps": link / 1e9 if nodes > 1 else None,
        "link_rate": ("given" if args.link_gbps else "measured") if nodes > 1 else None,
        "rows": rows,
    }


def link_rate(comm: Any, first_elsewhere: int) -> float:
    """Bytes/s per direction between rank 0 and ``first_elsewhere`` (the first rank of the next
    host): 16 MiB both ways at once, as one MPI_Sendrecv and as messages of 60 KiB all in flight
    (over TCP MPI moves those faster than one large message), the best of 5 of each; the others
    wait."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    peer = {0: first_elsewhere, first_elsewhere: 0}.get(rank)
    n, piece = 16 << 20, 60 << 10
    send, recv = np.ones(n, np.uint8), np.empty(n, np.uint8)

    def in_pieces() -> None:
        reqs = [comm.Irecv(recv[i : i + piece], peer, 1) for i in range(0, n, piece)]
        reqs += [comm.Isend(send[i : i + piece], peer, 1) for i in range(0, n, piece)]
        MPI.Request.Waitall(reqs)

    best = float("inf")
    for _ in range(6):
        for move in (lambda: comm.Sendrecv(send, peer, 0, recv, peer, 0), in_pieces):
            comm.Barrier()
            t0 = time.perf_counter()
            if peer is not None:
                move()
                best = min(best, time.perf_counter() - t0)
    rate = np.array([n / best if peer is not None else 0.0])
    comm.Allreduce(np.array(rate), rate, op=MPI.MAX)
    return float(rate[0])


def human(size: int) -> str:
    for unit, scale in (("M", 1024**2), ("K", 1024)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}B"
    return f"{size} B"


def table(result: dict[str, Any]) -> str:
    head = (
        f"allreduce float32 sum, {result['ranks']} ranks on {result['nodes']} node(s) "
        f"({result['transport']} between nodes); "
        f"peer: {result['peer']} ({result['mpi_library']})\n"
        f"busbw = algbw * 2(p-1)/p, GB = 1e9 B; {result['time']}\n"
        "ratio: against MPI on the same arrays; vs best MPI: against MPI's faster kind of array\n"
        "ours waiting: share of our time spent waiting for the other ranks (high when the machine\n"
        "is busy and ranks get descheduled: then the figures say little)\n"
        f"ours: TNT_ALLREDUCE_PATH={result['path']}; path: the one ours took at that size\n"
    )
    if result["overlap_us"]:
        head += (
            f"with {result['overlap_us']:g} us of computation inside each call (ours: the "
            "engine's start and finish around it, path posted or whole; MPI: MPI_Iallreduce, "
            "then MPI_Wait): latencies are the time beyond it\n"
        )
    across = result["link_GBps"] is not None
    if across:
        head += (
            f"link bound: 2(N-1)/N * S / B for N = {result['nodes']} hosts, B = "
            f"{result['link_GBps']:.3f} GB/s per direction ({result['link_rate']}); "
            "of bound: bound / ours\n"
        )
    third = result.get("over_mpi") is not None
    if third:
        head += f"over MPI: {result['over_mpi']}; vs over MPI: its time / ours\n"
    cols = (
        "size",
        "buffers",
        "memory",
        "ours lat us",
        "ours busbw GB/s",
        "MPI lat us",
        "MPI busbw GB/s",
    )
    extra = (" | over MPI lat us | vs over MPI" if third else "") + (
        " | link bound us | of bound" if across else ""
    )
    lines = [" | ".join(cols) + " | ratio | vs best MPI | ours waiting | path" + extra]
    for r in result["rows"]:
        bound = (
            f" | {r['over_mpi']['latency_us']:15.1f} | {r['ratio_vs_over_mpi']:11.2f}x"
            if third
            else ""
        ) + (f" | {r['link_bound_us']:13.1f} | {r['ours']['of_link_bound']:8.0%}" if across else "")
        lines.append(
            f"{human(r['size_bytes']):>6} | {r['buffers']:>7} | {r['memory']:>6} | "
            f"{r['ours']['latency_us']:11.1f} | {r['ours']['busbw_GBps']:15.2f} | "
            f"{r['mpi']['latency_us']:10.1f} | {r['mpi']['busbw_GBps']:14.2f} | "
            f"{r['ratio']:4.2f}x | {r['ratio_vs_best_mpi']:10.2f}x | "
            f"{r['ours']['wait_fraction']:11.0%} | {r['ours']['path']:>6}"
            + bound
            + ("" if r["verified"] else "  (results differ!)")
        )
    return head + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    use_transport(args)
    if not under_mpi():
        return launch(args, argv)
    result = measure(args)
    from tnt_notebook.rank import api as ranks

    if ranks.get_rank() == 0:
        print(table(result), flush=True)
        write_report(args.json, result)
    return 0 if all(r["verified"] for r in result["rows"]) else 1

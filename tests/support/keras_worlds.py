"""Runs a worker module of tests/keras on an mpiexec world; each rank writes rank<r>.json."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.support.mpiworld import run_mpi

# One TensorFlow thread of each kind per rank: ranks share the machine's cores.
# Every fit compares the ranks' trainable weights at each epoch end (and all weights at its end).
ENV = {
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "TF_CPP_MIN_LOG_LEVEL": "3",
    "TNT_CHECK_REPLICAS": "epoch",
}


def run_worker(
    ranks: int,
    worker: str,
    out: Path,
    timeout: float = 300,
    env: dict | None = None,
    mpi_args: tuple[str, ...] = (),
) -> tuple[list[dict], subprocess.CompletedProcess]:
    """`worker.main(out)` on every rank (a failing rank aborts the world); per-rank results.
    ``env`` adds to the ranks' environment; ``mpi_args`` go between mpiexec's and Python's."""
    code = f"""
        from tests.keras import {worker}
        from tests.keras.worker_util import run_or_abort
        run_or_abort({worker}.main, {str(out)!r})
    """
    proc = run_mpi(ranks, code, timeout=timeout, env={**ENV, **(env or {})}, mpi_args=mpi_args)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)], proc

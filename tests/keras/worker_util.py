"""Shared by the mpiexec worker scripts: a rank that fails aborts the whole world (no deadlock)."""

from __future__ import annotations

import sys
import traceback


def run_or_abort(main, *args) -> None:
    try:
        main(*args)
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        from mpi4py import MPI

        MPI.COMM_WORLD.Abort(1)

"""The rank API: who am I, how many are we, and collectives over numpy arrays.

INTERIM: backed by mpi4py until the native engine lands (issue 2); the signatures are final.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import numpy as np

MASTER_RANK = 0
OPS = ("sum", "average", "min", "max")


@functools.cache
def _comm():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def get_rank() -> int:
    return _comm().Get_rank()


def get_size() -> int:
    return _comm().Get_size()


def get_master_rank() -> int:
    return MASTER_RANK


def is_master_rank() -> bool:
    return get_rank() == MASTER_RANK


def barrier() -> None:
    _comm().Barrier()


def broadcast(value: Any, root: int = MASTER_RANK) -> Any:
    return _comm().bcast(value, root=root)


def allreduce(array: Any, op: str = "sum") -> np.ndarray:
    from mpi4py import MPI

    a = np.ascontiguousarray(array)
    out = np.empty_like(a)
    mpi_op = {"sum": MPI.SUM, "average": MPI.SUM, "min": MPI.MIN, "max": MPI.MAX}[op]
    _comm().Allreduce(a, out, op=mpi_op)
    if op == "average":
        out = (out / get_size()).astype(a.dtype)
    return out


class FusedAllreduce:
    """Reduces a fixed list of tensors in fusion buckets, in the same plan order on every rank."""

    def __init__(
        self, specs: Sequence[tuple[tuple[int, ...], Any]], threshold_bytes: int | None = None
    ):
        self.specs = [(tuple(shape), np.dtype(dtype)) for shape, dtype in specs]
        self.buckets = [[i] for i in range(len(self.specs))]

    def reduce_bucket(self, index: int, arrays: Sequence[np.ndarray], op: str = "sum"):
        return [allreduce(a, op) for a in arrays]

    def allreduce(self, arrays: Sequence[np.ndarray], op: str = "sum") -> list[np.ndarray]:
        out: list[np.ndarray] = [None] * len(arrays)  # type: ignore[list-item]
        for k, bucket in enumerate(self.buckets):
            for i, r in zip(bucket, self.reduce_bucket(k, [arrays[i] for i in bucket], op)):
                out[i] = r
        return out

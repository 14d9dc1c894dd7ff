"""Sums over the ranks whose bits do not depend on the number of ranks: the building block of the
reproducible mode.

Floating-point addition is not associative, so a plain allreduce gives results whose last bits
depend on how the values were split over the ranks, the order of the ranks, the hosts, the path
each call takes and the transport. Here every value becomes a 64-bit integer on a grid that
depends only on the largest magnitude of its group over all contributions of all ranks (agreed by
one max-allreduce, which is exact), the integers add exactly (one int64 allreduce: any order, any
grouping gives the same sum), and the sum returns as floating point: the same bits for any
number of ranks, for any split of the contributions over them (in the manner of ReproBLAS's
pre-rounding, Demmel and Nguyen).

A group keeps ``GRID_BITS`` bits below its largest magnitude (float32 has 24): values smaller
than ``2**-GRID_BITS`` of that largest one do not count. At most ``MAX_CONTRIBUTIONS``
contributions, over all ranks, go into one sum. A non-finite value makes its group's sum NaN.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from tnt_notebook.rank import api as ranks

GRID_BITS = 42
# So that |sum| < 2**(GRID_BITS + 20) <= 2**62: no int64 overflow, whatever the order.
MAX_CONTRIBUTIONS = 1 << 20


def exact_sum(groups: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The sum over every rank's contributions to each group, the same bits for any number of
    ranks and any split of the contributions over them. A group is this rank's contributions
    stacked on a leading axis (a leading 0: none), of one floating-point dtype and the same shape
    on every rank; its sum has the shape without that axis. A collective: every rank calls it
    with the same groups."""
    groups = [np.asarray(g) for g in groups]
    for g in groups:
        if g.ndim < 1 or not np.issubdtype(g.dtype, np.floating):
            raise TypeError(
                "each group is a floating-point array of contributions stacked on a leading "
                f"axis, got {g.dtype} of shape {g.shape}"
            )
    largest = ranks.allreduce(np.array([_largest_magnitude(g) for g in groups], np.float64), "max")
    exponents = [int(np.frexp(m)[1]) if np.isfinite(m) else None for m in largest]
    count = max((g.shape[0] for g in groups), default=0)
    on_grid = [_on_grid(g, e).ravel() for g, e in zip(groups, exponents, strict=True)]
    summed = ranks.allreduce(np.concatenate([*on_grid, np.array([count], np.int64)]), "sum")
    if summed[-1] > MAX_CONTRIBUTIONS:
        raise ValueError(
            f"an exact sum takes at most {MAX_CONTRIBUTIONS} contributions, got {summed[-1]}"
        )
    out, offset = [], 0
    for g, e in zip(groups, exponents, strict=True):
        size = int(np.prod(g.shape[1:], dtype=np.int64))
        part = summed[offset : offset + size].astype(np.float64)
        value = np.full(size, np.nan) if e is None else np.ldexp(part, e - GRID_BITS)
        out.append(value.astype(g.dtype).reshape(g.shape[1:]))
        offset += size
    return out


def _largest_magnitude(group: np.ndarray) -> float:
    """The group's largest magnitude; infinity where it holds a non-finite value (NaN would
    make the max over the ranks depend on their order)."""
    if group.size == 0:
        return 0.0
    largest = float(np.max(np.abs(group)))
    return largest if np.isfinite(largest) else np.inf


def _on_grid(group: np.ndarray, exponent: int | None) -> np.ndarray:
    """This rank's contributions summed as integers in units of ``2**(exponent - GRID_BITS)``
    (scaling by a power of two is exact; each contribution is rounded to the grid on its own, so
    the integers do not depend on which rank holds it). None: a non-finite group, whose sum is
    NaN whatever the integers."""
    if exponent is None or group.size == 0:
        return np.zeros(group.shape[1:], np.int64)
    scaled = np.ldexp(group.astype(np.float64), GRID_BITS - exponent)
    return np.rint(scaled).astype(np.int64).sum(axis=0, dtype=np.int64)

"""The exact sum over the ranks (tnt_notebook/rank/exact_sum.py): the same bits for 1 to 4 ranks,
for any split of the contributions, over the engine's own path and over MPI_Allreduce; and the
plain allreduce of the same data, whose bits do depend on the split (so the data can tell)."""

from __future__ import annotations

import json

import pytest

from tests.support.mpiworld import run_mpi, run_plain

pytestmark = pytest.mark.mpi

# 12 contributions of 3 groups, magnitudes from 1e-6 to 1e6 with both signs, rank r holding the
# contiguous share [r*12//p, (r+1)*12//p) of them (rank 0 all of them in a 1-rank world).
CODE = """
import hashlib, json
import numpy as np
import tnt_notebook as tnt
from tnt_notebook.rank.exact_sum import exact_sum

rng = np.random.default_rng(7)
scales = np.float32(10.0) ** rng.integers(-6, 7, size=(12, 1)).astype(np.float32)
groups = [
    (rng.standard_normal((12, 1000)) * scales).astype(np.float32),
    rng.standard_normal((12, 3, 5)).astype(np.float32),
    (rng.standard_normal((12, 7)) * scales).astype(np.float64),
]
r, p = tnt.get_rank(), tnt.get_size()
mine = [g[r * 12 // p : (r + 1) * 12 // p] for g in groups]
exact = exact_sum(mine)
plain = [tnt.allreduce(m.sum(axis=0, dtype=m.dtype)) for m in mine]
digest = lambda arrays: hashlib.sha256(b"".join(a.tobytes() for a in arrays)).hexdigest()
print("RESULT", json.dumps({"rank": r, "exact": digest(exact), "plain": digest(plain)}), flush=True)
"""


def results(n: int, path: str) -> list[dict]:
    env = {"TNT_COLLECTIVE_TIMEOUT": "20", "TNT_ALLREDUCE_PATH": path}
    out = run_mpi(n, CODE, env=env).stdout
    found = [json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line[:6] == "RESULT"]
    assert sorted(f["rank"] for f in found) == list(range(n)), out
    return found


def test_exact_sums_have_the_same_bits_for_any_number_of_ranks_and_either_path():
    worlds = {(n, path): results(n, path) for n in (1, 2, 3, 4) for path in ("engine", "mpi")}
    exact = {f["exact"] for found in worlds.values() for f in found}
    assert len(exact) == 1, worlds
    # the data is one whose plain sums differ with the split: the test could tell
    plain = {found[0]["plain"] for found in worlds.values()}
    assert len(plain) > 1, worlds


def test_an_exact_sum_is_the_sum_of_each_contribution_rounded_to_the_grid():
    """Against the serial reference (a 1-rank world): each value on the grid of its group's
    largest magnitude, summed as integers, scaled back; non-finite groups NaN, others intact;
    what is not stacked floating-point contributions a clear error."""
    result = run_plain(
        """
        import numpy as np
        from tnt_notebook.rank.exact_sum import GRID_BITS, exact_sum

        rng = np.random.default_rng(3)
        scales = [[1e-3], [1e3], [1.0], [7.0], [1e-8]]
        group = (rng.standard_normal((5, 4)) * scales).astype(np.float32)
        exponent = int(np.frexp(np.max(np.abs(group)))[1])
        grid = np.rint(np.ldexp(group.astype(np.float64), GRID_BITS - exponent)).astype(np.int64)
        expected = np.ldexp(grid.sum(axis=0).astype(np.float64), exponent - GRID_BITS)
        (got,) = exact_sum([group])
        assert got.dtype == np.float32
        assert got.tobytes() == expected.astype(np.float32).tobytes()
        assert np.allclose(got, group.astype(np.float64).sum(axis=0), rtol=1e-6, atol=0)

        bad = np.array([[1.0, np.inf], [2.0, 3.0]], np.float32)
        good = np.array([[1.5], [2.5]], np.float32)
        summed_bad, summed_good = exact_sum([bad, good])
        assert np.isnan(summed_bad).all() and summed_good.tolist() == [4.0]

        for wrong in (np.arange(4), np.float32(1.0)):
            try:
                exact_sum([wrong])
            except TypeError as e:
                assert "floating-point array of contributions" in str(e)
            else:
                raise AssertionError(f"{wrong!r} was accepted")
        print("SERIAL OK")
        """
    )
    assert result.returncode == 0 and "SERIAL OK" in result.stdout, result.stderr

"""Checks that run inside every rank of a real mpiexec world (imported by the test snippets).

Every rank builds every rank's input from per-rank seeds, so each rank can compute the expected
result with numpy on its own and compare.
"""

from __future__ import annotations

import os
import zlib

import numpy as np

import tnt_notebook as tnt
from tnt_notebook.rank import api as ranks

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64"]
OPS = ["sum", "average", "min", "max"]


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def rank_input(rank: int, name: str, shape: tuple[int, ...], salt: str = "") -> np.ndarray:
    """Fresh random data for `rank` (never all zeros), reproducible on every rank."""
    rng = np.random.default_rng(zlib.crc32(f"{rank}/{name}/{shape}/{salt}".encode()))
    dtype = np_dtype(name)
    n = int(np.prod(shape, dtype=np.int64))
    if dtype.kind == "i":
        data = rng.integers(-1000, 1000, n)
    else:
        data = rng.standard_normal(n) * 10
    return data.astype(dtype).reshape(shape)


def expected(op: str, inputs: list[np.ndarray]) -> np.ndarray:
    dtype = inputs[0].dtype
    wide = np.stack([a.astype(np.float64) for a in inputs])
    if op == "sum":
        return wide.sum(axis=0).astype(dtype)
    if op == "average":
        total = wide.sum(axis=0)
        if dtype.kind == "i":
            return (np.sign(total) * (np.abs(total) // len(inputs))).astype(dtype)
        return (total / len(inputs)).astype(dtype)
    return (wide.min(axis=0) if op == "min" else wide.max(axis=0)).astype(dtype)


def assert_close(got: np.ndarray, want: np.ndarray, what: str, nodes: int = 1) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, got.dtype)
    if want.dtype.kind == "i":
        np.testing.assert_array_equal(got, want, err_msg=what)
        return
    # halves round once per node: allow a couple of ulps
    tol = {2: 4e-3 * nodes if want.dtype.name == "float16" else 2e-2 * nodes, 4: 2e-6, 8: 1e-13}[
        want.dtype.itemsize
    ]
    np.testing.assert_allclose(
        got.astype(np.float64), want.astype(np.float64), rtol=tol, atol=tol * 10, err_msg=what
    )


def digest(arrays: list[np.ndarray]) -> int:
    h = 0
    for a in arrays:
        h = zlib.crc32(np.ascontiguousarray(a).view(np.uint8).tobytes(), h)
    return h


def say(*words: object) -> None:
    """One line on stdout in a single write, so that ranks' lines never interleave."""
    os.write(1, (" ".join(str(w) for w in words) + "\n").encode())


def rebuild_with(**env: str) -> None:
    """Change engine settings (read when the engine is built) and rebuild it."""
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    ranks.shutdown()


def check_identical_everywhere(results: list[np.ndarray]) -> None:
    """Every rank must hold bitwise the same results."""
    h = np.array([digest(results)], np.int64)
    lo, hi = tnt.allreduce(h, "min"), tnt.allreduce(h, "max")
    assert lo[0] == hi[0], "ranks hold different results"


def matrix(sizes: list, names: list[str] = DTYPES, ops: list[str] = OPS, salt: str = "") -> int:
    """allreduce of every op x dtype x size against numpy; returns the number of checks."""
    r, p = tnt.get_rank(), tnt.get_size()
    nodes = ranks.engine_info()["num_nodes"]
    results, checks = [], 0
    for name in names:
        for op in ops:
            for size in sizes:
                shape = size if isinstance(size, tuple) else (size,)
                inputs = [rank_input(q, name, shape, salt + op) for q in range(p)]
                got = tnt.allreduce(inputs[r], op)
                assert_close(got, expected(op, inputs), f"{name} {op} {shape}", nodes)
                results.append(got)
                checks += 1
    check_identical_everywhere(results)
    return checks


def fused(threshold: int | None, count: int = 40, big: int = 3000) -> int:
    """FusedAllreduce over many tensors of mixed dtypes and sizes against numpy."""
    r, p = tnt.get_rank(), tnt.get_size()
    rng = np.random.default_rng(99)  # same specs on every rank
    specs = []
    for i in range(count):
        shape = tuple(int(d) for d in rng.integers(1, 9, rng.integers(1, 3)))
        if i % 7 == 3:
            shape = (big,)
        if i % 11 == 5:
            shape = (0,)
        name = "float64" if i % 13 == 12 else ("int32" if i % 17 == 16 else "float32")
        specs.append((shape, name))
    f = ranks.FusedAllreduce([(s, np_dtype(n)) for s, n in specs], threshold_bytes=threshold)
    assert sorted(i for b in f.buckets for i in b) == list(range(count))
    for b in f.buckets:
        assert len({specs[i][1] for i in b}) == 1, "a bucket mixes dtypes"
    if threshold == 0:
        assert len(f.buckets) == count
    nodes = ranks.engine_info()["num_nodes"]
    for op in ("sum", "average"):
        inputs = [
            [rank_input(q, n, s, f"fused{i}{op}") for i, (s, n) in enumerate(specs)]
            for q in range(p)
        ]
        got = f.allreduce(inputs[r], op)
        for i in range(count):
            want = expected(op, [inputs[q][i] for q in range(p)])
            assert_close(got[i], want, f"tensor {i} {op}", nodes)
        check_identical_everywhere(got)
    return len(f.buckets)


def expect_error(exc: type, fn, *args, match: str = "", **kwargs) -> str:
    try:
        fn(*args, **kwargs)
    except exc as e:
        assert match in str(e), f"{match!r} not in {e!r}"
        return str(e)
    raise AssertionError(f"{fn.__name__}{args} did not raise {exc.__name__}")


def _buffer(a: np.ndarray) -> np.ndarray:
    """A view that the buffer protocol takes (it has no float16 or bfloat16)."""
    return a.view(np.uint16) if a.dtype.itemsize == 2 and a.dtype.kind != "i" else a


def halves(sizes: list, names: list[str] = DTYPES, ops: list[str] = OPS, repeats: int = 1) -> int:
    """Every op x dtype x size through the engine's two halves against numpy, ``repeats`` times:
    each time every call starts (in order), then every call finishes (in order). Returns the
    number of checks."""
    native, e = ranks.native_core(), ranks.current_engine()
    r, p = tnt.get_rank(), tnt.get_size()
    calls = [(name, op, (size,)) for name in names for op in ops for size in sizes]
    inputs = [
        [rank_input(q, name, shape, "halves" + op) for q in range(p)] for name, op, shape in calls
    ]
    wanted = [expected(op, ins) for (_, op, _), ins in zip(calls, inputs, strict=True)]
    results = []
    for _ in range(repeats):
        tickets = [
            e.start_allreduce([_buffer(ins[r])], native.DTYPES[name], native.OPS[op], bucket=k)
            for k, ((name, op, _), ins) in enumerate(zip(calls, inputs, strict=True))
        ]
        for ticket, (name, op, shape), ins, want in zip(
            tickets, calls, inputs, wanted, strict=True
        ):
            got = np.full_like(ins[r], 7)
            e.finish_allreduce(ticket, [_buffer(ins[r])], [_buffer(got)], native.DTYPES[name])
            assert_close(got, want, f"{name} {op} {shape}", e.num_nodes)
            results.append(got)
    check_identical_everywhere(results)
    return len(results)

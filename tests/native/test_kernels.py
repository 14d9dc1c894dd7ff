"""The reduce kernels against numpy, including bit-exact float16 / bfloat16 rounding."""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from tnt_notebook import _native

DTYPES = ["float16", "bfloat16", "float32", "float64", "int32", "int64"]
NUMPY_OPS = {"sum": np.add, "min": np.minimum, "max": np.maximum}


def np_dtype(name: str) -> np.dtype:
    if name == "bfloat16":
        ml_dtypes = pytest.importorskip("ml_dtypes")
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def raw(a: np.ndarray) -> np.ndarray:
    """bfloat16 arrays have no buffer protocol: the core gets their 16-bit view."""
    return a.view(np.uint16) if a.dtype.name == "bfloat16" else a


def random_array(rng: np.random.Generator, dtype: np.dtype, n: int) -> np.ndarray:
    if dtype.kind == "i":
        return rng.integers(-1000, 1000, n).astype(dtype)
    return (rng.standard_normal(n) * 10).astype(dtype)


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("op", ["sum", "min", "max", "average"])
@pytest.mark.parametrize("nsrc", [1, 2, 4])
@pytest.mark.parametrize("n", [0, 1, 1023, 1025, 5000])
def test_reduce_matches_numpy(name: str, op: str, nsrc: int, n: int) -> None:
    dtype = np_dtype(name)
    rng = np.random.default_rng(zlib.crc32(f"{name}{op}{nsrc}{n}".encode()))
    srcs = [random_array(rng, dtype, n) for _ in range(nsrc)]
    out = np.full(n, 7, dtype)
    _native.reduce([raw(s) for s in srcs], raw(out), _native.DTYPES[name], _native.OPS[op], nsrc)
    assert_reduced(out, reference(srcs, op), op)


def reference(srcs: list[np.ndarray], op: str) -> np.ndarray:
    """What the kernel must compute, in float64 (integers: average truncates toward zero)."""
    dtype, wide = srcs[0].dtype, [s.astype(np.float64) for s in srcs]
    if op == "average":
        total = np.sum(wide, axis=0)
        if dtype.kind == "i":
            return (np.sign(total) * (np.abs(total) // len(srcs))).astype(dtype)
        return (total / len(srcs)).astype(dtype)
    if op == "sum":
        return np.sum(wide, axis=0).astype(dtype)
    return NUMPY_OPS[op].reduce(wide, axis=0).astype(dtype)


def assert_reduced(out: np.ndarray, expected: np.ndarray, op: str) -> None:
    if out.dtype.kind == "i" or op in ("min", "max"):
        np.testing.assert_array_equal(out, expected)
    else:
        rtol = {2: 2e-3, 4: 1e-6, 8: 1e-12}[out.dtype.itemsize]
        np.testing.assert_allclose(
            out.astype(np.float64), expected.astype(np.float64), rtol=rtol, atol=rtol
        )


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("op", ["sum", "min", "max", "average"])
@pytest.mark.parametrize("nsrc", [1, 2, 3])
def test_reduce_in_place_at_any_alignment_matches_numpy(name: str, op: str, nsrc: int) -> None:
    """The output may be the first source (the TensorFlow op reduces in place) and the arrays
    may start anywhere: the vector loops read each element before writing it, and the tails
    after the last whole vector are reduced too."""
    dtype = np_dtype(name)
    rng = np.random.default_rng(zlib.crc32(f"inplace{name}{op}{nsrc}".encode()))
    n = 5003  # past one 16 kB block for every dtype, with a tail after the last whole vector
    for shift in (1, 3):  # elements off the allocation's alignment, per array
        bufs = [random_array(rng, dtype, n + 4) for _ in range(nsrc)]
        srcs = [b[shift : shift + n] for b in bufs]
        expected = reference(srcs, op)
        _native.reduce(
            [raw(s) for s in srcs], raw(srcs[0]), _native.DTYPES[name], _native.OPS[op], nsrc
        )
        assert_reduced(srcs[0], expected, op)


def reduce_in_pieces(srcs: list[np.ndarray], out: np.ndarray, name: str, op: str, piece: int):
    """Pieces shorter than one vector (8 halves) take the scalar conversions only."""
    for at in range(0, len(out), piece):
        _native.reduce(
            [raw(s[at : at + piece]) for s in srcs],
            raw(out[at : at + piece]),
            _native.DTYPES[name],
            _native.OPS[op],
        )


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("piece", [None, 7], ids=["vectors", "scalars"])
def test_half_precision_sum_rounds_like_numpy_bit_for_bit(name: str, piece: int | None) -> None:
    """Two halves are added in float32 and rounded to nearest even once, as numpy does, both
    by the vector conversions and by the scalar ones (used for tails and on CPUs without F16C)."""
    dtype = np_dtype(name)
    rng = np.random.default_rng(5)
    bits = rng.integers(0, 2**16, 200_000, dtype=np.uint16)
    values = bits.view(dtype)
    finite = values[np.isfinite(values.astype(np.float32))]
    a, b = finite[: len(finite) // 2], finite[len(finite) // 2 : 2 * (len(finite) // 2)]
    out = np.empty_like(a)
    reduce_in_pieces([a, b], out, name, "sum", piece or len(a))
    with np.errstate(over="ignore"):
        expected = (a.astype(np.float32) + b.astype(np.float32)).astype(dtype)
    same = (out.view(np.uint16) == expected.view(np.uint16)) | (
        np.isnan(out.astype(np.float32)) & np.isnan(expected.astype(np.float32))
    )
    assert same.all(), f"{(~same).sum()} of {len(a)} sums differ"


@pytest.mark.parametrize("name", ["float16", "bfloat16"])
@pytest.mark.parametrize("piece", [None, 7], ids=["vectors", "scalars"])
def test_every_finite_half_survives_a_single_source_reduce(name: str, piece: int | None) -> None:
    dtype = np_dtype(name)
    values = np.arange(2**16, dtype=np.uint16).view(dtype)
    values = values[np.isfinite(values.astype(np.float32))]
    out = np.empty_like(values)
    reduce_in_pieces([values], out, name, "max", piece or len(values))
    np.testing.assert_array_equal(out.view(np.uint16), values.view(np.uint16))


def test_reduce_rejects_bad_arguments() -> None:
    a = np.ones(4, np.float32)
    with pytest.raises(TypeError):
        _native.reduce([a], np.ones(4, np.float32), 99, 0)
    with pytest.raises(ValueError):
        _native.reduce([a], np.ones(4, np.float32), 2, 99)
    with pytest.raises(ValueError):
        _native.reduce([a], np.ones(5, np.float32), 2, 0)
    with pytest.raises(TypeError):
        _native.reduce([a], np.ones(4, np.float64), 2, 0)
    with pytest.raises(ValueError, match="contiguous"):
        _native.reduce([np.ones(8, np.float32)[::2]], np.ones(4, np.float32), 2, 0)

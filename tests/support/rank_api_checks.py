"""What every rank of a world runs to check the rank API (broadcast, allreduce, barrier, errors),
shared by the tests of one host, of several hosts and of the GASPI transport."""

PRELUDE = """
import os, sys
import numpy as np
import ml_dtypes
import tnt_notebook as tnt
from tnt_notebook.rank import api as ranks
from tests.support import world_checks as w
r, p = tnt.get_rank(), tnt.get_size()
"""

API_CHECKS = """
from mpi4py import MPI
assert (r, p) == (MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size())
assert tnt.get_master_rank() == 0 and tnt.is_master_rank() == (r == 0)
tnt.barrier()

# broadcast: arrays keep shape and dtype, any picklable object, any root
last = p - 1
for value in [np.arange(12, dtype=np.float16).reshape(3, 4), np.float64(2.5), np.array(7),
              np.ones((2, 3), ml_dtypes.bfloat16), np.arange(30)[::3],
              np.random.default_rng(1).standard_normal((300, 500)),
              {"a": [1, 2, (3, "x")], "b": None}, "text", 42]:
    got = tnt.broadcast(value if r == last else None, root=last)
    if isinstance(value, np.ndarray):
        assert got.shape == value.shape and got.dtype == value.dtype
        np.testing.assert_array_equal(got, value)
    else:
        assert got == value
w.expect_error(ValueError, tnt.broadcast, 1, root=p)
w.expect_error(ValueError, tnt.broadcast, 1, root=-1)
if p > 1:  # an object the root cannot pickle: every rank raises (one rank needs no pickling)
    lam = (lambda: 0) if r == 0 else None
    w.expect_error(Exception, tnt.broadcast, lam, root=0, match="ickl")

# allreduce: a new array of the same shape and dtype
x = np.arange(6, dtype=np.float32).reshape(2, 3) + r
y = tnt.allreduce(x)
assert y is not x and y.shape == x.shape and y.dtype == x.dtype
np.testing.assert_array_equal(y, sum(x - r + q for q in range(p)))
np.testing.assert_array_equal(tnt.allreduce([1.0, 2.0]), [p, 2 * p])          # lists
assert tnt.allreduce(np.float64(r)).shape == () and tnt.allreduce(np.float64(r)) == sum(range(p))
big = np.arange(40, dtype=np.int64).reshape(5, 8)
np.testing.assert_array_equal(tnt.allreduce(big[:, ::3], "max"), big[:, ::3])  # non-contiguous
np.testing.assert_array_equal(tnt.allreduce(big.T), big.T * p)                 # Fortran order
ro = np.full(5, r, np.int32); ro.flags.writeable = False
np.testing.assert_array_equal(tnt.allreduce(ro, "min"), np.zeros(5, np.int32))  # read-only input
out = np.empty(5, np.int32)
assert tnt.allreduce(ro, "max", out=out) is out and (out == p - 1).all()
inplace = np.arange(3_000_001, dtype=np.float64) * (r + 1)   # several rounds, out=input
assert tnt.allreduce(inplace, out=inplace) is inplace
np.testing.assert_array_equal(inplace, np.arange(3_000_001, dtype=np.float64) * (p * (p + 1) // 2))
shifted = np.arange(1_000_007, dtype=np.float64) * (r + 1)  # out overlaps the input, 7 further on
tnt.allreduce(shifted[:-7], out=shifted[7:])
np.testing.assert_array_equal(shifted[7:], np.arange(1_000_000.0) * sum(range(1, p + 1)))
np.testing.assert_array_equal(tnt.allreduce(np.full(3, r + 1, np.int32), "average"),
                              np.full(3, sum(range(1, p + 1)) // p, np.int32))
np.testing.assert_array_equal(tnt.allreduce(np.full(2, -r - 1, np.int64), "average"),
                              np.full(2, -(sum(range(1, p + 1)) // p), np.int64))  # toward zero
# bad input raises on the calling rank before any communication: only rank 0 makes mistakes
if r == 0:
    w.expect_error(ValueError, tnt.allreduce, x, "prod", match="unsupported op")
    w.expect_error(ValueError, tnt.allreduce, x, None)
    for bad in [np.ones(3, bool), np.ones(3, np.complex64), np.ones(3, np.uint8),
                np.array(["a"]), np.array([object()])]:
        w.expect_error(TypeError, tnt.allreduce, bad, match="unsupported dtype")
    w.expect_error(ValueError, tnt.allreduce, x, out=np.empty(5, np.float32), match="shape")
    w.expect_error(ValueError, tnt.allreduce, x, out=np.empty((2, 3), np.float64))
    w.expect_error(ValueError, tnt.allreduce, x, out=np.empty((3, 2), np.float32).T)
    w.expect_error(ValueError, tnt.allreduce, x, out=np.empty(6, np.float32), match="shape")
    w.expect_error(ValueError, tnt.allreduce, x, out=np.empty((2, 3), np.int32), match="dtype")
    w.expect_error(TypeError, tnt.allreduce, x, out=[0] * 6)
    frozen = np.empty((2, 3), np.float32); frozen.flags.writeable = False
    w.expect_error(ValueError, tnt.allreduce, x, out=frozen, match="writeable")
np.testing.assert_array_equal(tnt.allreduce(np.ones(4)), np.full(4, p))  # nobody is out of step

# FusedAllreduce contract
specs = [((3, 4), np.float32), ((5,), np.float32), ((2, 2), np.float64), ((7,), np.float32)]
f = ranks.FusedAllreduce(specs, threshold_bytes=64)
assert f.buckets == [[0, 1], [2], [3]]  # 48 + 20 bytes reach 64; dtypes never mix
arrays = [np.full(s, r + 1, d) for s, d in specs]
for a in arrays:
    a.flags.writeable = False   # TF hands over read-only arrays
for k, b in enumerate(f.buckets):
    outs = f.reduce_bucket(k, [arrays[i] for i in b])
    for i, o in zip(b, outs):
        assert o.shape == specs[i][0] and o.dtype == specs[i][1]
        np.testing.assert_array_equal(o, np.full(specs[i][0], sum(range(1, p + 1))))
res = f.allreduce(arrays, "average")
assert [a.shape for a in res] == [s for s, _ in specs]
# reuse=True: aligned results, the same arrays again once the caller let go, new ones while held
held = f.reduce_bucket(0, [arrays[i] for i in f.buckets[0]], reuse=True)
assert all(o.ctypes.data % 64 == 0 for o in held)
ids = [id(o) for o in held]
twice = [np.full(specs[i][0], 2 * r, specs[i][1]) for i in f.buckets[0]]
again = f.reduce_bucket(0, twice, reuse=True)
assert [id(o) for o in again] != ids  # `held` is still referenced: it must not be overwritten
np.testing.assert_array_equal(held[0], np.full(specs[f.buckets[0][0]][0], sum(range(1, p + 1))))
np.testing.assert_array_equal(again[0], np.full(specs[f.buckets[0][0]][0], p * (p - 1)))
ids = [id(o) for o in again]
del held, again
assert [id(o) for o in f.reduce_bucket(0, [arrays[i] for i in f.buckets[0]], reuse=True)] == ids
if r == 0:
    w.expect_error(IndexError, f.reduce_bucket, len(f.buckets), [])
    w.expect_error(ValueError, f.reduce_bucket, 0, [])
    w.expect_error(TypeError, f.reduce_bucket, 0, [np.ones((3, 4), np.float64)] * len(f.buckets[0]))
    w.expect_error(ValueError, f.reduce_bucket, 0, [np.ones(13, np.float32)] * len(f.buckets[0]))
    w.expect_error(ValueError, f.reduce_bucket, 0, [arrays[i] for i in f.buckets[0]], "prod")
    w.expect_error(ValueError, f.allreduce, arrays[:2])
    w.expect_error(ValueError, ranks.FusedAllreduce, specs, threshold_bytes=-1)
    w.expect_error(TypeError, ranks.FusedAllreduce, specs, threshold_bytes=1.5)
    w.expect_error(TypeError, ranks.FusedAllreduce, [((2,), np.complex128)])
assert ranks.FusedAllreduce(specs, threshold_bytes=0).buckets == [[0], [1], [2], [3]]
os.environ["TNT_FUSION_THRESHOLD"] = "1000000"
assert ranks.FusedAllreduce(specs).buckets == [[0, 1], [2], [3]]
del os.environ["TNT_FUSION_THRESHOLD"]
assert ranks.FusedAllreduce(specs).threshold_bytes == 32768

# timeouts are configurable
if r == 0:
    w.expect_error(ValueError, ranks.set_collective_timeout, 0)
ranks.set_collective_timeout(12.5)
assert ranks.engine_info()["timeout"] == 12.5
ranks.set_collective_timeout(None)
assert ranks.collective_timeout() == float(os.environ.get("TNT_COLLECTIVE_TIMEOUT", 30))
tnt.barrier()
w.say("API OK", r)
"""

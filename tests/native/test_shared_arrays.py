"""Shared arrays (tnt.empty): allocation in one process, and allreduce on them in real worlds."""

from __future__ import annotations

import pytest

from tests.support.engine_worlds import PRELUDE, run
from tests.support.mpiworld import run_plain


def test_empty_arrays_are_shared_and_their_memory_is_reused() -> None:
    done = run_plain(
        PRELUDE
        + """
a = tnt.empty((3, 5), "int64")
assert a.shape == (3, 5) and a.dtype == np.int64 and a.flags.c_contiguous and a.flags.writeable
assert ranks.is_shared(a) and ranks.is_shared(a[1:, ::2]) and not ranks.is_shared(np.ones(3))
assert tnt.empty(0).shape == (0,) and tnt.empty((2, 0)).size == 0
assert tnt.empty(7).dtype == np.float32
address = tnt.empty(1 << 20).ctypes.data  # freed at once
assert tnt.empty(1 << 20).ctypes.data == address, "a freed block is not reused"
b = tnt.empty(1 << 20)
assert b.ctypes.data == address and tnt.empty(1 << 20).ctypes.data != address  # one owner each
try:
    tnt.empty((2, -1))
except ValueError as e:
    assert "negative" in str(e)
else:
    raise AssertionError("negative dimension accepted")
a[:] = np.arange(15).reshape(3, 5)
s = tnt.allreduce(a)
assert ranks.is_shared(s) and (s == a).all() and not ranks.is_shared(tnt.allreduce(np.ones(3)))
print("OK")
"""
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "OK"


# Each rank's input and output (rank r takes entry r modulo the list): shared or not, or one
# shared array reduced in place.
SHARED_MATRIX = """
LAYOUTS = {
    "all shared": [("shared", "shared")],
    "inputs shared": [("shared", "numpy")],
    "outputs shared": [("numpy", "shared")],
    "in place": [("shared", "in place")],
    "mixed": [("shared", "numpy"), ("numpy", "shared"), ("shared", "shared")],
}

def reduce_with(key, name, op, shape):
    inputs = [w.rank_input(q, name, shape, key + op) for q in range(p)]
    kind_in, kind_out = LAYOUTS[key][r % len(LAYOUTS[key])]
    a = tnt.empty(shape, inputs[r].dtype) if kind_in == "shared" else np.empty_like(inputs[r])
    a[...] = inputs[r]
    if kind_out == "in place":
        out = a
    else:
        out = tnt.empty(shape, a.dtype) if kind_out == "shared" else np.empty_like(a)
    got = tnt.allreduce(a, op, out=out)
    assert got is out
    what = f"{name} {op} {shape} {kind_in}/{kind_out}"
    w.assert_close(got, w.expected(op, inputs), what, ranks.engine_info()["num_nodes"])
    return got

def peer_blocks():  # blocks mapped here that this rank did not allocate (its own keep an fd)
    own = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if "memfd:tnt-array" in os.readlink(f"/proc/self/fd/{fd}"):
                own.add(os.stat(f"/proc/self/fd/{fd}").st_ino)
        except OSError:
            pass
    with open("/proc/self/maps") as maps:
        mapped = {int(line.split()[4]) for line in maps if "memfd:tnt-array" in line}
    return len(mapped - own)

checks = 0
for seg in ("4096", None):  # many rounds of a tiny segment; then the default one
    w.rebuild_with(TNT_SHM_SEGMENT_BYTES=seg)
    for key in LAYOUTS:
        results = []
        for name in ("float32", "float16", "int64"):
            for op in ("sum", "average", "max"):
                for shape in [(0,), (1,), (7,), (1001,), (33, 65)]:
                    results.append(reduce_with(key, name, op, shape))
                    checks += 1
        if seg is None:  # past one round, and the streaming path (4 MiB and more)
            big = (("float32", 1_300_001), ("float32", 2_100_001), ("bfloat16", 2_100_001))
            for name, size in big:
                results.append(reduce_with(key, name, "sum", (size,)))
                checks += 1
        w.check_identical_everywhere(results)
w.say("CHECKS", r, checks, "PEERBLOCKS", peer_blocks())
"""


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("n", "per_node"), [(2, None), pytest.param(3, None, marks=pytest.mark.slow), (4, "2")]
)
def test_allreduce_on_shared_arrays_matches_numpy_whichever_ranks_share(
    n: int, per_node: str | None
) -> None:
    env = {"TNT_RANKS_PER_NODE": per_node} if per_node else {}  # two nodes of two ranks
    result = run(n, SHARED_MATRIX, env=env, timeout=300)
    lines = [line.split() for line in result.stdout.splitlines() if line.startswith("CHECKS")]
    assert len(lines) == n, result.stdout
    for line in lines:
        assert int(line[2]) == 5 * (2 * 45 + 3), line
        # the peers' shared arrays were mapped here: they were read or written in place
        assert int(line[4]) > 0, line


@pytest.mark.mpi
def test_a_failed_allreduce_never_hands_its_shared_output_out_again() -> None:
    # the other rank may still be writing into it when this one gives up
    result = run(
        2,
        """
x, out = tnt.empty(1 << 20), tnt.empty(1 << 20)
x[:] = 1
tnt.allreduce(x, out=out)
address = out.ctypes.data
if r == 1:
    ranks.shutdown()  # leaves: rank 0's next allreduce fails
else:
    w.expect_error(ranks.RankLostError, tnt.allreduce, x, out=out, match="left")
    del out
    w.say("REUSED", tnt.empty(1 << 20).ctypes.data == address)
""",
    )
    assert "REUSED False" in result.stdout, result.stdout

"""The rank API: who am I, how many are we, and collectives over numpy arrays.

Every process started by ``mpiexec`` is a rank; a plain process is a 1-rank world. MPI is
initialised (by mpi4py, which also selects the MPI library) on the first call, never at import.
Collectives run on the native engine (``tnt_notebook._native``): ranks of one node reduce through a
shared-memory segment, nodes exchange through MPI (or through GASPI one-sided writes, with
``TNT_TRANSPORT=gaspi``), driven by the calling thread, and the GIL is released while they
communicate.

Semantics worth knowing:

- ``allreduce`` returns a new array with the input's shape and dtype (or fills ``out=``). Supported
  dtypes: float16, bfloat16 (ml_dtypes), float32, float64, int32, int64; ops: sum, average, min,
  max. ``average`` on integers divides the sum by the world size truncating toward zero (C integer
  division, as Horovod does). float16/bfloat16 accumulate in float32 and round once per node.
  Non-contiguous inputs are copied first. Every rank receives bitwise-identical results.
- ``empty`` allocates arrays in memory the other ranks of the node can map; ``allreduce`` reads
  and writes those in place instead of copying them through the shared segment.
- Every collective waits at most ``collective_timeout()`` seconds (env ``TNT_COLLECTIVE_TIMEOUT``,
  default 30, or ``set_collective_timeout``). A peer that dies, leaves or does not arrive makes
  every waiting rank raise (``RankLostError``, ``CollectiveTimeoutError``, naming the rank);
  ranks that called with different arguments raise ``CollectiveMismatchError``. Ctrl-C (SIGINT)
  interrupts a waiting rank with ``KeyboardInterrupt``. After an interrupted or failed collective
  the next collective on every rank rebuilds the engine, so the next notebook cell works; an
  interrupted or timed-out bootstrap of the engine is resumed by the next collective.

Its settings (``TNT_COLLECTIVE_TIMEOUT``, ``TNT_FUSION_THRESHOLD``, ``TNT_SHM_SEGMENT_BYTES``,
``TNT_WAIT_SPIN_US``, ``TNT_ALLREDUCE_PATH``, ``TNT_TRANSPORT``, ``TNT_GASPI_PORT``,
``TNT_RANKS_PER_NODE``) are declared in :mod:`tnt_notebook.settings` and read when the engine is
built.
"""

from __future__ import annotations

import atexit
import functools
import os
import pickle
import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from tnt_notebook import settings, transport

MASTER_RANK = 0
OPS = ("sum", "average", "min", "max")
_EXCEPTIONS = (
    "CollectiveError",
    "CollectiveTimeoutError",
    "RankLostError",
    "CollectiveAbortedError",
    "CollectiveMismatchError",
)

_engine: Any = None
_timeout: float | None = None


@functools.cache
def _mpi() -> Any:
    """mpi4py's MPI module (initialises MPI with MPI_THREAD_MULTIPLE on first import, with
    transport.MPI_ENV_DEFAULTS where the environment does not say otherwise)."""
    if "mpi4py.MPI" not in sys.modules:
        os.environ.update(transport.mpi_env_defaults())
    from mpi4py import MPI

    return MPI


@functools.cache
def native_core() -> Any:
    """The compiled module (``tnt_notebook._native``), loaded after mpi4py, which chooses (and
    loads) the MPI library that the native module then uses."""
    _mpi()
    from tnt_notebook import _native as native

    return native


def __getattr__(name: str) -> Any:
    if name in _EXCEPTIONS:
        return getattr(native_core(), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def collective_timeout() -> float:
    """Seconds every collective waits for its peers before raising."""
    if _timeout is not None:
        return _timeout
    return float(settings.COLLECTIVE_TIMEOUT.read())


def set_collective_timeout(seconds: float | None) -> None:
    """Override the collective timeout for this process (None: back to the environment)."""
    global _timeout
    if seconds is not None and not seconds > 0:
        raise ValueError(f"timeout must be positive, got {seconds!r}")
    _timeout = None if seconds is None else float(seconds)
    if _engine is not None:
        _engine.timeout = collective_timeout()


def current_engine() -> Any:
    """The process's engine, built on first use and rebuilt once a collective broke it (here or in
    the TensorFlow op, which calls the engine without Python). A bootstrap that an interrupt or a
    timeout suspended is resumed, not started anew: every rank then makes the same MPI calls."""
    global _engine
    engine = _engine
    if engine is not None and engine.usable:
        return engine
    if engine is not None and not engine.bootstrapping:
        engine.close()
        _engine = engine = None
    if engine is None:
        _engine = engine = new_engine()
        if not getattr(current_engine, "registered", False):
            atexit.register(shutdown)
            current_engine.registered = True  # type: ignore[attr-defined]
    engine.start()
    return engine


def new_engine(**overrides: Any) -> Any:
    """An engine with the settings of the environment, ``overrides`` winning, not started (its
    start() is a collective). The process's own is current_engine(); a benchmark may build
    another one beside it to compare settings in one run."""
    MPI = _mpi()
    options = {
        "timeout": collective_timeout(),
        "ranks_per_node": settings.RANKS_PER_NODE.read(),
        "slot_bytes": settings.SHM_SEGMENT_BYTES.read(),
        "spin_us": settings.WAIT_SPIN_US.read(),
        "path": settings.ALLREDUCE_PATH.read(),
        **_transport_options(),
        **overrides,
    }
    return native_core().Engine(MPI._addressof(MPI.COMM_WORLD), MPI._sizeof(MPI.Comm), **options)


def init() -> None:
    """Tarantella's ``tnt.init()``: start the communication engine now (a collective: every rank
    calls it). Optional here, where the engine otherwise starts at the first collective."""
    current_engine()


def _transport_options() -> dict[str, Any]:
    name = settings.TRANSPORT.read()
    transport.require(name, native_core().TRANSPORTS)
    return {"transport": name, "gaspi_port": settings.GASPI_PORT.read()}


def _collective(method: str, *args: Any) -> Any:
    return getattr(current_engine(), method)(*args)


def engine_info() -> dict[str, Any]:
    """Topology of the engine (builds it: a collective): node count, local rank/size, segment."""
    e = current_engine()
    return {
        "rank": e.rank,
        "size": e.size,
        "local_rank": e.local_rank,
        "local_size": e.local_size,
        "num_nodes": e.num_nodes,
        "overlaps_exchanges": e.overlaps_exchanges,
        "nparts": e.nparts,
        "slot_bytes": e.slot_bytes,
        "spin_us": e.spin_microseconds,
        "segment_name": e.segment_name,
        "transport": e.transport,
        "timeout": e.timeout,
        "path_sites": e.path_sites,
    }


def shutdown() -> None:
    """Close this process's engine (peers still waiting on it raise instead of timing out)."""
    global _engine
    if _engine is not None:
        _engine.close()
        _engine = None


def reset_engine() -> None:
    """Every rank at once, between collectives: drop this rank's engine, so that the next
    collective builds a new one on every rank. The notebook does it after a cell failed: a
    collective that fail fast interrupted broke the waiting ranks' engines but not the engine of
    the rank that raised before it, and ranks with broken engines would rebuild while that one
    still used its own. A bootstrap that was suspended is kept (the next collective resumes it,
    matching the ranks that start theirs)."""
    global _engine
    if _engine is not None and not _engine.bootstrapping:
        _engine.close()
        _engine = None


def abort_collectives(reason: str) -> None:
    """This rank gives up: every rank's current or next collective raises
    ``CollectiveAbortedError`` naming this rank and ``reason`` (instead of waiting for this one
    until the timeout), and the next collective everywhere rebuilds the engine. For code that
    fails on some ranks only, between collectives. No-op before the first collective."""
    if _engine is not None and _engine.usable:
        _engine.abort(reason)


def get_rank() -> int:
    return _mpi().COMM_WORLD.Get_rank()


def get_size() -> int:
    return _mpi().COMM_WORLD.Get_size()


def get_master_rank() -> int:
    return MASTER_RANK


def is_master_rank() -> bool:
    return get_rank() == MASTER_RANK


def barrier(timeout: float | None = None) -> None:
    """Wait until every rank arrives, at most the collective timeout (or ``timeout`` seconds)."""
    if timeout is None:
        _collective("barrier")
        return
    previous = _timeout
    set_collective_timeout(timeout)
    try:
        _collective("barrier")
    finally:
        set_collective_timeout(previous)


def broadcast(value: Any, root: int = MASTER_RANK) -> Any:
    """``value`` of rank ``root`` on every rank: numpy arrays (shape and dtype kept) or any
    picklable object. The root gets its own object back."""
    size = get_size()
    if not isinstance(root, int | np.integer) or not 0 <= int(root) < size:
        raise ValueError(f"broadcast root {root!r} is not a rank of this {size}-rank world")
    root = int(root)
    if size == 1:
        return value
    payload = None
    if get_rank() == root:
        try:
            payload = b"P" + pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as exc:  # tell the peers instead of leaving them waiting
            payload = b"E" + f"{type(exc).__name__}: {exc}".encode()
            _collective("broadcast", payload, root)
            raise
    data = _collective("broadcast", payload, root)
    if data[:1] == b"E":
        raise ValueError(f"broadcast from rank {root} failed: {data[1:].decode()}")
    return value if get_rank() == root else pickle.loads(data[1:])


# The core's codes (from the native module, filled on first use; dict lookups keep the hot path
# cheap: `dtype.name` alone costs microseconds).
_OP_CODES: dict[str, int] = {}
_DTYPE_CODES: dict[np.dtype, int] = {}
_BF16 = -1


def _load_codes() -> None:
    global _BF16
    native = native_core()
    _BF16 = native.DTYPES["bfloat16"]
    _DTYPE_CODES.update((np.dtype(n), c) for n, c in native.DTYPES.items() if c != _BF16)
    _OP_CODES.update(native.OPS)


def _op_code(op: str) -> int:
    if not _OP_CODES:
        _load_codes()
    code = _OP_CODES.get(op) if isinstance(op, str) else None
    if code is None:
        raise ValueError(f"unsupported op {op!r}; use one of {', '.join(OPS)}")
    return code


def _dtype_code(dtype: np.dtype) -> int:
    if not _OP_CODES:
        _load_codes()
    code = _DTYPE_CODES.get(dtype)
    if code is not None:
        return code
    ml_dtypes = sys.modules.get("ml_dtypes")  # bfloat16 arrays exist only if it was imported
    if ml_dtypes is not None and dtype == np.dtype(ml_dtypes.bfloat16):
        _DTYPE_CODES[dtype] = _BF16
        return _BF16
    supported = ", ".join(native_core().DTYPES)
    raise TypeError(f"unsupported dtype {dtype} for allreduce; supported: {supported}")


def _raw(a: np.ndarray, code: int) -> np.ndarray:
    """bfloat16 arrays have no buffer protocol: the core reduces their 16-bit view."""
    return a.view(np.uint16) if code == _BF16 else a


def _aligned_empty(shape: tuple[int, ...], dtype: np.dtype, alignment: int = 64) -> np.ndarray:
    raw = np.empty(int(np.prod(shape, dtype=np.int64)) * dtype.itemsize + alignment, np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + raw.size - alignment].view(dtype).reshape(shape)


def empty(shape: int | Sequence[int], dtype: Any = np.float32) -> np.ndarray:
    """A new, uninitialised array in memory that the other ranks of this node can map.

    ``allreduce`` skips its staging copies for such arrays: the ranks read a shared input where
    it lies, and two ranks on a node whose outputs are both shared write each half of the result
    into both outputs; ``allreduce`` of a shared array returns a shared array. The memory is
    kept for reuse when the array is freed.
    """
    dt = np.dtype(dtype)
    dims = (int(shape),) if isinstance(shape, int | np.integer) else tuple(int(d) for d in shape)
    if any(d < 0 for d in dims):
        raise ValueError(f"negative dimensions are not allowed: {dims}")
    nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
    block = native_core().SharedBlock(nbytes)
    return np.frombuffer(block, np.uint8, nbytes).view(dt).reshape(dims)


def is_shared(array: np.ndarray) -> bool:
    """Whether ``array`` lies in memory from ``empty`` (a view of such an array does too)."""
    base = array
    while isinstance(base, np.ndarray):
        base = base.base
    return isinstance(base, memoryview) and isinstance(base.obj, native_core().SharedBlock)


def allreduce(array: Any, op: str = "sum", *, out: np.ndarray | None = None) -> np.ndarray:
    """Combine ``array`` across all ranks with ``op``; returns a new array (a shared one for a
    shared input, see ``empty``), or fills ``out`` (a C-contiguous array of the same shape and
    dtype; ``out=array`` reduces in place)."""
    # The hot path of small collectives: every lookup here costs as much as MPI's own latency.
    op_code = _OP_CODES.get(op) if type(op) is str else None
    if op_code is None:
        op_code = _op_code(op)
    a = array if type(array) is np.ndarray else np.asarray(array)
    dtype = a.dtype
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        code = _dtype_code(dtype)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)  # documented: non-contiguous inputs are copied
    if out is None:
        out = empty(a.shape, dtype) if is_shared(a) else np.empty(a.shape, dtype)
    elif type(out) is not np.ndarray:
        _check_out(out, a)
    engine = _engine
    if engine is None or not engine.usable:
        engine = current_engine()
    try:
        if code == _BF16:
            engine.allreduce1(a.view(np.uint16), out.view(np.uint16), code, op_code)
        else:
            engine.allreduce1(a, out, code, op_code)
    except (ValueError, TypeError, BufferError):
        # The core refuses an unfit `out` before any exchange starts (checking it here first
        # would cost a small collective 5 %): say what is wrong with it in the caller's terms.
        _check_out(out, a)
        raise
    return out


def _check_out(out: Any, a: np.ndarray) -> None:
    """Raises the error an unfit ``out`` for input ``a`` deserves (none if it is fit)."""
    if not isinstance(out, np.ndarray):
        raise TypeError("out must be a numpy array")
    if out.shape != a.shape or out.dtype != a.dtype:
        raise ValueError(
            f"out has shape {out.shape} and dtype {out.dtype}, expected {a.shape} and {a.dtype}"
        )
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("out must be C-contiguous and writeable")


def fusion_threshold(threshold_bytes: int | None = None) -> int:
    """The fusion threshold in bytes: the argument, else TNT_FUSION_THRESHOLD, else 32768."""
    if threshold_bytes is None:
        return settings.FUSION_THRESHOLD.read()
    if isinstance(threshold_bytes, bool) or not isinstance(threshold_bytes, int | np.integer):
        raise TypeError(f"threshold_bytes must be an int, got {threshold_bytes!r}")
    settings.FUSION_THRESHOLD.check(threshold_bytes, "threshold_bytes")
    return int(threshold_bytes)


class FusedAllreduce:
    """Reduces a fixed list of tensors in fusion buckets, in the same plan order on every rank.

    The constructor is a collective: it builds the static plan (buckets of one dtype closed once
    they hold ``threshold_bytes``; 0 = one tensor per bucket) and checks that every rank built the
    same plan (``CollectiveMismatchError`` on every rank otherwise). Each bucket is then one fused
    collective whose tensors are packed into the shared segment.
    """

    def __init__(
        self, specs: Sequence[tuple[tuple[int, ...], Any]], threshold_bytes: int | None = None
    ):
        self.specs = [(tuple(int(d) for d in shape), np.dtype(dtype)) for shape, dtype in specs]
        codes = [_dtype_code(dt) for _, dt in self.specs]
        self.threshold_bytes = fusion_threshold(threshold_bytes)
        buckets, plan_hash = native_core().fusion_plan(
            [(shape, code) for (shape, _), code in zip(self.specs, codes, strict=True)],
            self.threshold_bytes,
        )
        self.buckets: list[list[int]] = [list(b) for b in buckets]
        self._codes = [codes[b[0]] for b in self.buckets]
        self._sizes = [int(np.prod(shape, dtype=np.int64)) for shape, _ in self.specs]
        self._kept: dict[int, list[np.ndarray]] = {}
        self._check_same_plan(plan_hash)

    def _check_same_plan(self, plan_hash: int) -> None:
        halves = np.array([plan_hash >> 32, plan_hash & 0xFFFFFFFF], dtype=np.int64)
        both = allreduce(np.concatenate([halves, -halves]), "max")
        if not (both[0] == -both[2] and both[1] == -both[3]):
            raise native_core().CollectiveMismatchError(
                f"fusion plans differ across ranks (rank {get_rank()}: {len(self.specs)} "
                f"tensors, {len(self.buckets)} buckets, threshold {self.threshold_bytes} bytes)"
            )

    def reduce_bucket(
        self, index: int, arrays: Sequence[np.ndarray], op: str = "sum", *, reuse: bool = False
    ) -> list[np.ndarray]:
        """Allreduce bucket ``index`` (its tensors, in plan order); returns new arrays.

        With ``reuse``, the results are 64-byte aligned arrays that a later call may return again
        once nobody else holds them (TensorFlow then wraps them without a copy, and a training
        step neither allocates nor page-faults 2 x the model's size).
        """
        op_code = _op_code(op)
        if not 0 <= index < len(self.buckets):
            raise IndexError(f"bucket {index} out of range (plan has {len(self.buckets)})")
        bucket, code = self.buckets[index], self._codes[index]
        if len(arrays) != len(bucket):
            raise ValueError(f"bucket {index} holds {len(bucket)} tensors, got {len(arrays)}")
        ins = []
        for i, array in zip(bucket, arrays, strict=True):
            shape, dtype = self.specs[i]
            a = np.asarray(array)
            if a.dtype != dtype:
                raise TypeError(f"tensor {i} has dtype {a.dtype}, the plan says {dtype}")
            if a.size != self._sizes[i]:
                raise ValueError(f"tensor {i} has {a.size} elements, the plan says {shape}")
            ins.append(_raw(a if a.flags.c_contiguous else np.ascontiguousarray(a), code))
        outs = (
            self._reusable_outputs(index) if reuse else [np.empty(*self.specs[i]) for i in bucket]
        )
        _collective("allreduce", ins, [_raw(o, code) for o in outs], code, op_code, index)
        return outs

    def native_codes(self, index: int, op: str = "sum") -> tuple[int, int]:
        """The core's (dtype, op) codes of bucket ``index``, for a caller that reduces it natively
        (the TensorFlow op)."""
        return self._codes[index], _op_code(op)

    def _reusable_outputs(self, index: int) -> list[np.ndarray]:
        """Bucket ``index``'s kept output arrays, or new ones while someone still holds those."""
        kept = self._kept.get(index)
        # references: self._kept's list, getrefcount's argument, the loop variable (an interpreter
        # that counts differently only ever makes us allocate: safe, just slower)
        if kept is None or any(sys.getrefcount(o) > 3 for o in kept):
            kept = self._kept[index] = [_aligned_empty(*self.specs[i]) for i in self.buckets[index]]
        return list(kept)  # a new list: a caller that keeps it holds the arrays themselves

    def allreduce(self, arrays: Sequence[np.ndarray], op: str = "sum") -> list[np.ndarray]:
        """Allreduce all tensors, bucket by bucket in plan order."""
        if len(arrays) != len(self.specs):
            raise ValueError(f"the plan holds {len(self.specs)} tensors, got {len(arrays)}")
        out: list[np.ndarray] = [None] * len(arrays)  # type: ignore[list-item]
        for k, bucket in enumerate(self.buckets):
            for i, r in zip(
                bucket, self.reduce_bucket(k, [arrays[i] for i in bucket], op), strict=True
            ):
                out[i] = r
        return out

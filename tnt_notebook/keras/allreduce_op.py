"""Fused gradient reduction inside the training step's graph.

Each fusion bucket becomes one ``TntAllreduce`` op (``native/tf_op.cpp``, compiled on first use for
this process's TensorFlow by :mod:`op_cache`), which calls the engine from TensorFlow's own thread:
a step never enters Python, and results are written in place into the gradients' buffers. Where the
op cannot be had (no compiler, a failed build: one warning says why), or with ``TNT_TF_OP=0``, each
bucket is a ``tf.numpy_function`` instead: same results, 0.15-0.25 ms more per bucket (measured).
Across nodes each bucket is two ops, ``TntAllreduceStart`` and ``TntAllreduceFinish``, so that
its exchange can travel during the rest of backprop (:func:`zeros_unless`, :func:`reduce_buckets`).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import re
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import tensorflow as tf

from tnt_notebook import ranks
from tnt_notebook.keras import op_cache

# How a failed collective shows in TensorFlow's error message, from the op or the fallback.
_COLLECTIVE_ERROR = re.compile(
    r"^(?:tnt_notebook\._native\.)?(Collective\w*Error|RankLostError): (.*)$", re.MULTILINE
)


#: Whether every rank of the world has the op (known once prepare() ran; None before).
_on_every_rank: bool | None = None
#: Whether every rank reduces each bucket in two halves (known once prepare() ran).
_in_halves = False


def op_library() -> Any:
    """TensorFlow's module of the op, bound to the engine; None where the fallback is used.

    A world reduces through one path: if some rank has no op, every rank takes the fallback, so
    that all ranks run the same graph (TensorFlow optimizes a step around the op and around
    ``tf.numpy_function`` differently, which changes the last bit of some updates and would let
    the ranks' models drift apart)."""
    return None if _on_every_rank is False else _own_library()


@functools.cache
def _own_library() -> Any:
    """This process's op (found or built now), or None."""
    if os.environ.get("TNT_TF_OP", "1").strip() == "0":
        return None
    try:
        module, path = op_cache.load()
    except op_cache.OpUnavailable as exc:
        warnings.warn(
            f"tnt: {exc}. Until then gradients are reduced through tf.numpy_function "
            "(same results, slower).",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    bound = ctypes.CDLL(str(path)).tnt_bind(ctypes.c_void_p(ranks._native().c_api())) == 0
    return module if bound else None


@functools.cache
def prepare() -> None:
    """Before the first fit or evaluate of a process, ahead of any collective: the op is found
    or built (seconds, on some ranks only), then the ranks meet with a deadline that covers a
    build, so that no rank waits out a collective's timeout for another's compile, and learn
    whether every rank has it."""
    global _on_every_rank, _in_halves
    mine = _own_library() is not None
    if ranks.get_size() == 1:
        _on_every_rank = mine
        return
    ranks.barrier(timeout=op_cache.LONGEST_S + ranks.collective_timeout())
    size = ranks.get_size()
    flags = np.zeros(size + 1, dtype=np.int32)  # per rank: no op; last: ranks that want halves
    flags[ranks.get_rank()] = not mine
    flags[size] = _wants_halves()
    flags = ranks.allreduce(flags, op="sum")
    without = np.flatnonzero(flags[:size]).tolist()
    _on_every_rank = not without
    _in_halves = _on_every_rank and int(flags[size]) == size
    if mine and without:
        warnings.warn(
            f"tnt: rank(s) {without} have no TensorFlow op (see their warning): every rank "
            "reduces gradients through tf.numpy_function, so that all ranks compute alike "
            "(same results, slower).",
            RuntimeWarning,
            stacklevel=2,
        )


def _wants_halves() -> bool:
    """Across nodes, each bucket is reduced in two halves (unless ``TNT_OVERLAP=0``): its start
    as soon as its gradients exist, which may post the exchange (the engine measures, per step's
    buckets, whether that pays), and its finish after the last start, while the rest of backprop
    ran in between. On one node, or with ``TNT_ALLREDUCE_PATH=engine``, nothing travels early."""
    if _own_library() is None or os.environ.get("TNT_OVERLAP", "1").strip() == "0":
        return False
    return bool(ranks.engine_info()["overlaps_exchanges"])


def zeros_unless(condition: Any, tensors: list) -> list:
    """``tensors``, or their zeros where ``condition`` is false (a rank without samples). Where
    buckets are reduced in halves, each tensor is chosen on its own: one ``tf.cond`` over the
    list would hold every gradient until backprop ends, and no bucket could start early."""
    if _in_halves:
        return [tf.where(condition, t, tf.zeros_like(t)) for t in tensors]
    return tf.cond(condition, lambda: tensors, lambda: [tf.zeros_like(t) for t in tensors])


def reduce_buckets(reducer: ranks.FusedAllreduce, tensors: list) -> list:
    """``tensors`` summed over all ranks: one collective per fusion bucket, chained by control
    dependencies so that every rank runs the buckets in plan order (with halves: the starts in
    plan order, then the finishes)."""
    library = op_library()
    if library is not None and _in_halves:
        return _reduce_in_halves(library, reducer, tensors)
    out: list = [None] * len(tensors)
    previous: list = []
    for k, bucket in enumerate(reducer.buckets):
        inputs = [tensors[i] for i in bucket]
        with tf.control_dependencies(previous):
            if library is not None:
                dtype_code, op_code = reducer.native_codes(k)
                results = library.tnt_allreduce(
                    inputs, dtype_code=dtype_code, op_code=op_code, bucket=k
                )
            else:

                def call(*arrays, _k=k):
                    return reducer.reduce_bucket(_k, list(arrays), reuse=True)

                results = tf.numpy_function(
                    call,
                    inputs,
                    Tout=[t.dtype for t in inputs],
                    stateful=True,
                    name="tnt_allreduce",
                )
        for i, r in zip(bucket, results, strict=True):
            r.set_shape(tensors[i].shape)
            out[i] = r
        previous = list(results)
    return out


def _reduce_in_halves(library: Any, reducer: ranks.FusedAllreduce, tensors: list) -> list:
    out: list = [None] * len(tensors)
    tickets: list = []
    for k, bucket in enumerate(reducer.buckets):
        dtype_code, op_code = reducer.native_codes(k)
        with tf.control_dependencies(tickets[-1:]):
            tickets.append(
                library.tnt_allreduce_start(
                    [tensors[i] for i in bucket], dtype_code=dtype_code, op_code=op_code, bucket=k
                )
            )
    previous = tickets[-1:]  # no finish waits before every start has posted
    for k, bucket in enumerate(reducer.buckets):
        with tf.control_dependencies(previous):
            results = library.tnt_allreduce_finish(tickets[k], [tensors[i] for i in bucket])
        for i, r in zip(bucket, results, strict=True):
            r.set_shape(tensors[i].shape)
            out[i] = r
        previous = list(results)
    return out


@contextlib.contextmanager
def collective_call(what: str) -> Iterator[None]:
    """Around a fit or evaluate, whose steps reduce through the engine.

    A collective that failed inside a step is re-raised as the rank API's exception
    (RankLostError, CollectiveTimeoutError, ...) with the engine's message, not as TensorFlow's
    graph error around it. Anything else that ends the call on this rank (a callback raising on
    the master rank only, Ctrl-C) aborts the collectives: the other ranks would otherwise wait
    in their step's allreduce, where no signal reaches them, until the collective timeout.
    """
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, tf.errors.OpError):
            match = _COLLECTIVE_ERROR.search(exc.message)
            if match is not None:
                raise getattr(ranks, match[1])(match[2]) from None
        ranks.abort_collectives(f"its {what} raised {type(exc).__name__}: {exc}")
        raise

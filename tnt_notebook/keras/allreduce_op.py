"""Fused gradient reduction inside the training step's graph.

Each fusion bucket becomes one ``TntAllreduce`` op (``native/tf_op.cpp``, compiled on first use for
this process's TensorFlow by :mod:`op_cache`), which calls the engine from TensorFlow's own thread:
a step never enters Python, and results are written in place into the gradients' buffers. Where the
op cannot be had (no compiler, a failed build: one warning says why), or with ``TNT_TF_OP=0``, each
bucket is a ``tf.numpy_function`` instead: same results, 0.15-0.25 ms more per bucket (measured).
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
    global _on_every_rank
    mine = _own_library() is not None
    if ranks.get_size() == 1:
        _on_every_rank = mine
        return
    ranks.barrier(timeout=op_cache.LONGEST_S + ranks.collective_timeout())
    without = np.zeros(ranks.get_size(), dtype=np.int32)
    without[ranks.get_rank()] = not mine
    without = np.flatnonzero(ranks.allreduce(without, op="sum")).tolist()
    _on_every_rank = not without
    if mine and without:
        warnings.warn(
            f"tnt: rank(s) {without} have no TensorFlow op (see their warning): every rank "
            "reduces gradients through tf.numpy_function, so that all ranks compute alike "
            "(same results, slower).",
            RuntimeWarning,
            stacklevel=2,
        )


def reduce_buckets(reducer: ranks.FusedAllreduce, tensors: list) -> list:
    """``tensors`` summed over all ranks: one collective per fusion bucket, chained by control
    dependencies so that every rank runs the buckets in plan order."""
    library = op_library()
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

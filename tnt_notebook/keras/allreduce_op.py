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

import tensorflow as tf

from tnt_notebook import ranks
from tnt_notebook.keras import op_cache

# How a failed collective shows in TensorFlow's error message, from the op or the fallback.
_COLLECTIVE_ERROR = re.compile(
    r"^(?:tnt_notebook\._native\.)?(Collective\w*Error|RankLostError): (.*)$", re.MULTILINE
)


@functools.cache
def op_library() -> Any:
    """TensorFlow's module of the op, bound to the engine; None where the fallback is used."""
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
    build, so that no rank waits out a collective's timeout for another's compile."""
    op_library()
    if ranks.get_size() > 1:
        ranks.barrier(timeout=op_cache.LONGEST_S + ranks.collective_timeout())


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

"""Fused gradient reduction inside the training step's graph.

Each fusion bucket becomes one ``TntAllreduce`` op (``native/tf_op.cpp``, compiled on first use for
this process's TensorFlow by :mod:`op_cache`), which calls the engine from TensorFlow's own thread:
a step never enters Python, and results are written in place into the gradients' buffers. Where the
op cannot be had (no compiler, a failed build: one warning says why), or with ``TNT_TF_OP=0``, each
bucket is a ``tf.numpy_function`` instead: same results, 0.15-0.25 ms more per bucket (measured).
Across nodes each bucket is two ops, ``TntAllreduceStart`` and ``TntAllreduceFinish``, so that
its exchange can travel during the rest of backprop (:meth:`Reduction.zeros_unless`,
:meth:`Reduction.reduce_buckets`), or on until the next step needs the weights
(:class:`DeferredReduction`, ``TNT_OVERLAP=steps``). How a world reduces is one
:class:`Reduction`, agreed by the ranks in :func:`prepare`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import itertools
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import tensorflow as tf

from tnt_notebook import settings
from tnt_notebook.keras import op_cache
from tnt_notebook.rank import api as ranks

# How a failed collective shows in TensorFlow's error message, from the op or the fallback.
_COLLECTIVE_ERROR = re.compile(
    r"^(?:tnt_notebook\._native\.)?(Collective\w*Error|RankLostError): (.*)$", re.MULTILINE
)


@dataclass(frozen=True)
class Reduction:
    """How every rank of this world reduces a step's gradient buckets: agreed once by
    :func:`prepare` and handed to the code that builds a step's graph, which must be the same
    graph on every rank."""

    #: TensorFlow's module of the op, bound to the engine; None: the ``tf.numpy_function``
    #: fallback (taken by every rank if some rank has no op: TensorFlow optimizes a step around
    #: the op and around ``tf.numpy_function`` differently, which changes the last bit of some
    #: updates and would let the ranks' models drift apart)
    library: Any
    #: each bucket in two ops, a start and a finish (across nodes, see :func:`_overlap`)
    in_halves: bool = False
    #: a step's gradient buckets finished by the next step (:class:`DeferredReduction`)
    across_steps: bool = False

    def defers_updates(self, model: Any) -> bool:
        """Whether ``model``'s steps leave their gradient buckets to the next step: across nodes
        with ``TNT_OVERLAP=steps``, one step per call of the train function (with Keras's
        ``steps_per_execution`` above 1 each step finishes its own)."""
        return self.across_steps and getattr(model, "steps_per_execution", 1) == 1

    def zeros_unless(self, condition: Any, tensors: list) -> list:
        """``tensors``, or their zeros where ``condition`` is false (a rank without samples).
        Where buckets are reduced in halves, each tensor is chosen on its own: one ``tf.cond``
        over the list would hold every gradient until backprop ends, and no bucket could start
        early. (A ``tf.cond`` passes the tensor on as it is; ``tf.where`` would copy every
        gradient, and fill its zeros, at every step.)"""
        if self.in_halves:
            return [
                tf.cond(condition, lambda t=t: t, lambda t=t: tf.zeros_like(t)) for t in tensors
            ]
        return tf.cond(condition, lambda: tensors, lambda: [tf.zeros_like(t) for t in tensors])

    def reduce_buckets(self, reducer: ranks.FusedAllreduce, tensors: list) -> list:
        """``tensors`` summed over all ranks: one collective per fusion bucket, chained by control
        dependencies so that every rank runs the buckets in plan order (with halves: the starts
        in plan order, then the finishes)."""
        library = self.library
        if self.in_halves:
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


def op_library() -> Any:
    """TensorFlow's module of the op that this world reduces with; None where it takes the
    fallback."""
    return prepare().library


@functools.cache
def _own_library() -> Any:
    """This process's op (found or built now), or None."""
    if not settings.TF_OP.read():
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
    bound = ctypes.CDLL(str(path)).tnt_bind(ctypes.c_void_p(ranks.native_core().c_api())) == 0
    return module if bound else None


@functools.cache
def prepare() -> Reduction:
    """How this world reduces, agreed before the first fit or evaluate of a process, ahead of
    any collective: the op is found or built (seconds, on some ranks only), then the ranks meet
    with a deadline that covers a build, so that no rank waits out a collective's timeout for
    another's compile, and learn whether every rank has it."""
    mine = _own_library() is not None
    if ranks.get_size() == 1:
        return Reduction(_own_library())
    ranks.barrier(timeout=op_cache.LONGEST_S + ranks.collective_timeout())
    size = ranks.get_size()
    # per rank: no op; then the ranks that want halves, and those that want them across steps
    flags = np.zeros(size + 2, dtype=np.int32)
    flags[ranks.get_rank()] = not mine
    overlap = _overlap()
    flags[size] = overlap != "0"
    flags[size + 1] = overlap == "steps"
    flags = ranks.allreduce(flags, op="sum")
    without = np.flatnonzero(flags[:size]).tolist()
    if mine and without:
        warnings.warn(
            f"tnt: rank(s) {without} have no TensorFlow op (see their warning): every rank "
            "reduces gradients through tf.numpy_function, so that all ranks compute alike "
            "(same results, slower).",
            RuntimeWarning,
            stacklevel=2,
        )
    in_halves = not without and int(flags[size]) == size
    return Reduction(
        None if without else _own_library(),
        in_halves=in_halves,
        across_steps=in_halves and int(flags[size + 1]) == size,
    )


def _overlap() -> str:
    """How far this rank would overlap a step's reduction, from ``TNT_OVERLAP``: ``"1"`` (the
    default) starts each bucket as soon as its gradients exist and finishes the buckets after the
    last start; ``"steps"`` leaves them to the next step, which finishes them just before its
    forward pass reads the weights; ``"0"`` reduces each bucket in one op after backprop. Only
    across nodes (where the engine may post an exchange) and with the op;
    ``TNT_ALLREDUCE_PATH=engine`` posts none."""
    value = settings.OVERLAP.read()
    if _own_library() is None or not ranks.engine_info()["overlaps_exchanges"]:
        return "0"
    return value


def _reduce_in_halves(library: Any, reducer: ranks.FusedAllreduce, tensors: list) -> list:
    tickets = start_buckets(library, reducer, tensors)
    return finish_buckets(library, reducer, tickets, tensors, after=tickets[-1:])


def start_buckets(library: Any, reducer: ranks.FusedAllreduce, tensors: list, after=()) -> list:
    """Tickets of ``reducer``'s buckets of ``tensors``, started in plan order after ``after``."""
    tickets: list = []
    for k, bucket in enumerate(reducer.buckets):
        dtype_code, op_code = reducer.native_codes(k)
        with tf.control_dependencies(tickets[-1:] or list(after)):
            tickets.append(
                library.tnt_allreduce_start(
                    [tensors[i] for i in bucket], dtype_code=dtype_code, op_code=op_code, bucket=k
                )
            )
    _backprop_after_each_start(tickets)
    return tickets


def _backprop_after_each_start(tickets: list) -> None:
    """Make the backprop that only later buckets need wait for each bucket's start.

    TensorFlow's executor is free to run a step's ops in any order their inputs allow; with one
    inter-op thread it runs the input gradients down to the first layer before any weight
    gradient, so every bucket would start as backprop ends and nothing of its transfer would be
    hidden. A control edge from bucket k's start to the first ops of what only buckets after k
    need makes the executor finish bucket k's gradients and post them first (in a step's trace,
    where the ops exist). No edge may close a cycle: its ops are no ancestors of that start, nor
    of any stateful op or user of a variable (the step's metric and loss updates: tf.function
    orders those by control edges of its own once the step is traced)."""
    if len(tickets) < 2 or tf.executing_eagerly():  # (one bucket: no backprop to order)
        return
    starts = [ticket.op for ticket in tickets]
    ordered = [  # what tf.function may order by edges of its own
        op
        for op in starts[0].graph.get_operations()
        if op._is_stateful or any(t.dtype == tf.resource for t in op.inputs)  # noqa: SLF001
    ]
    seen = _ancestors([op for op in ordered if op not in starts], set())
    _ancestors(starts[:1], seen)
    for before, start in itertools.pairwise(starts):
        later = {op for op in _ancestors([start], seen) if op is not start and _parents(op)}
        for op in later:  # (constants and the step's inputs need no edge)
            if not any(parent in later for parent in _parents(op)):
                op._add_control_input(before)  # noqa: SLF001 (as tf.function's own control deps)


def _parents(op: Any) -> list:
    return [t.op for t in op.inputs] + list(op.control_inputs)


def _ancestors(ops: list, seen: set) -> set:
    """What ``ops`` depend on, by data or control, and ``ops`` themselves, short of what is in
    ``seen``; all of it is then in ``seen`` too."""
    found, stack = set(), [op for op in ops if op not in seen]
    seen.update(stack)
    while stack:
        node = stack.pop()
        found.add(node)
        for parent in _parents(node):
            if parent not in seen:
                seen.add(parent)
                stack.append(parent)
    return found


def finish_buckets(
    library: Any, reducer: ranks.FusedAllreduce, tickets: list, tensors: list, after: list
) -> list:
    """``tensors`` summed over all ranks: the buckets that ``tickets`` started, finished in plan
    order after ``after`` (no finish may wait before every start of its batch has posted)."""
    out: list = [None] * len(tensors)
    previous = list(after)
    for k, bucket in enumerate(reducer.buckets):
        with tf.control_dependencies(previous):
            results = library.tnt_allreduce_finish(tickets[k], [tensors[i] for i in bucket])
        for i, r in zip(bucket, results, strict=True):
            r.set_shape(tensors[i].shape)
            out[i] = r
        previous = list(results)
    return out


def fusion_plan(plans: dict, kind: str, specs: list[tuple[tuple, Any]]) -> ranks.FusedAllreduce:
    """The fusion plan of tensors of ``specs`` for use ``kind``, kept in ``plans`` (collective:
    made on every rank alike, in fit or at the first trace)."""
    specs = [(s, tf.as_dtype(d).as_numpy_dtype) for s, d in specs]
    key = (kind, tuple((s, np.dtype(d).str) for s, d in specs))
    plan = plans.get(key)
    if plan is None:
        plan = plans[key] = ranks.FusedAllreduce(specs)
    return plan


class InOrder:
    """A step's small collectives (loss normalisers, gradients reduced in ``optimizer.apply``,
    metric states), each run after the one before it: TensorFlow would be free to run independent
    ops in any order, and every rank must call the engine in the same order."""

    def __init__(self, reduction: Reduction, plans: dict):
        self.reduction, self.plans = reduction, plans
        self.after: list = []

    def plan(self, kind: str, tensors: list) -> ranks.FusedAllreduce:
        """The fusion plan of ``tensors`` for use ``kind`` (see :func:`fusion_plan`)."""
        return fusion_plan(self.plans, kind, [(tuple(t.shape), t.dtype) for t in tensors])

    def sum_over_ranks(self, kind: str, tensors: list) -> list:
        """``tensors`` summed over all ranks, after every collective made before in this step."""
        with tf.control_dependencies(self.after):
            summed = self.reduction.reduce_buckets(self.plan(kind, tensors), tensors)
        self.after = summed[-1:]
        return summed

    def summing(self, kind: str) -> Callable[[tf.Tensor], tf.Tensor]:
        """``tensor -> tensor`` summed over the ranks, in this order."""
        return lambda t: self.sum_over_ranks(kind, [t])[0]

    def forget_other_graphs(self) -> None:
        """Order nothing after what another trace (or eager execution) left."""
        if tf.executing_eagerly() or any(
            t.graph is not tf.compat.v1.get_default_graph() for t in self.after
        ):
            self.after = []


class DeferredReduction:
    """A step's gradient buckets, started during its backprop and finished by the next step.

    Across nodes a step's last buckets (the first layers' gradients) exist only as backprop ends,
    and the first ones (the last layers': most of the bytes in typical models) a little earlier.
    Finishing them in the same step exposes whatever of their transfer backprop did not cover.
    Here the step ends after starting them; the next one finishes them, applies the update and
    only then reads the weights, so the transfer also overlaps Keras's work between the steps (the
    call of the train function, callbacks, the next batch). Every weight is updated before any
    step, evaluation or callback reads it (:meth:`~tnt_notebook.keras.model.Model.fit` applies
    what is pending before callbacks that read weights and at every epoch's end): the results are
    the same as finishing within the step. Metrics are reduced within their own step (a bucket
    started before the gradients' and finished after them).

    Between steps the state lives in variables: the gradients as they travel (a finish that the
    engine did not post reduces them then), the buckets' tickets, the divisor of the update
    (``sum(n_r)``), and whether an update is pending. Keeping it costs a step a few dozen
    small operations and a collective of its own for the metrics, which is why it is asked for
    (``TNT_OVERLAP=steps``): it pays where the transfer outlasts what backprop hides, on a slow
    link (docs/allreduce-paths.md has the figures).
    """

    def __init__(
        self, library: Any, reducer: ranks.FusedAllreduce, specs: list[tuple[tuple, tf.DType]]
    ):
        self.library, self.reducer, self.specs = library, reducer, specs
        self.values = [tf.Variable(tf.zeros(s, d), trainable=False) for s, d in specs]
        self.tickets = [tf.Variable(0, dtype=tf.int64, trainable=False) for _ in reducer.buckets]
        self.divisor = tf.Variable(0.0, trainable=False)
        self.pending = tf.Variable(False, trainable=False)
        self._flush: Any = None

    def keep(self, tensors: list, tickets: list, divisor: tf.Tensor) -> None:
        """In a step: what its started buckets need to be finished by the next."""
        for v, t in zip(self.values, tensors, strict=True):
            v.assign(t)
        for v, t in zip(self.tickets, tickets, strict=True):
            v.assign(t)
        self.divisor.assign(divisor)
        self.pending.assign(True)

    def apply_pending(self, apply: Any, after: list) -> tf.Tensor:
        """In a step (after ``after``, its batch) or by itself: finish what the previous step
        started and ``apply(reduced, divisor)`` (the update), where an update is pending."""

        def finish() -> tf.Tensor:
            with tf.control_dependencies(after):
                values = [tf.identity(v.value()) for v in self.values]
            tickets = [v.value() for v in self.tickets]
            finished = finish_buckets(self.library, self.reducer, tickets, values, after=values)
            apply(finished, self.divisor)
            self.pending.assign(False)
            return tf.constant(True)

        return tf.cond(self.pending, finish, lambda: tf.constant(False))

    def flush(self, apply: Any) -> None:
        """Between steps: apply the pending update now (before anything reads the weights)."""
        if not bool(self.pending.numpy()):
            return
        if self._flush is None:
            self._flush = tf.function(lambda: self.apply_pending(apply, after=[]))
        self._flush()

    def discard(self) -> None:
        """After a failed step: nothing is pending any more (the engine abandoned its calls)."""
        self.pending.assign(False)


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

"""``tnt.reproducibility_report``: does this model, on this data, train to the same bits on one
rank as on all of them?

A check users run in one cell before trusting a comparison across allocations: a few steps are
trained on every rank of the cluster, then the same steps from the same state on the master rank
alone (the other ranks take no samples, so the master computes what a 1-rank world computes), and
the weights and the steps' logs are compared bit by bit. The model is put back as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import keras
import numpy as np

from tnt_notebook.keras import backup, compat
from tnt_notebook.rank import api as ranks


def reproducibility_report(
    model: keras.Model,
    x: Any,
    y: Any = None,
    sample_weight: Any = None,
    *,
    batch_size: int = 32,
    steps: int = 3,
) -> dict:
    """Train ``steps`` global batches of ``x``/``y`` (arrays; or a ``tf.data.Dataset`` of global
    batches as ``x``) on all ranks and on the master rank alone, from the model's present state,
    and compare. Call it on every rank (collective), on a compiled ``tnt.Model(...,
    reproducible=True)``; every rank gets the same dict: ``identical`` (every weight and every
    logged value the same bits), ``ranks``, ``steps``, ``weights`` (values compared),
    ``differing_weights``, ``largest_difference``, ``differing_logs`` (names of logged values
    that differ) and ``summary``, one sentence."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps must be a positive integer, got {steps!r}")
    if getattr(model, "_tnt", None) is None or model._tnt.reproducible is None:
        raise ValueError(
            "reproducibility_report checks a model trained reproducibly: tnt.Model(model, "
            "reproducible=True) (the default mode adds the ranks' gradients in an order that "
            "depends on the number of ranks, so its bits differ from 1 rank's)"
        )
    batches = _global_batches(x, y, sample_weight, batch_size, steps)
    model._tnt_begin_on_batch("reproducibility_report", *batches[0])
    state = [v for kind in backup.training_state(model).values() for v in kind]
    saved = [np.array(v.numpy()) for v in state]
    try:
        on_all = _trained(model, batches)
        _assign(state, saved)
        with _on_master_alone(model):
            on_master = _trained(model, batches)
    finally:
        _assign(state, saved)
    return _compared(on_master, on_all, len(batches))


def _global_batches(x: Any, y: Any, sample_weight: Any, batch_size: int, steps: int) -> list:
    """The first ``steps`` global batches, as numpy (``(x, y, sample_weight)`` each), the master
    rank's on every rank (a dataset may shuffle each rank's way)."""
    import tensorflow as tf

    batches = None
    if ranks.is_master_rank():
        if isinstance(x, tf.data.Dataset):
            elements = x.take(steps).as_numpy_iterator()
            batches = [compat.unpack_x_y_sample_weight(e) for e in elements]
        else:
            n = len(tf.nest.flatten(x)[0])
            rows = [slice(lo, lo + batch_size) for lo in range(0, n, batch_size)][:steps]
            batches = [tuple(_rows(part, s) for part in (x, y, sample_weight)) for s in rows]
    batches = ranks.broadcast(batches)
    if not batches:
        raise ValueError("reproducibility_report: the data holds no batch")
    return batches


def _rows(part: Any, rows: slice) -> Any:
    import tensorflow as tf

    return None if part is None else tf.nest.map_structure(lambda t: np.asarray(t[rows]), part)


def _trained(model: keras.Model, batches: list) -> tuple[list[np.ndarray], list[dict]]:
    logs = [model.train_on_batch(bx, by, bw, return_dict=True) for bx, by, bw in batches]
    return model.get_weights(), logs


@contextlib.contextmanager
def _on_master_alone(model: keras.Model) -> Iterator[None]:
    """Steps traced for the master rank alone (the others' slices empty), then as before."""
    model._tnt.master_alone = True
    compat.reset_step_functions(model)
    try:
        yield
    finally:
        model._tnt.master_alone = False
        compat.reset_step_functions(model)


def _assign(state: list, values: list[np.ndarray]) -> None:
    for v, a in zip(state, values, strict=True):
        v.assign(a)


def _bits(a: np.ndarray) -> np.ndarray:
    """Each value's bits as an unsigned integer (NaN equals the same NaN)."""
    return np.frombuffer(np.ascontiguousarray(a).tobytes(), f"u{a.dtype.itemsize}")


def _compared(alone: tuple, together: tuple, steps: int) -> dict:
    (weights_1, logs_1), (weights_n, logs_n) = alone, together
    differing, largest, total = 0, 0.0, 0
    for a, b in zip(weights_1, weights_n, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        total += a.size
        apart = _bits(a) != _bits(b)
        if apart.any():
            differing += int(np.count_nonzero(apart))
            gap = np.abs(a.astype(np.float64) - b.astype(np.float64)).reshape(-1)[apart]
            largest = max(largest, float(np.nanmax(gap)) if not np.isnan(gap).all() else np.nan)
    differing_logs = sorted(
        {
            key
            for one, many in zip(logs_1, logs_n, strict=True)
            for key in one
            if np.asarray(one[key]).tobytes() != np.asarray(many[key]).tobytes()
        }
    )
    size = ranks.get_size()
    identical = differing == 0 and not differing_logs
    if identical:
        summary = (
            f"The same bits on 1 rank and on {size} after {steps} step(s): all {total:,} weight "
            "values and every logged value."
        )
    else:
        logs = f"; logged values {', '.join(differing_logs)}" if differing_logs else ""
        summary = (
            f"Different bits on 1 rank and on {size} after {steps} step(s): {differing:,} of "
            f"{total:,} weight values (largest difference {largest:.3g}){logs}. Something in "
            "the model depends on the ranks: see the reproducibility guide for what stays "
            "outside the reproducible mode."
        )
    return {
        "identical": identical,
        "ranks": size,
        "steps": steps,
        "weights": total,
        "differing_weights": differing,
        "largest_difference": largest,
        "differing_logs": differing_logs,
        "summary": summary,
    }

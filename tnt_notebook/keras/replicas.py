"""The ranks' copies of the model: alike after every fit, checked, never repaired silently."""

from __future__ import annotations

import zlib

import keras
import numpy as np

from tnt_notebook.keras import compat
from tnt_notebook.rank import api as ranks


class ReplicaDivergenceError(RuntimeError):
    """The ranks' copies of the model differ: a bug (ours, or state that a layer keeps outside its
    weights' updates), never repaired silently."""


def check(model: keras.Model, when: str, trainable_only: bool = False) -> None:
    """Raise ReplicaDivergenceError naming the ranks and weights that differ from the
    master's (collective)."""
    if ranks.get_size() == 1:
        return
    weights = model.trainable_weights if trainable_only else model.weights
    checksum = np.array(
        [zlib.crc32(np.ascontiguousarray(w.numpy()).tobytes()) for w in weights],
        dtype=np.float64,
    )
    master = ranks.broadcast(checksum)
    differs = np.zeros((ranks.get_size(), len(weights)), dtype=np.int32)
    differs[ranks.get_rank()] = checksum != master
    differs = ranks.allreduce(differs, op="sum")
    if differs.any():
        bad_ranks = np.flatnonzero(differs.any(axis=1)).tolist()
        names = [weights[i].path for i in np.flatnonzero(differs.any(axis=0))]
        raise ReplicaDivergenceError(
            f"tnt: after {when}, the weights of rank(s) {bad_ranks} differ from the master "
            f"rank's in {', '.join(names)}"
        )


def finish_fit(model: keras.Model) -> None:
    """Average the statistics that ranks computed each of their own samples (the moving
    moments of BatchNormalization layers that trained, per rank), then check that all ranks
    hold the same model. Nothing else is touched: frozen weights stay bit for bit, and a
    reproducible model's statistics are the same bits on every rank already."""
    if ranks.get_size() == 1:
        return
    reproducible = model._tnt.reproducible is not None
    nontrainable = [] if reproducible else compat.per_rank_statistics(model)
    if nontrainable:
        averaged = ranks.FusedAllreduce(
            [(tuple(v.shape), np.dtype(v.dtype)) for v in nontrainable]
        ).allreduce([np.asarray(v.numpy()) for v in nontrainable], op="average")
        for v, a in zip(nontrainable, averaged, strict=True):
            v.assign(a)
    check(model, "fit")


class EpochCheck(keras.callbacks.Callback):
    """Compares the ranks' trainable weights at every epoch end (``TNT_CHECK_REPLICAS=epoch``)."""

    def on_epoch_end(self, epoch, logs=None):
        check(self.model, f"epoch {epoch}", trainable_only=True)

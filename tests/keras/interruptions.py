"""Shared by the mpiexec workers that resume a fit: a callback that fails a fit on purpose."""

from __future__ import annotations

import keras

import tnt_notebook as tnt


class Interrupt(keras.callbacks.Callback):
    """Fails at (epoch, batch end) on ``rank`` (the others' collectives then abort), or on every
    rank at once (``rank`` None)."""

    def __init__(self, epoch: int, batch: int, rank: int | None = None):
        super().__init__()
        self.at, self.rank = (epoch, batch), rank
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.rank in (None, tnt.get_rank()) and (self.epoch, batch) == self.at:
            raise RuntimeError("interrupted on purpose")

"""The timeline in a fit (:mod:`tnt_notebook.rank.timeline`): the callback around its sampled
steps, and the marks inside the train step.

The marks are ``TntTimelineMark`` ops in the step's graph (``native/tf_op.cpp``): each records
the time its inputs exist while the engine records, and passes them on (what uses them runs after
the mark: TensorFlow's executor may run an op whose outputs nobody waits for late). Off, a mark
costs an inline op's call (0.15 µs measured), so a traced step keeps them whether or not the
timeline is on. Without the op (``TNT_TF_OP=0``, no compiler) a step has no marks: its input
pipeline counts as compute and its update as other work.
"""

from __future__ import annotations

from typing import Any

import keras

from tnt_notebook.rank import timeline


def mark(library: Any, label: int, tensors: list) -> list:
    """In a step's graph: ``tensors``, passed on once the time they exist is recorded
    (``library``: the op's module; None: no mark)."""
    if library is None:
        return tensors
    return library.tnt_timeline_mark(tensors, label=label)


class Recorder(keras.callbacks.Callback):
    """Around a fit's sampled steps: when each was called and returned, and the gathering after
    the fit (on every rank)."""

    reads_weights_each_batch = False  # (where updates are deferred: it reads no weights)

    def __init__(self, steps: int):
        super().__init__()
        self.recorder = timeline.Recorder(steps)

    def on_train_batch_begin(self, batch, logs=None):
        self.recorder.begin_step()

    def on_train_batch_end(self, batch, logs=None):
        self.recorder.end_step()

    def on_train_end(self, logs=None):
        self.recorder.finish()


def added_to(callbacks: list) -> list:
    """A fit's callbacks, with the recorder first where the timeline is on."""
    steps = timeline.recording_steps()
    return [Recorder(steps), *callbacks] if steps else callbacks

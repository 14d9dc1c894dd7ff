"""Keras's ``BackupAndRestore`` on many ranks: no training lost when a rank or a host dies.

``tnt.Model.fit`` replaces a ``keras.callbacks.BackupAndRestore`` (same arguments) by
:class:`TrainingBackup`, which backs up everything that decides how training continues, so that a
rerun of the same ``fit`` goes on exactly where the backup was taken:

- the model's variables (weights, BatchNorm statistics, dropout seed states), the optimizer's (its
  slots and its iteration count, hence the learning-rate schedule's position) and, for a backup
  within an epoch, the metric states of the epoch so far;
- the epoch and the step within it, and the History of the finished epochs.

The master rank writes one file, atomically (``saving.write_atomically``), so the latest backup
is always whole; it alone reads it at the next ``fit`` and broadcasts the state, so the hosts need
no shared filesystem. A resumed ``fit`` sees its data as the uninterrupted one did: its dataset is
a fresh pipeline whose per-epoch shuffles are fast-forwarded to the resumed epoch, and the steps
of that epoch that came before the backup are skipped (read, not trained on).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import warnings
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import keras
import numpy as np

from tnt_notebook.keras import compat, saving
from tnt_notebook.rank import api as ranks

FORMAT = 1
LATEST = "tnt-backup.npz"


class BackupError(RuntimeError):
    """A backup that cannot be used (corrupt, or of another model)."""


@dataclass
class ResumePoint:
    """Where a backup was taken, and the state to continue from."""

    epoch: int
    step: int
    since_save: int
    history: dict[str, list]
    metric_states: list[np.ndarray] = field(default_factory=list)


def training_state(model: keras.Model) -> dict[str, list]:
    """The state a backup holds, by kind (metric states matter within an epoch only)."""
    return {
        "model": list(model.variables),
        "optimizer": list(model.optimizer.variables) if model.optimizer is not None else [],
        "metrics": compat.metric_variables(model),
    }


class TrainingBackup(keras.callbacks.Callback):
    """Backs up on the master rank, restores on every rank; made by ``tnt.Model.fit`` from the
    user's ``keras.callbacks.BackupAndRestore`` (``backup_dir``, ``save_freq``,
    ``double_checkpoint``, ``delete_checkpoint``)."""

    def __init__(
        self,
        backup_dir: str,
        save_freq: Any = "epoch",
        double_checkpoint: bool = False,
        delete_checkpoint: bool = True,
    ):
        super().__init__()
        if save_freq != "epoch" and not (isinstance(save_freq, int) and save_freq > 0):
            raise ValueError(f"save_freq must be 'epoch' or a positive integer, got {save_freq!r}")
        self.backup_dir = os.fspath(backup_dir)
        self.save_freq = save_freq
        self.double_checkpoint = double_checkpoint
        self.delete_checkpoint = delete_checkpoint
        self.path = os.path.join(self.backup_dir, LATEST)
        self.previous_path = self.path + ".bkp"
        self.point: ResumePoint | None = None
        self.history: keras.callbacks.History | None = None
        self._epoch = 0
        self._step = 0
        self._since_save = 0
        self._epoch_history: dict[str, list] = {}

    @property
    def reads_weights_each_batch(self) -> bool:
        """Whether it may back up between two steps (see ``tnt.Model.fit``'s deferred updates)."""
        return self.save_freq != "epoch"

    @classmethod
    def from_keras(cls, callback: keras.callbacks.BackupAndRestore) -> TrainingBackup:
        return cls(
            callback.backup_dir,
            callback.save_freq,
            callback.double_checkpoint,
            callback.delete_checkpoint,
        )

    # -- restoring (before Keras's loop starts; collective) ------------------------------------
    def restore(self, model: keras.Model) -> ResumePoint | None:
        """Read the latest usable backup on the master rank and load it into ``model`` on every
        rank; None when there is none (a first run)."""
        state = saving.on_ranks(self._read, f"reading the backup in {self.backup_dir}",
                                master_only=True)  # fmt: skip
        state = ranks.broadcast(state)
        if state is None:
            return None
        meta, arrays = state
        variables = training_state(model)
        for kind in ("model", "optimizer"):
            if [tuple(v.shape) for v in variables[kind]] != [a.shape for a in arrays[kind]]:
                raise BackupError(
                    f"the backup in {self.backup_dir} holds another model's state ({kind} "
                    "variables differ): use a new backup_dir for a different model or optimizer"
                )
            for v, a in zip(variables[kind], arrays[kind], strict=True):
                v.assign(a)
        self.point = ResumePoint(
            epoch=meta["epoch"],
            step=meta["step"],
            since_save=meta["since_save"],
            history=meta["history"],
            metric_states=arrays["metrics"] if meta["step"] else [],
        )
        return self.point

    def _read(self) -> tuple[dict, dict] | None:
        for path in (self.path, self.previous_path):
            if not os.path.exists(path):
                continue
            try:
                return _load(path)
            except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
                if path == self.path and os.path.exists(self.previous_path):
                    warnings.warn(
                        f"tnt: the latest backup {path} is unusable ({exc}); resuming from the "
                        f"previous one, {self.previous_path}",
                        stacklevel=2,
                    )
                    continue
                raise BackupError(
                    f"the backup {path} is unusable ({type(exc).__name__}: {exc}); remove "
                    f"{self.backup_dir} to train from the start"
                ) from exc
        return None

    # -- Keras's loop ------------------------------------------------------------------------
    def on_train_begin(self, logs=None):
        point = self.point
        self._epoch = point.epoch if point else 0
        self._step = point.step if point else 0
        self._since_save = point.since_save if point else 0
        self._epoch_history = {k: list(v) for k, v in (point.history if point else {}).items()}

    def on_epoch_begin(self, epoch, logs=None):
        point = self.point
        if point is not None and epoch == point.epoch:
            if self.history is not None and not self.history.epoch:
                self.history.epoch.extend(range(epoch))
            metrics = training_state(self.model)["metrics"]
            for v, a in zip(metrics, point.metric_states, strict=False):
                v.assign(a)  # the epoch so far (Keras reset the metrics just before)
        else:
            self._step = 0
        self._epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.point is not None and self._epoch == self.point.epoch and batch < self.point.step:
            return  # a step skipped on resuming: already counted in the backup
        added = batch + 1 - self._step
        self._step = batch + 1
        if self.save_freq == "epoch":
            return
        self._since_save += added
        if self._since_save >= self.save_freq:
            self._since_save = 0
            self._save(self._epoch, self._step)

    def on_epoch_end(self, epoch, logs=None):
        for k, v in (logs or {}).items():
            self._epoch_history.setdefault(k, []).append(float(v))
        self.point = None  # later epochs run whole
        self._step = 0
        if self.save_freq == "epoch":
            self._save(epoch + 1, 0)

    def on_train_end(self, logs=None):
        if self.history is not None and not self.history.epoch and self._epoch_history:
            self.history.epoch.extend(range(len(next(iter(self._epoch_history.values())))))
        if self.delete_checkpoint and ranks.is_master_rank():
            shutil.rmtree(self.backup_dir, ignore_errors=True)

    # -- writing (master rank) -----------------------------------------------------------------
    def _save(self, epoch: int, step: int) -> None:
        if not ranks.is_master_rank():
            return
        variables = training_state(self.model)
        meta = {
            "format": FORMAT,
            "epoch": epoch,
            "step": step,
            "since_save": self._since_save,
            "history": self._epoch_history,
            "counts": {kind: len(vs) for kind, vs in variables.items()},
        }
        arrays = {
            f"{kind}/{i}": np.asarray(v.numpy())
            for kind, vs in variables.items()
            for i, v in enumerate(vs)
        }
        os.makedirs(self.backup_dir, exist_ok=True)
        if self.double_checkpoint and os.path.exists(self.path):
            os.replace(self.path, self.previous_path)
        saving.write_atomically(
            lambda temporary: _write(temporary, meta, arrays), self.path, overwrite=True
        )


def _write(path: str, meta: dict, arrays: dict[str, np.ndarray]) -> None:
    with open(path, "wb") as f:  # a file object: np.savez would append ".npz" to a name
        np.savez(f, meta=np.array(json.dumps(meta)), **arrays)
        f.flush()
        os.fsync(f.fileno())


def _load(path: str) -> tuple[dict, dict]:
    """(metadata, arrays by kind) of a backup file; raises if it is damaged (the archive's CRCs
    are checked) or not one of ours."""
    with open(path, "rb") as f:
        data = f.read()
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        meta = json.loads(str(npz["meta"]))
        if meta.get("format") != FORMAT:
            raise ValueError(f"unknown backup format {meta.get('format')!r}")
        arrays = {
            kind: [npz[f"{kind}/{i}"] for i in range(count)]
            for kind, count in meta["counts"].items()
        }
    return meta, arrays


def take_backup_callback(callbacks: Any) -> tuple[list, TrainingBackup | None]:
    """The callbacks without Keras's BackupAndRestore, and the stand-in for it (at most one)."""
    callbacks = list(callbacks or [])
    found = [cb for cb in callbacks if isinstance(cb, keras.callbacks.BackupAndRestore)]
    if len(found) > 1:
        raise ValueError("fit takes at most one BackupAndRestore callback")
    rest = [cb for cb in callbacks if cb not in found]
    return rest, TrainingBackup.from_keras(found[0]) if found else None


def resume(
    training_backup: TrainingBackup,
    model: keras.Model,
    dataset: Any,
    initial_epoch: int,
    steps_per_epoch: int | None,
) -> tuple[int, int]:
    """Restore ``model`` from the latest backup, if any, and bring the History and ``dataset``'s
    shuffles to where it was taken; returns the epoch and the step within it to resume at."""
    point = training_backup.restore(model)
    history = training_backup.history = keras.callbacks.History()
    if point is None:
        return initial_epoch, 0
    history.history = {k: list(v) for k, v in point.history.items()}
    _fast_forward(dataset, compat.keras_iterators(point.epoch - initial_epoch, steps_per_epoch))
    return point.epoch, point.step


@contextlib.contextmanager
def skipping_trained_steps(model: keras.Model, steps: int) -> Iterator[None]:
    """Around a resumed fit: Keras's train function, except that its first calls only read the
    ``steps`` batches that the resumed epoch had trained on before its backup (their metrics
    are restored); Keras's own is given back after."""
    if not steps:
        yield
        return
    model.make_train_function()  # (Keras returns it only when it was made before)
    train_function = model.train_function
    remaining = steps

    def resuming(iterator):
        nonlocal remaining
        if remaining <= 0:
            return train_function(iterator)
        for _ in range(min(model.steps_per_execution, remaining)):
            next(iterator)
        remaining -= model.steps_per_execution
        return model.get_metrics_result()

    model.train_function = resuming
    try:
        yield
    finally:
        if model.train_function is not train_function:
            model.train_function = train_function


def _fast_forward(dataset: Any, iterators: int | None) -> None:
    """Advance a fresh pipeline's per-epoch randomness (reshuffling) as if Keras had made
    ``iterators`` iterators of it (an iterator draws its epoch's order when it is made); None:
    unknown (``steps_per_epoch`` given), with a warning."""
    if iterators is None:
        warnings.warn(
            "tnt: resuming with steps_per_epoch, whose epochs share an iterator: the data order "
            "after the backup may differ from an uninterrupted run's",
            stacklevel=4,
        )
        return
    for _ in range(iterators):
        iter(dataset)

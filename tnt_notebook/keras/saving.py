"""Files on many ranks: who writes, who reads, and how every rank learns that one of them failed.

Saving writes on the master rank only (every rank with ``tnt_save_all_devices``), each file
atomically: into a temporary file beside it, then renamed, so a crash never leaves half a file
under the name. Loading reads on the master rank only and hands the bytes to the others, so the
hosts of a cluster need no shared filesystem. A failure on any rank raises on every rank, naming
the rank and its error.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tnt_notebook.rank import api as ranks


class RankOperationError(RuntimeError):
    """What a rank raises when an operation that all ranks make together failed on another."""


def on_ranks(fn: Callable[[], Any], what: str, *, master_only: bool) -> Any:
    """``fn()`` on the master rank (or on every rank); then every rank learns which ranks failed.

    A rank whose ``fn`` raised re-raises its own exception; the others raise
    :class:`RankOperationError` naming the failed ranks and their errors.
    """
    error: BaseException | None = None
    result = None
    if not master_only or ranks.is_master_rank():
        try:
            result = fn()
        except Exception as exc:  # noqa: BLE001 - re-raised below, on every rank
            error = exc
    size = ranks.get_size()
    if size > 1:
        rank = ranks.get_rank()
        failed = np.zeros(size, dtype=np.int32)
        failed[rank] = error is not None
        failed_ranks = np.flatnonzero(ranks.allreduce(failed, op="sum")).tolist()
        reasons = [
            ranks.broadcast(f"{type(error).__name__}: {error}" if r == rank else None, root=r)
            for r in failed_ranks
        ]
        others = [(r, why) for r, why in zip(failed_ranks, reasons, strict=True) if r != rank]
        if error is None and others:
            raise RankOperationError(
                f"{what} failed on " + "; ".join(f"rank {r} ({why})" for r, why in others)
            )
        if error is not None and others:
            error.add_note(
                f"{what} also failed on " + ", ".join(f"rank {r} ({why})" for r, why in others)
            )
    if error is not None:
        raise error
    return result


def write_atomically(write: Callable[[str], Any], filepath: Any, overwrite: bool) -> None:
    """``write(temporary path)`` and rename it to ``filepath``; the temporary keeps the name's
    ending (Keras chooses the format by it) and is removed if the write fails."""
    path = os.fspath(filepath)
    if not overwrite and os.path.exists(path):
        raise FileExistsError(f"{path} exists and overwrite=False")
    head, base = os.path.split(path)
    temporary = os.path.join(head, f".tnt-{uuid.uuid4().hex[:12]}-{base}")
    try:
        write(temporary)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def save_on_ranks(
    write: Callable[[str], Any], filepath: Any, what: str, overwrite: bool, all_devices: bool
) -> None:
    """Saving as Tarantella does: the master rank writes ``filepath`` (with ``all_devices``, every
    rank writes the path it passed); every rank returns once the write is done or raises."""
    on_ranks(
        lambda: write_atomically(write, filepath, overwrite),
        f"{what}({os.fspath(filepath)!r})",
        master_only=not all_devices,
    )


def load_on_ranks(load: Callable[[str], Any], filepath: Any, what: str) -> Any:
    """``load(path)`` on every rank from the bytes of the master rank's ``filepath``: the other
    ranks load a private copy, so their hosts need not see the file."""
    path = os.fspath(filepath)
    if ranks.get_size() == 1:
        return load(path)
    label = f"{what}({path!r})"
    data = on_ranks(lambda: Path(path).read_bytes(), label, master_only=True)
    data = ranks.broadcast(data)
    if ranks.is_master_rank():
        return on_ranks(lambda: load(path), label, master_only=False)
    with tempfile.TemporaryDirectory(prefix="tnt-load-") as private:  # owner-only (0700)
        copy = os.path.join(private, os.path.basename(path))
        Path(copy).write_bytes(data)
        return on_ranks(lambda: load(copy), label, master_only=False)


class AtomicSaves:
    """Keras's ``save`` and ``save_weights``, each writing a temporary file renamed over the
    target, so that what the master rank's callbacks (ModelCheckpoint) write is whole or absent."""

    def save(self, filepath: Any, overwrite: bool = True, **kwargs: Any) -> None:
        save = super().save
        write_atomically(lambda path: save(path, **kwargs), filepath, overwrite)

    def save_weights(self, filepath: Any, overwrite: bool = True, **kwargs: Any) -> None:
        save_weights = super().save_weights
        write_atomically(lambda path: save_weights(path, **kwargs), filepath, overwrite)


class SavesOnRanks:
    """``tnt.Model``'s saving and loading, made by the ranks together (a mixin before the Keras
    model class)."""

    def load_weights(self, filepath: Any, *args: Any, **kwargs: Any) -> None:
        """Keras's load_weights on every rank, from the master rank's file (hosts need not share
        a filesystem)."""
        load = super().load_weights
        load_on_ranks(lambda path: load(path, *args, **kwargs), filepath, "load_weights")
        self._tnt.weights_synced = True

    def save(
        self,
        filepath: Any,
        overwrite: bool = True,
        tnt_save_all_devices: bool = False,
        **kwargs: Any,
    ) -> None:
        """Keras's save, by the master rank only (by every rank, to the path each passed, with
        ``tnt_save_all_devices``); the file appears whole or not at all."""
        self._tnt_save_on_ranks("save", filepath, overwrite, tnt_save_all_devices, kwargs)

    def save_weights(
        self,
        filepath: Any,
        overwrite: bool = True,
        tnt_save_all_devices: bool = False,
        **kwargs: Any,
    ) -> None:
        """Keras's save_weights, written as :meth:`save` writes."""
        self._tnt_save_on_ranks("save_weights", filepath, overwrite, tnt_save_all_devices, kwargs)

    def _tnt_save_on_ranks(
        self, what: str, filepath: Any, overwrite: bool, all_devices: bool, kwargs: dict
    ) -> None:
        write = getattr(self._tnt_plain(), what)  # (the plain model's: atomic, not collective)
        save_on_ranks(lambda path: write(path, **kwargs), filepath, what, overwrite, all_devices)

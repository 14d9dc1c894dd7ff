"""TensorFlow's logs on the ranks: a ``%%tnt`` cell shows what the user's code prints.

TensorFlow logs from C++ straight to the process's stderr, which an engine forwards into the
cell. Its level is ``TF_CPP_MIN_LOG_LEVEL`` (0 all, 1 no INFO, 2 no WARNING, 3 no ERROR), which a
rank starts with as the cluster's ``--log-level`` asks (:func:`log_environment`; default: errors
only), unless the user set it. Some lines ignore it: those that TensorFlow's libraries write while
they load, before their logging is initialised ("All log messages before absl::InitializeLog()",
"oneDNN custom operations are on", "Could not find cuda drivers"), and the ERROR of the CUDA
probe on a machine without a GPU driver ("failed call to cuInit"). So on a rank, TensorFlow's
first import and its GPU probe run with the process's stderr captured (:func:`quiet_import`);
what they wrote is passed on at the same level, without the probe's errors where it found no GPU.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import logging
import os
import re
import sys
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

from tnt_notebook import settings

#: TF_CPP_MIN_LOG_LEVEL for each --log-level; None: the default, errors only.
CPP_LEVELS = {"DEBUG": "0", "INFO": "0", "WARNING": "1", "ERROR": "2", "CRITICAL": "3", None: "2"}
_SEVERITY = {"I": 0, "W": 1, "E": 2, "F": 3}
_LOG_LINE = re.compile(r"^([IWEF])\d{4} [\d:.]+ +\d+ \S+:\d+\] ")
_BEFORE_INIT = "WARNING: All log messages before absl::InitializeLog() is called"


def log_environment(log_level: str | None, environ: Mapping[str, str] = os.environ) -> dict:
    """The logging variables a rank starts with: TensorFlow's C++ level from the cluster's
    ``--log-level``, unless the user set ``TF_CPP_MIN_LOG_LEVEL`` (then theirs is inherited)."""
    if "TF_CPP_MIN_LOG_LEVEL" in environ:
        return {}
    return {"TF_CPP_MIN_LOG_LEVEL": CPP_LEVELS[log_level]}


def passed_on(captured: str, min_level: int) -> str:
    """The lines of ``captured`` to show at ``min_level``: log lines below it are dropped with
    their continuation lines, and so is the notice about logging before initialisation unless
    everything is shown."""
    kept: list[str] = []
    keep = True
    for line in captured.splitlines(keepends=True):
        match = _LOG_LINE.match(line)
        if match is not None:
            keep = _SEVERITY[match[1]] >= min_level
        elif line.startswith(_BEFORE_INIT):
            keep = min_level == 0
        if keep:  # any other line continues the one before
            kept.append(line)
    return "".join(kept)


def cpp_level(environ: Mapping[str, str] = os.environ) -> int:
    try:
        return max(0, min(3, int(environ.get("TF_CPP_MIN_LOG_LEVEL", "0"))))
    except ValueError:
        return 0


@contextlib.contextmanager
def _captured_stderr() -> Iterator[list[str]]:
    """The process's file descriptor 2 redirected into a temporary file; yields a list that holds
    the text written once the block ends."""
    sys.stderr.flush()
    saved = os.dup(2)
    out: list[str] = []
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield out
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            out.append(tmp.read().decode(errors="replace"))


def _import_quietly(load: Any) -> None:
    """Runs TensorFlow's import (``load``), then its GPU probe, with stderr captured."""
    level = cpp_level()
    try:
        with _captured_stderr() as during_import:
            load()
    except BaseException:  # a failed import: everything it wrote may tell why
        sys.stderr.write("".join(during_import))
        raise
    import tensorflow as tf

    with _captured_stderr() as during_probe:
        gpus = tf.config.list_physical_devices("GPU")
    # without a GPU the probe's errors only say so: fatal lines alone pass
    shown = passed_on(during_import[0], level) + passed_on(during_probe[0], level if gpus else 3)
    if shown:  # through Python's stream: an engine sends it with the cell's output, in order
        sys.stderr.write(shown)
        sys.stderr.flush()
    logging.getLogger("tensorflow").setLevel(settings.LOG_LEVEL.read() or "ERROR")


class _QuietLoader(importlib.abc.Loader):
    """TensorFlow's own loader, its module executed by :func:`_import_quietly`."""

    def __init__(self, loader: Any, finder: _QuietFinder) -> None:
        self.loader, self.finder = loader, finder

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self.finder)
        _import_quietly(lambda: self.loader.exec_module(module))


class _QuietFinder(importlib.abc.MetaPathFinder):
    """Finds ``tensorflow`` as the path finder does, and wraps its loader."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "tensorflow":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _QuietLoader(spec.loader, self)
        return spec


def quiet_import() -> None:
    """On a rank, before user code: TensorFlow's first import, wherever it happens (``import
    keras`` too), runs with its start-up lines passed on at the level the rank was given."""
    if "tensorflow" not in sys.modules and not any(
        isinstance(f, _QuietFinder) for f in sys.meta_path
    ):
        sys.meta_path.insert(0, _QuietFinder())

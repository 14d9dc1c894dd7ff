"""tnt_notebook: Tarantella's data-parallel Keras API, run on ipyparallel ranks from a notebook.

Importing this package is cheap: TensorFlow, Keras and MPI are loaded on first use of the
attribute that needs them.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    # rank API (MPI starts on first call, not at import)
    "init": "tnt_notebook.rank.api",
    "get_rank": "tnt_notebook.rank.api",
    "get_size": "tnt_notebook.rank.api",
    "get_master_rank": "tnt_notebook.rank.api",
    "is_master_rank": "tnt_notebook.rank.api",
    "barrier": "tnt_notebook.rank.api",
    "broadcast": "tnt_notebook.rank.api",
    "allreduce": "tnt_notebook.rank.api",
    "empty": "tnt_notebook.rank.api",
    "FusedAllreduce": "tnt_notebook.rank.api",
    "timeline": "tnt_notebook.rank.timeline",
    "timeline_summary": "tnt_notebook.rank.timeline",
    # Keras wrapper (TensorFlow is imported here, on first use)
    "Model": "tnt_notebook.keras.model",
    "Sequential": "tnt_notebook.keras.model",
    "ParallelStrategy": "tnt_notebook.keras.model",
    "Compression": "tnt_notebook.keras.compression",
    "distributed_optimizer": "tnt_notebook.keras.distributed_optimizer",
    "reproducibility_report": "tnt_notebook.keras.reproducibility_report",
}
_LAZY_MODULES = {"models": "tnt_notebook.keras.models", "keras": "tnt_notebook.keras"}

__all__ = [*_LAZY, *_LAZY_MODULES, "load_ipython_extension", "unload_ipython_extension"]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _LAZY_MODULES:
        value = importlib.import_module(_LAZY_MODULES[name])
    else:
        raise AttributeError(f"module 'tnt_notebook' has no attribute {name!r}")
    # Kept as a module attribute: later lookups (``tnt.allreduce`` in a loop) skip this function,
    # whose import machinery costs as much as a small collective.
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


def load_ipython_extension(ipython: Any) -> None:
    """Register the %tnt_cluster and %%tnt magics (``%load_ext tnt_notebook``)."""
    from tnt_notebook.notebook.magics import load_ipython_extension as load

    load(ipython)


def unload_ipython_extension(ipython: Any) -> None:
    """Stop a running cluster and unregister the magics (``%reload_ext`` support)."""
    from tnt_notebook.notebook.magics import unload_ipython_extension as unload

    unload(ipython)

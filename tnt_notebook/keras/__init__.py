"""Keras 3 integration: ``tnt.Model``, ``tnt.models`` and ``tnt.keras.callbacks``.

TensorFlow is imported on first use of these names (never at ``import tnt_notebook``, nor by
``python -m tnt_notebook.keras.op_cache`` before it has chosen TensorFlow's log level).
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["Compression", "Model", "ParallelStrategy", "Sequential", "callbacks"]


def __getattr__(name: str) -> Any:
    if name == "callbacks":
        return importlib.import_module("tnt_notebook.keras.callbacks")
    if name == "Compression":
        return importlib.import_module("tnt_notebook.keras.compression").Compression
    if name in __all__:
        return getattr(importlib.import_module("tnt_notebook.keras.model"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

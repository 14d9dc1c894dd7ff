"""Keras 3 integration: ``tnt.Model``, ``tnt.models`` and ``tnt.keras.callbacks``.

TensorFlow is imported here (never at ``import tnt_notebook``).
"""

from tnt_notebook.keras import callbacks
from tnt_notebook.keras.model import Model, ParallelStrategy, Sequential

__all__ = ["Model", "ParallelStrategy", "Sequential", "callbacks"]

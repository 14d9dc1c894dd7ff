"""Gradient compression: ``tnt.Model(model, compression=tnt.Compression.fp16)`` sends gradients
across the ranks in 16 bits, half the bytes of float32, as Horovod's
``compression=hvd.Compression.fp16`` does. For training whose steps wait on a slow link between
hosts; on one host, or on a fast link, it only adds the casts.

Each rank sends ``n_r * g_r`` (its micro-batch's size times its mean gradient); the engine sums
16-bit values in float32 and rounds once per host; the sum comes back in the variables' dtype
before the optimizer sees it. ``fp16`` keeps 11 significant bits but overflows beyond 65504 (a
gradient element times the micro-batch size); ``bf16`` keeps 8 bits and float32's range.
Metric states always travel exactly (float32).
"""

from __future__ import annotations

import enum
from typing import Any

import tensorflow as tf


class Compression(enum.Enum):
    """How gradients travel between ranks: ``none`` (their own dtype), ``fp16`` or ``bf16``."""

    none = "none"
    fp16 = "fp16"
    bf16 = "bf16"

    @classmethod
    def of(cls, value: Any) -> Compression:
        """``value`` as a Compression: a member, its name, or None (``none``)."""
        if isinstance(value, cls):
            return value
        if value is None:
            return cls.none
        try:
            return cls(value)
        except ValueError:
            names = ", ".join(repr(c.value) for c in cls)
            raise ValueError(
                f"compression must be tnt.Compression.none, .fp16 or .bf16 (or {names}), "
                f"got {value!r}"
            ) from None

    @property
    def dtype(self) -> tf.DType | None:
        return {"fp16": tf.float16, "bf16": tf.bfloat16}.get(self.value)

    def wire_dtype(self, dtype: tf.DType) -> tf.DType:
        """The dtype in which a gradient of ``dtype`` travels."""
        return self.dtype if self.dtype is not None and _wide_float(dtype) else dtype

    def compress(self, tensors: list) -> list:
        """Floating tensors wider than 16 bits, cast to this compression's dtype."""
        if self.dtype is None:
            return tensors
        return [tf.cast(t, self.dtype) if _wide_float(t.dtype) else t for t in tensors]

    def decompress(self, tensors: list, like: list) -> list:
        """``tensors`` back in the dtypes of ``like`` (what :meth:`compress` was given)."""
        pairs = zip(tensors, like, strict=True)
        return [t if t.dtype == u.dtype else tf.cast(t, u.dtype) for t, u in pairs]


def _wide_float(dtype: tf.DType) -> bool:
    return dtype.is_floating and dtype.size > 2

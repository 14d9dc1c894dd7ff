"""The view: ``tnt.Model(keras_model)`` is the same model seen through a class of our own.

The view's class is made at run time, once per Keras model class: a subclass of both
``tnt.Model`` and the model's own class (``Functional``, ``Sequential`` or the user's subclass)
under the model's class name, so that Keras serializes and revives it as the model's own. The
view shares the model's ``__dict__`` (layers, weights, optimizer, compiled metrics): nothing is
copied, and what ``tnt.Model`` keeps besides (:class:`State`) lives in that ``__dict__`` too.
"""

from __future__ import annotations

from typing import Any

import keras

from tnt_notebook.keras import allreduce_op, compat, reproducible, saving
from tnt_notebook.keras.compression import Compression
from tnt_notebook.rank import api as ranks


class State:
    """What a tnt.Model keeps besides the Keras model's own state (one per wrapped model)."""

    def __init__(self) -> None:
        # the fusion plans of the model's collectives, by use and tensor specs
        self.reducers: dict[Any, ranks.FusedAllreduce] = {}
        # whether the batches are global (then each step slices this rank's micro-batch)
        self.slice_train = False
        self.slice_test = False
        self.validation_slices: bool | None = None  # slice_test of the running fit's validation
        self.weights_synced = False
        self.in_step = False  # tracing our own step: calling the model under a tape is ours
        self.compression = Compression.none  # how gradients travel (tnt.Model(compression=))
        self.keras_model: keras.Model | None = None  # the wrapped model (the same state)
        # the gradient buckets that each step leaves to the next (None: each step finishes its own)
        self.deferred: allreduce_op.DeferredReduction | None = None
        # how a reproducible model cuts its global batches (None: the default mode)
        self.reproducible: reproducible.Chunks | None = None
        # a reproducibility report's run on the master rank alone (the others take no samples)
        self.master_alone = False


def state_of(model: keras.Model) -> State:
    """``model``'s :class:`State`, made on first use (straight into the shared ``__dict__``: not a
    Keras-tracked attribute)."""
    state = model.__dict__.get("_tnt_state")
    if state is None:
        state = model.__dict__["_tnt_state"] = State()
    return state


_VIEW_CLASSES: dict[type, type] = {}
_PLAIN_CLASSES: dict[type, type] = {}


def _impersonating(mixin: type, base: type, cache: dict[type, type], **namespace: Any) -> type:
    """A subclass of ``mixin`` and ``base`` under ``base``'s name and module (made once per
    class), so that Keras serializes its objects as ``base``'s and revives them as such."""
    cls = cache.get(base)
    if cls is None:
        namespace |= {"__module__": base.__module__, "__qualname__": base.__qualname__}
        cls = cache[base] = type(base.__name__, (mixin, base), namespace)
        compat.share_registered_name(cls, base)
    return cls


def register(base: type, cls: type) -> None:
    """Make ``cls`` (a class written out, as ``tnt.Sequential``) the view class of ``base``."""
    _VIEW_CLASSES[base] = cls


def view_class(model_class: type, base: type) -> type:
    """The subclass of ``model_class`` (``tnt.Model``) for Keras model class ``base``."""
    return _impersonating(
        model_class, base, _VIEW_CLASSES, _tnt_base=base, __doc__=model_class.__doc__
    )


def view_of(model: keras.Model, cls: type) -> Any:
    """An object of class ``cls`` sharing ``model``'s state."""
    view = object.__new__(cls)
    object.__setattr__(view, "__dict__", model.__dict__)
    return view


def plain(model: keras.Model) -> keras.Model:
    """The wrapped model as plain Keras (whose saves are atomic): for serializing, and for the
    callbacks that run on the master rank alone (whose saves must not be collective)."""
    return view_of(model, _impersonating(saving.AtomicSaves, model._tnt_base, _PLAIN_CLASSES))

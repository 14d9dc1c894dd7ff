"""``tnt.models``: Keras's model (de)serialization functions, returning ``tnt.Model`` objects."""

from __future__ import annotations

from typing import Any

import keras

from tnt_notebook.keras import compat
from tnt_notebook.keras.model import Model, _collective_call, write_on_ranks


def _unwrap(model: Any) -> keras.Model:
    return model.model if isinstance(model, Model) else model


def save_model(
    model: Any,
    filepath: Any,
    overwrite: bool = True,
    tnt_save_all_devices: bool = False,
    **kwargs: Any,
) -> None:
    """Save on the master rank (or every rank, see ``rank_path``); returns once it is written."""
    inner = _unwrap(model)
    write_on_ranks(
        lambda path, **kw: keras.models.save_model(inner, path, **kw),
        filepath,
        overwrite,
        tnt_save_all_devices,
        kwargs,
    )


def load_model(
    filepath: Any, custom_objects: Any = None, compile: bool = True, safe_mode: bool = True
) -> Model:
    """Load on every rank: a tnt.Model, compiled if it was saved compiled (and compile=True)."""
    loaded = _collective_call(
        lambda: keras.models.load_model(
            filepath, custom_objects=custom_objects, compile=compile, safe_mode=safe_mode
        ),
        master_only=False,
    )
    model = Model(loaded)
    model._tnt_sync_weights()
    return model


def model_from_config(config: dict, custom_objects: Any = None) -> Model:
    """A new (uncompiled) model from ``{"class_name": ..., "config": ...}`` as tf.keras took it."""
    if not isinstance(config, dict) or "class_name" not in config:
        raise TypeError(
            "model_from_config expects {'class_name': ..., 'config': ...} "
            "(e.g. json.loads(model.to_json())), not a bare get_config() dict"
        )
    return Model(compat.model_from_config(config, custom_objects=custom_objects))


def model_from_json(json_string: str, custom_objects: Any = None) -> Model:
    return Model(keras.models.model_from_json(json_string, custom_objects=custom_objects))


def clone_model(model: Any, *args: Any, **kwargs: Any) -> Model:
    """Keras's clone_model (new weights, not compiled) of a Keras model or tnt.Model."""
    return Model(keras.models.clone_model(_unwrap(model), *args, **kwargs))

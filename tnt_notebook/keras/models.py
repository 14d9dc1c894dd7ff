"""``tnt.models``: Keras's model (de)serialization functions, returning ``tnt.Model`` objects."""

from __future__ import annotations

from typing import Any

import keras

from tnt_notebook.keras import compat, saving
from tnt_notebook.keras.model import NO_YAML, Model


def _plain(model: Any) -> keras.Model:
    return model._tnt_plain() if isinstance(model, Model) else model


def save_model(
    model: Any,
    filepath: Any,
    overwrite: bool = True,
    tnt_save_all_devices: bool = False,
    **kwargs: Any,
) -> None:
    """Save a Keras model or tnt.Model as :meth:`tnt_notebook.keras.model.Model.save` does (call on
    every rank)."""
    plain = _plain(model)
    saving.save_on_ranks(
        lambda path: keras.models.save_model(plain, path, **kwargs),
        filepath,
        "save_model",
        overwrite,
        tnt_save_all_devices,
    )


def load_model(
    filepath: Any, custom_objects: Any = None, compile: bool = True, safe_mode: bool = True
) -> Model:
    """A tnt.Model (compiled if it was saved compiled, and ``compile``) on every rank, read from
    the master rank's file (hosts need not share a filesystem)."""
    loaded = saving.load_on_ranks(
        lambda path: keras.models.load_model(
            path, custom_objects=custom_objects, compile=compile, safe_mode=safe_mode
        ),
        filepath,
        "load_model",
    )
    return Model(loaded)


def model_from_config(config: dict, custom_objects: Any = None) -> Model:
    """A new (uncompiled) tnt.Model from ``model.get_config()``, or from a
    ``{"class_name": ..., "config": ...}`` dict as tf.keras took it."""
    return Model(compat.model_from_config(config, custom_objects=custom_objects))


def model_from_json(json_string: str, custom_objects: Any = None) -> Model:
    """A new (uncompiled) tnt.Model from ``model.to_json()``."""
    return Model(keras.models.model_from_json(json_string, custom_objects=custom_objects))


def model_from_yaml(yaml_string: str, custom_objects: Any = None) -> Model:
    """Tarantella's ``model_from_yaml``: Keras 3 has no YAML configs."""
    raise NotImplementedError(NO_YAML)


def clone_model(model: Any, *args: Any, **kwargs: Any) -> Model:
    """Keras's clone_model (new weights, not compiled) of a Keras model or tnt.Model."""
    keras_model = model.model if isinstance(model, Model) else model
    return Model(keras.models.clone_model(keras_model, *args, **kwargs))

"""The device a rank trains on, taken on the rank before TensorFlow is imported.

Under ``TNT_GPU_PER_RANK`` (the launch rules, :mod:`tnt_notebook.cluster.devices`, found a GPU for
every rank) the rank narrows ``CUDA_VISIBLE_DEVICES`` to the GPU of its node-local index among
those the node offers: all of them, or those ``CUDA_VISIBLE_DEVICES`` already names (as Slurm or
the user set it: subdivided, never widened). TensorFlow then sees one GPU, ``/GPU:0``, and grows
its memory there as it needs (``TF_FORCE_GPU_ALLOW_GROWTH``, exported by the launchers).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping, MutableMapping

from tnt_notebook import settings

# the node-local index as each launcher tells it: Hydra, Open MPI, srun (one task per rank)
_LOCAL_INDEX = ("MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "SLURM_LOCALID")
_WORLD_RANK = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")


def node_local_index(environ: MutableMapping[str, str] = os.environ) -> int:
    """This rank's index among the ranks of its node, as the launcher says, before MPI starts
    (``TNT_RANKS_PER_NODE``, which makes every k consecutive ranks a node, counts too)."""
    per_node = settings.RANKS_PER_NODE.read(environ)
    if per_node:
        world = next((environ[k] for k in _WORLD_RANK if environ.get(k)), "0")
        return int(world) % per_node
    return int(next((environ[k] for k in (*_LOCAL_INDEX, "PMI_RANK") if environ.get(k)), "0"))


def keep_own_gpu(environ: MutableMapping[str, str] = os.environ) -> str | None:
    """Under ``TNT_GPU_PER_RANK``, leave only this rank's GPU in ``CUDA_VISIBLE_DEVICES``; the
    value it has then (None: unset, every GPU visible). RuntimeError (one line) when the node
    offers no GPU for this rank's index."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if not settings.GPU_PER_RANK.read(environ):
        return visible
    local = node_local_index(environ)
    if visible is None:
        chosen = str(local)
    else:
        entries = [e.strip() for e in visible.split(",")]
        if local >= len(entries) or not entries[local]:
            raise RuntimeError(
                f"node-local rank {local} has no GPU of its own: this node offers "
                f"CUDA_VISIBLE_DEVICES={visible!r}"
            )
        chosen = entries[local]
    environ["CUDA_VISIBLE_DEVICES"] = chosen
    return chosen


def in_words(visible: str | None) -> str:
    """What a rank's ``CUDA_VISIBLE_DEVICES`` leaves it, in words (status, progress)."""
    if visible is None:
        return "every GPU"
    return "CPU" if not visible.strip() else f"GPU {visible}"


def ranks_devices(environ: Mapping[str, str] = os.environ) -> str:
    """What every rank of the world trains on, as this rank can tell (the launch rules give all
    ranks alike): ``"CPU"``, ``"one GPU each (NAME)"`` (its model from the node's inventory, where
    it names one) or what ``CUDA_VISIBLE_DEVICES`` leaves each; for the progress summary."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if not settings.GPU_PER_RANK.read(environ):
        cpu = visible is not None and not visible.strip()
        return "CPU" if cpu else f"{in_words(visible)} visible to each"
    from tnt_notebook.cluster.gpu_inventory import offered

    try:
        inventory = list(_node_gpus(settings.GPU_INVENTORY.read(environ)))
    except ValueError:  # (an unreadable recorded listing: the GPU goes unnamed)
        inventory = []
    names = {g.name for g in offered(inventory, visible)} or {g.name for g in inventory}
    return f"one GPU each ({names.pop()})" if len(names) == 1 else "one GPU each"


@functools.cache
def _node_gpus(recorded: str) -> tuple:
    """The node's GPUs, probed once per process (a node's GPUs stay; nvidia-smi takes time)."""
    from tnt_notebook.cluster.gpu_inventory import probe

    return tuple(probe({settings.GPU_INVENTORY.name: recorded} if recorded else {}))

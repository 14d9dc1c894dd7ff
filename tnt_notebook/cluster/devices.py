"""The launch rules for devices, Tarantella's: how many ranks each node runs and whether they train
on GPUs, from the GPUs the nodes offer (:mod:`tnt_notebook.cluster.gpu_inventory`).

- ranks per node not given: one rank per GPU of the node; no GPUs: one rank per node (inside
  Slurm: the tasks it grants) on the CPU, with a warning outside Slurm;
- ranks per node given: each rank takes a GPU of its own when the node offers enough; more ranks
  than GPUs: a warning, and every rank runs on the CPU; no GPUs at all: the CPU, silently;
- nodes offering different numbers of GPUs: an error before anything starts;
- ``--no-gpu``: the CPU, silently.

Each rank then keeps the GPU of its node-local index itself, before TensorFlow is imported
(:mod:`tnt_notebook.rank.device`).
"""

from __future__ import annotations

from dataclasses import dataclass

from tnt_notebook.cluster.errors import PlanError
from tnt_notebook.cluster.gpu_inventory import Gpu


@dataclass(frozen=True)
class Devices:
    """What the rules chose: ranks per node, and each node's GPUs in the order its ranks take
    them by node-local index (None: every rank on the CPU); the warning, if any."""

    per_node: int
    gpus: dict[str, list[Gpu]] | None
    warning: str = ""

    def gpu_of(self, host: str, local_index: int) -> Gpu | None:
        """The GPU of the rank with `local_index` on `host` (None: the CPU)."""
        if self.gpus is None or host not in self.gpus:
            return None
        gpus = self.gpus[host]
        return gpus[local_index] if local_index < len(gpus) else None

    def of(self, host: str, local_index: int) -> str:
        """That rank's device, in words."""
        gpu = self.gpu_of(host, local_index)
        return "CPU" if gpu is None else str(gpu)

    @property
    def summary(self) -> str:
        """The ranks' devices in a few words (the cluster's ready line)."""
        return "one GPU per rank" if self.gpus is not None else "on the CPU"


def choose_devices(
    offered: dict[str, list[Gpu] | str],
    requested: int | None,
    no_gpu: bool = False,
    cpu_default: int = 1,
    warn_without_gpus: bool = True,
) -> Devices:
    """The rules above: `offered` is each host's GPUs (or why it could not say), `requested` the
    ranks per node the user gave (None: not given), `cpu_default` the ranks per node without
    GPUs."""
    if no_gpu:
        return Devices(requested or cpu_default, None)
    known = {h: g for h, g in offered.items() if not isinstance(g, str)}
    counts = {h: len(g) for h, g in known.items()}
    if len(set(counts.values())) > 1:
        listed = ", ".join(f"{h}: {c}" for h, c in counts.items())
        raise PlanError(
            f"the nodes offer different numbers of GPUs ({listed}); ranks per node follow the "
            "GPUs, so the nodes must be alike: give hosts with as many GPUs each, or --no-gpu"
        )
    gpus = next(iter(counts.values()), 0)
    unknown = {h: why for h, why in offered.items() if isinstance(why, str)}
    if gpus and unknown:
        host, why = next(iter(unknown.items()))
        raise PlanError(f"cannot read the GPUs of host {host}: {why}")
    if requested is None:
        if gpus:
            return Devices(gpus, known)
        hosts = ", ".join(offered)
        warning = (
            f"no GPUs found on {hosts}: {cpu_default} rank(s) per node on the CPU "
            "(--no-gpu runs on the CPU without this warning)"
        )
        return Devices(cpu_default, None, warning if warn_without_gpus else "")
    if not gpus:
        return Devices(requested, None)
    if requested <= gpus:
        return Devices(requested, known)
    return Devices(
        requested,
        None,
        f"{requested} rank(s) per node but only {gpus} GPU(s) on each node: every rank runs on "
        "the CPU (--no-gpu runs on the CPU without this warning)",
    )

"""The GPUs a node offers, read in one place: the recorded listing that ``TNT_GPU_INVENTORY``
names (``nvidia-smi -L``'s lines, so that machines without GPUs run the same code as a GPU node),
else ``nvidia-smi -L``, else the driver's ``/proc/driver/nvidia/gpus``; none where nothing
answers. Which of them a rank may use is what ``CUDA_VISIBLE_DEVICES`` leaves (:func:`offered`).

Run as ``python -m tnt_notebook.cluster.gpu_inventory`` on another host (through ssh or srun), it
prints that host's GPUs in ``nvidia-smi -L``'s form, which :func:`parse_listing` reads back: the
same probe on every host, wherever it runs.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from tnt_notebook import settings
from tnt_notebook.cluster.hostfile import is_local_host
from tnt_notebook.cluster.processes import run_on_hosts

PROBE_TIMEOUT = 15.0  # seconds the probe of one host may take (ssh, Python, nvidia-smi)
_LINE = re.compile(r"^GPU (\d+): (.*?)(?: \(UUID: ([^)]*)\))?\s*$")
_PROC_GPUS = Path("/proc/driver/nvidia/gpus")


@dataclass(frozen=True)
class Gpu:
    """One GPU as ``nvidia-smi -L`` names it: its index on the node, model and UUID."""

    index: int
    name: str
    uuid: str = ""

    def listing_line(self) -> str:
        return f"GPU {self.index}: {self.name} (UUID: {self.uuid})"

    def __str__(self) -> str:
        return f"GPU {self.index} ({self.name})"


def parse_listing(text: str) -> list[Gpu]:
    """The GPUs of an ``nvidia-smi -L`` listing (its MIG lines are left out)."""
    found = (_LINE.match(line.strip()) for line in text.splitlines())
    return [Gpu(int(m[1]), m[2], m[3] or "") for m in found if m]


def probe(environ: Mapping[str, str] = os.environ) -> list[Gpu]:
    """This machine's GPUs (a one-line ValueError when the recorded listing cannot be read)."""
    recorded = settings.GPU_INVENTORY.read(environ)
    if recorded:
        try:
            return parse_listing(Path(recorded).read_text())
        except OSError as e:
            raise ValueError(f"{settings.GPU_INVENTORY.name}={recorded!r}: {e.strerror}") from None
    nvidia_smi = shutil.which("nvidia-smi")
    if nvidia_smi is not None:
        try:
            r = subprocess.run(
                [nvidia_smi, "-L"], capture_output=True, text=True, timeout=PROBE_TIMEOUT
            )
        except (OSError, subprocess.TimeoutExpired):
            return []
        return parse_listing(r.stdout) if r.returncode == 0 else []
    return _from_driver()


def _from_driver() -> list[Gpu]:
    """The driver's own list, in PCI bus order as nvidia-smi numbers them (no nvidia-smi here)."""
    gpus = []
    for i, info in enumerate(sorted(_PROC_GPUS.glob("*/information"))):
        lines = info.read_text(errors="replace").splitlines()
        fields = dict(line.split(":", 1) for line in lines if ":" in line)
        gpus.append(Gpu(i, fields.get("Model", "").strip(), fields.get("GPU UUID", "").strip()))
    return gpus


def offered(gpus: list[Gpu], visible: str | None) -> list[Gpu]:
    """The GPUs that ``CUDA_VISIBLE_DEVICES`` = `visible` leaves, in its order (all when it is
    unset): indices or UUIDs, read as CUDA reads them, up to the first that names no GPU."""
    if visible is None:
        return list(gpus)
    out = []
    for entry in (e.strip() for e in visible.split(",")):
        gpu = next((g for g in gpus if entry in (str(g.index), g.uuid) and entry), None)
        if gpu is None:
            break
        out.append(gpu)
    return out


def node_inventories(
    hosts: list[str], remote_command: Callable[[str, list[str]], list[str]], python: str
) -> dict[str, list[Gpu] | str]:
    """Each host's GPUs, probed on that host (this machine's in this process, the others' with
    `remote_command`, at once, each bounded): a list, or why the other host could not say (the
    launch then fails there with its own report); ValueError when this machine's recorded
    listing cannot be read."""
    found: dict[str, list[Gpu] | str] = {}
    argv = [python, "-m", __name__]
    recorded = settings.GPU_INVENTORY.read()
    if recorded:  # the recorded listing is read on each host, from its own path there
        argv = ["env", f"{settings.GPU_INVENTORY.name}={recorded}", *argv]
    remote = {h: remote_command(h, argv) for h in hosts if not is_local_host(h)}
    for h in hosts:
        if h not in remote:
            found[h] = probe()
    for r in run_on_hosts(remote, PROBE_TIMEOUT) if remote else []:
        why = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        found[r.host] = parse_listing(r.stdout) if r.returncode == 0 else why
    return {h: found[h] for h in hosts}


def main() -> int:
    """Print this host's GPUs as ``nvidia-smi -L`` does (for the launcher on another host)."""
    try:
        gpus = probe()
    except ValueError as e:
        print(e, file=sys.stderr)
        return 1
    print("\n".join(g.listing_line() for g in gpus))
    return 0


if __name__ == "__main__":
    sys.exit(main())

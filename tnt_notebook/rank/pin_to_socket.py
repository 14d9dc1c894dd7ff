"""``python -m tnt_notebook.rank.pin_to_socket -- CMD...``: how a rank starts under
``--pin-to-socket``: CMD (the rank's own command) bound to one NUMA node with numactl."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from tnt_notebook.rank.device import node_local_index


def main(argv: list[str]) -> None:
    """Exec the command after ``--`` under numactl, bound to the NUMA node of this rank's
    local index."""
    cmd = argv[argv.index("--") + 1 :]
    local = node_local_index()
    nodes = sorted(Path("/sys/devices/system/node").glob("node[0-9]*")) or [Path("node0")]
    node = int(nodes[local % len(nodes)].name[4:])
    numactl = shutil.which("numactl")
    if numactl is None:
        sys.exit("tnt_notebook: --pin-to-socket needs numactl on every host")
    os.execv(numactl, [numactl, f"--cpunodebind={node}", f"--membind={node}", *cmd])


if __name__ == "__main__":
    main(sys.argv)

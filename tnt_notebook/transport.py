"""The transport between nodes: MPI, or GASPI (GPI-2) in builds that found GPI-2.

Ranks are always started by ``mpiexec`` and always reduce through shared memory inside a node; the
transport carries only the step between nodes. It is chosen per cluster (``%tnt_cluster
--transport gaspi``, which exports ``TNT_TRANSPORT`` to the ranks) or per process
(``TNT_TRANSPORT``), and read when a rank's engine is built. Shared by the launchers, which check
a choice against the ranks' build before starting them, and the ranks.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping, Sequence

from tnt_notebook import settings

TRANSPORTS = settings.TRANSPORT.kind

# MPICH's UCX netmod (the mpich wheel's default) crashes a rank that sends to a peer whose endpoint
# has failed (it writes through the null request of the failed send, in MPI_Isend and in the sends
# of its own collectives), and UCX fails the endpoints of a host that stopped answering once TCP
# keepalive gives up on their connections (UCX_TCP_KEEPIDLE, 10 s): the survivors of a host cut off
# would crash in their next collective instead of raising. Every wait of ours is bounded, so ranks
# run with keepalive off, unless the user set it.
MPI_ENV_DEFAULTS = {"UCX_TCP_KEEPIDLE": "inf"}


def mpi_env_defaults(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The variables of MPI_ENV_DEFAULTS that ``environ`` does not set (MPI reads them when it
    initialises)."""
    return {k: v for k, v in MPI_ENV_DEFAULTS.items() if k not in environ}


def require(name: str, built: Sequence[str]) -> None:
    """A one-line ValueError unless transport ``name`` is among those ``built``."""
    if name not in TRANSPORTS:
        raise ValueError(f"unknown transport {name!r}; use {' or '.join(TRANSPORTS)}")
    if name not in built:
        raise ValueError(
            f"the {name.upper()} transport is not available: this tnt_notebook was built without "
            "GPI-2 (install GPI-2, then reinstall tnt_notebook against it: docs/guide/gaspi.md)"
        )


def built_transports(python: str) -> tuple[str, ...]:
    """The transports of the native core that ``python`` (the ranks' interpreter) imports, asked in
    a process of its own: the notebook kernel never loads the core (nor initialises MPI)."""
    code = (
        "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
        "from tnt_notebook import _native; print(' '.join(_native.TRANSPORTS))"
    )
    try:
        out = subprocess.run(
            [python, "-c", code], capture_output=True, text=True, timeout=60, check=True
        )
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or str(e)
        last = detail.strip().splitlines()[-1] if detail.strip() else type(e).__name__
        raise ValueError(f"cannot load tnt_notebook's native core with {python}: {last}") from None
    return tuple(out.stdout.split())

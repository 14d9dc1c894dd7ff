"""Removing MPI shared-memory segments that a killed world left behind.

MPICH keeps its `mpich_shm_*` segments in /dev/shm until MPI_Finalize, so every rank that is
killed, aborts or calls os._exit leaks a few MB there. Our own segments never leak (they are
unlinked as soon as every local rank has mapped them); this sweep is for MPICH's, run after a
world was torn down by force.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")
MPI_SEGMENT_PREFIXES = ("mpich_shm_",)


def _mapped_shm_names() -> set[str]:
    """Names of /dev/shm files that some process we can inspect still maps."""
    names: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            text = maps.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            i = line.find("/dev/shm/")
            if i >= 0:
                names.add(line[i + len("/dev/shm/") :].split(" ")[0])
    return names


def remove_orphaned_mpi_segments(min_age_s: float = 5.0) -> list[str]:
    """Unlink this user's MPI segments that no process maps and that are older than `min_age_s`.

    The age guard leaves alone a segment that a starting world has created but not mapped yet.
    Returns the names removed.
    """
    if not SHM_DIR.is_dir():
        return []
    uid, now = os.getuid(), time.time()
    candidates = []
    for p in SHM_DIR.iterdir():
        if not p.name.startswith(MPI_SEGMENT_PREFIXES):
            continue
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if st.st_uid == uid and now - st.st_mtime >= min_age_s:
            candidates.append(p)
    if not candidates:
        return []
    mapped = _mapped_shm_names()
    removed = []
    for p in candidates:
        if p.name not in mapped:
            try:
                p.unlink()
                removed.append(p.name)
            except FileNotFoundError:
                pass
    return removed

"""What a killed world leaves on a host, and removing it; runs on every host of a cluster.

MPICH keeps its `mpich_shm_*` segments in /dev/shm until MPI_Finalize, so every rank that is
killed, aborts or calls os._exit leaks a few MB there; Hydra's proxy leaves its hwloc file in the
temporary directory; on a host whose temporary directory is not the notebook's, the engines made
their own copy of the cluster's profile directory. Our own segments never leak (they are unlinked
as soon as every local rank has mapped them).

Two ways it is removed:

* :func:`watch_ranks` runs detached on every host, started by the host's first rank when the
  cluster is ready: once the ranks there and their proxy have ended, however they ended (stop,
  crash, a SIGKILLed kernel, a host cut off), it removes exactly what they left.
* ``python -m tnt_notebook.cluster.cleanup ranks`` (``%tnt_cluster cleanup``, ``tnt-run --cleanup``,
  through ssh on each host) ends this user's ranks of clusters other than the ones kept, with
  their proxies, and sweeps what nobody uses any more.
"""

from __future__ import annotations

import argparse
import json
import os
import select
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tnt_notebook.cluster.hostfile import is_local_host
from tnt_notebook.cluster.processes import run_on_hosts

if TYPE_CHECKING:
    from tnt_notebook.cluster.plan import LaunchPlan

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


#: MPICH creates, sizes and maps a segment in one call (``MPL_initshm_open``,
#: ``MPL_shm_seg_create_and_attach``): one that nobody maps this long after it was sized is
#: nobody's.
CREATION_GRACE_S = 0.5


def remove_orphaned_mpi_segments() -> list[str]:
    """Unlink this user's MPI segments that no process maps; returns the names removed.

    An unmapped segment sized less than :data:`CREATION_GRACE_S` ago is looked at again once that
    has passed (a sweep waits at most that long; segments that live worlds map cost no wait):
    its creator may not have mapped it yet. A world killed within a second of its start leaves
    segments that young, and they go too.
    """
    if not SHM_DIR.is_dir():
        return []
    uid = os.getuid()
    candidates = []
    for p in SHM_DIR.iterdir():
        if not p.name.startswith(MPI_SEGMENT_PREFIXES):
            continue
        try:
            st = p.stat()
        except FileNotFoundError:
            continue
        if st.st_uid == uid:
            candidates.append((p, st.st_mtime))
    if not candidates:
        return []
    mapped = _mapped_shm_names()
    orphans = [(p, sized) for p, sized in candidates if p.name not in mapped]
    if not orphans:
        return []
    wait = max(sized for _, sized in orphans) + CREATION_GRACE_S - time.time()
    if wait > 0:  # (the young ones' creators may map them meanwhile)
        time.sleep(min(wait, CREATION_GRACE_S))
        mapped = _mapped_shm_names()
    removed = []
    for p, _ in orphans:
        if p.name not in mapped:
            try:
                p.unlink()
                removed.append(p.name)
            except FileNotFoundError:
                pass
    return removed


def remove_orphaned_mpi_files() -> list[str]:
    """What worlds killed without MPI_Finalize left that nobody uses: MPICH segments and Hydra
    hwloc files (:func:`remove_orphaned_mpi_segments`, :func:`remove_orphaned_hwloc_files`)."""
    return remove_orphaned_mpi_segments() + remove_orphaned_hwloc_files()


PROFILE_PREFIX = "tnt-cluster-"
OWNER_FILE = "owner"  # in the notebook's own profile directory only, never in a host's copy
_HWLOC_PREFIX = "hydra_hwloc_xmlfile_"
#: How long an engine's nanny may take to end after its engine (ipyparallel lingers 3 s).
NANNY_GRACE_S = 5.0


def _segments_of(pid: int) -> set[str]:
    """MPICH segments that process `pid` maps."""
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return set()
    names = set()
    for line in text.splitlines():
        i = line.find("/dev/shm/")
        if i >= 0:
            name = line[i + len("/dev/shm/") :].split(" ")[0]
            if name.startswith(MPI_SEGMENT_PREFIXES):
                names.add(name)
    return names


def _hwloc_files_of(pid: int) -> set[str]:
    """Hydra hwloc files that process `pid` (a proxy) holds open."""
    files = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if Path(target).name.startswith(_HWLOC_PREFIX):
                files.add(target)
    except OSError:
        pass
    return files


def remove_orphaned_hwloc_files() -> list[str]:
    """Remove this user's Hydra hwloc files that no process holds open; returns their paths.

    A proxy creates its file open (``mkstemp``) and holds it until it exits, when it removes it;
    one killed with SIGKILL leaves it."""
    uid = os.getuid()
    tmp = Path(tempfile.gettempdir())
    candidates = []
    for path in sorted({*tmp.glob(_HWLOC_PREFIX + "*"), *Path("/tmp").glob(_HWLOC_PREFIX + "*")}):
        try:
            if path.stat().st_uid == uid:
                candidates.append(path)
        except OSError:
            continue
    if not candidates:
        return []
    held: set[str] = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            held |= _hwloc_files_of(int(pid))
    removed = []
    for path in candidates:
        if str(path) not in held:
            try:
                path.unlink()
                removed.append(str(path))
            except FileNotFoundError:
                pass
    return removed


def is_profile_copy(path: str | os.PathLike) -> bool:
    """A host's copy of a cluster's profile directory (the notebook's own has an owner file)."""
    p = Path(path)
    return p.name.startswith(PROFILE_PREFIX) and p.is_dir() and not (p / OWNER_FILE).exists()


def _nannies_of(pid: int) -> list[Any]:
    """The ipyparallel nanny that engine `pid` started (its own session: nothing that ends the
    engine's process group ends it)."""
    import psutil

    try:
        children = psutil.Process(pid).children()
    except psutil.Error:
        return []
    nannies = []
    for child in children:
        try:
            if "ipyparallel.engine.nanny" in child.cmdline():
                nannies.append(child)
        except psutil.Error:
            continue
    return nannies


def watch_ranks(pids: list[int], profile_dir: str) -> list[str]:
    """Wait until every process of `pids` (a host's ranks and their proxy) has ended, then
    remove what they leave: the MPICH segments they mapped that nobody maps any more, the
    proxy's hwloc file, and the host's copy of the profile directory. Returns what it removed.

    The engines' nannies end with their engines; one that does not within NANNY_GRACE_S (one
    waiting forever to tell a controller that is cut off or gone that its engine ended) is
    killed: it holds the engine's output pipes, so the proxy too would wait for it forever,
    and where the proxy was killed with its engines, nothing else would end it."""
    segments: set[str] = set()
    hwloc: set[str] = set()
    nannies = {pid: [n.pid for n in _nannies_of(pid)] for pid in pids}
    watched: dict[int, int] = {}  # pidfd -> pid: the ranks, their proxy and the nannies
    for pid in pids:
        segments |= _segments_of(pid)
        hwloc |= _hwloc_files_of(pid)
        for p in (pid, *nannies[pid]):
            try:
                watched[os.pidfd_open(p)] = p
            except OSError:  # already gone
                pass
    all_nannies = {n for group in nannies.values() for n in group}
    poller = select.poll()
    for fd in watched:
        poller.register(fd, select.POLLIN)
    removed = []
    deadline = None
    while watched:
        running = set(watched.values())
        if deadline is None and running & all_nannies:
            if not any(nannies.get(pid) for pid in running - all_nannies):  # their engines ended
                deadline = time.monotonic() + NANNY_GRACE_S
        wait_ms = None if deadline is None else max(0, int((deadline - time.monotonic()) * 1000))
        for fd, _ in poller.poll(wait_ms):
            poller.unregister(fd)
            os.close(fd)
            del watched[fd]
        if deadline is not None and time.monotonic() >= deadline:
            for fd, pid in watched.items():
                if pid in all_nannies:
                    try:
                        signal.pidfd_send_signal(fd, signal.SIGKILL)
                        removed.append(f"pid {pid} (a nanny)")
                    except ProcessLookupError:
                        pass
            all_nannies, deadline = set(), None  # (their pidfds report them gone)
    mapped = _mapped_shm_names()
    for name in sorted(segments - mapped):
        try:
            (SHM_DIR / name).unlink()
            removed.append(str(SHM_DIR / name))
        except FileNotFoundError:
            pass
    for xml in sorted(hwloc):
        try:
            os.unlink(xml)
            removed.append(xml)
        except FileNotFoundError:
            pass
    if is_profile_copy(profile_dir):
        shutil.rmtree(profile_dir, ignore_errors=True)
        removed.append(profile_dir)
    return removed


def start_watcher(pids: list[int], profile_dir: str) -> None:
    """Start :func:`watch_ranks` detached from the calling rank: its own session, and no longer
    its child (a shell starts it in the background and exits), so that whatever ends the ranks
    does not end it, a Slurm step that ends its tasks' process trees included."""
    import subprocess

    argv = [
        sys.executable,
        "-m",
        "tnt_notebook.cluster.cleanup",
        "watch",
        profile_dir,
        *map(str, pids),
    ]
    subprocess.run(
        ["sh", "-c", '"$@" &', "sh", *argv],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        check=False,
    )


# The module every rank of tnt-run runs (tnt_notebook.rank.run_script, which imports this one).
_SCRIPT_RANK = "tnt_notebook.rank.run_script"


def cluster_id_of(cmdline: list[str]) -> str | None:
    """The cluster id of a tnt rank's command line: an engine of a notebook's cluster or a rank
    of tnt-run (None for any other process)."""
    engine = "ipyparallel.engine" in cmdline and any("tnt_notebook" in a for a in cmdline)
    if not engine and _SCRIPT_RANK not in cmdline:
        return None
    for arg in cmdline:
        if arg.startswith("--cluster-id="):
            return arg.split("=", 1)[1]
    return None


def _environ_of(pid: int, name: str) -> str | None:
    try:
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            key, _, value = item.partition(b"=")
            if key == name.encode():
                return value.decode(errors="replace")
    except OSError:
        pass
    return None


def _pid_namespace(pid: int | str) -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid")
    except OSError:
        return ""


_LAUNCHERS = ("hydra_pmi_proxy", "slurmstepd")  # the parent of a rank of a live world


def _is_leftover(p: Any) -> bool:
    """A rank whose world is gone: no Hydra proxy (or Slurm step) above it any more, or (an
    engine) its controller no longer takes connections. Ranks of live worlds, whoever started
    them on this host, are not leftovers."""
    import psutil

    try:
        parent = p.parent()
        if parent is None or not any(name in parent.name() for name in _LAUNCHERS):
            return True
    except psutil.Error:
        return True
    info = _environ_of(p.pid, "IPP_CONNECTION_INFO")
    if info is None:  # a script's rank (tnt-run) under its live proxy
        return False
    try:
        d = json.loads(info)
        address = (d["interface"].split("://", 1)[1], int(d["registration"]))
    except (ValueError, KeyError, IndexError):
        return False
    try:
        socket.create_connection(address, timeout=1).close()
        return False
    except OSError:
        return True


def end_leftover_ranks(keep: set[str], only: set[str] | None = None) -> dict[str, int]:
    """End this user's leftover tnt ranks on this host (and the Hydra proxies that started them):
    those whose world is gone, except the clusters in `keep`; with `only`, every rank of just
    those clusters. Returns ranks ended per cluster id. Then removes what no process uses any
    more (segments, hwloc files, copies of profile directories). Processes of other process-id
    namespaces (containers, or the nodes of a test cluster on this machine) are not this host's
    and are left alone."""
    import psutil

    uid = os.getuid()
    own_namespace = _pid_namespace("self")
    ranks: dict[str, list[psutil.Process]] = {}
    for p in psutil.process_iter(["cmdline", "uids"]):
        try:
            cid = cluster_id_of(p.info["cmdline"] or [])
            if cid is None or p.info["uids"].real != uid or cid in keep:
                continue
            if _pid_namespace(p.pid) != own_namespace:
                continue
            if (cid not in only) if only is not None else not _is_leftover(p):
                continue
            ranks.setdefault(cid, []).append(p)
        except psutil.Error:
            continue
    victims = [p for procs in ranks.values() for p in procs]
    for p in list(victims):
        try:
            parent = p.parent()
            if parent is not None and "hydra_pmi_proxy" in parent.name():
                victims.append(parent)
            victims += p.children(recursive=True)  # the engines' nannies
        except psutil.Error:
            pass
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in victims:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        _, victims = psutil.wait_procs(victims, timeout=3)
        if not victims:
            break
    remove_unused_leftovers()
    return {cid: len(procs) for cid, procs in ranks.items()}


def remove_unused_leftovers() -> list[str]:
    """This user's leftovers on this host that no live process uses: MPICH segments, Hydra's
    hwloc files, and copies of profile directories that no process names."""
    import psutil

    removed = remove_orphaned_mpi_files()
    uid = os.getuid()
    cmdlines = []
    for p in psutil.process_iter(["cmdline", "uids"]):
        try:
            if p.info["uids"].real == uid:
                cmdlines.append(" ".join(p.info["cmdline"] or []))
        except psutil.Error:
            continue
    tmp = Path(tempfile.gettempdir())
    for path in sorted({*tmp.glob(PROFILE_PREFIX + "*"), *Path("/tmp").glob(PROFILE_PREFIX + "*")}):
        try:
            if path.stat().st_uid != uid or not is_profile_copy(path):
                continue
        except OSError:
            continue
        if not any(str(path) in c for c in cmdlines):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(str(path))
    return removed


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tnt_notebook.cluster.cleanup", description=__doc__)
    sub = ap.add_subparsers(dest="action", required=True)
    watch = sub.add_parser("watch", help="wait for these processes, then remove their leftovers")
    watch.add_argument("profile_dir")
    watch.add_argument("pids", nargs="+", type=int)
    ranks = sub.add_parser("ranks", help="end this user's leftover tnt ranks on this host")
    ranks.add_argument("--keep", action="append", default=[], metavar="CLUSTER_ID")
    ranks.add_argument("--only", action="append", default=None, metavar="CLUSTER_ID")
    args = ap.parse_args(argv)
    if args.action == "watch":
        watch_ranks(args.pids, args.profile_dir)
        return 0
    ended = end_leftover_ranks(set(args.keep), None if args.only is None else set(args.only))
    n = sum(ended.values())
    which = f" of cluster(s) {', '.join(sorted(ended))}" if ended else ""
    print(f"ended {n} leftover rank(s){which}")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def watch_this_host(comm: Any, profile_dir: str) -> None:
    """The first rank of each host starts the watcher that removes what the host's ranks leave
    behind once they have ended (see :func:`watch_ranks`)."""
    import os

    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        pids = node.gather(os.getpid())
        if node.Get_rank() == 0:
            start_watcher([*pids, os.getppid()], profile_dir)
    finally:
        node.Free()


def end_leftover_ranks_on_hosts(
    plan: LaunchPlan, keep: tuple[str, ...] = (), only: list[str] | None = None, timeout: float = 30
) -> list[str]:
    """:func:`end_leftover_ranks` on every host of `plan` (through ssh or srun): this user's ranks
    of clusters other than `keep` (with `only`, just those clusters) end, with what they left
    behind; one line per host says what was done."""
    argv = [plan.python, "-m", "tnt_notebook.cluster.cleanup", "ranks"]
    argv += [f"--keep={cid}" for cid in keep]
    argv += [f"--only={cid}" for cid in only or []]
    commands = {h: argv if is_local_host(h) else plan.remote_command(h, argv) for h in plan.hosts}
    lines = []
    for r in run_on_hosts(commands, timeout):
        if r.returncode == 0:
            lines.append(f"{r.host}: {r.stdout.strip()}")
        else:
            why = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
            lines.append(f"{r.host}: cleanup failed: {why}")
    return lines

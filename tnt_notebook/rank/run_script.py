"""``python -m tnt_notebook.rank.run_script --profile-dir=D --cluster-id=I -- SCRIPT ARGS...``:
how each rank of ``tnt-run`` runs the user's script.

Only the master rank's stdout is shown (unless ``TNT_OUTPUT_ON_ALL_DEVICES``); the rank tells
tnt-run its pid and, if it fails, its exit code (on stderr, in one write, lines starting with
:data:`RANK_STATUS`), and a failing rank ends the world at once (MPI_Abort) instead of leaving the
others waiting in a collective.
"""

from __future__ import annotations

import os
import socket
import sys
import time

from tnt_notebook import settings
from tnt_notebook.rank import device

RANK_STATUS = "\x1etnt-run"  # starts the lines by which script ranks tell tnt-run their state
# How long a failing rank lets the launcher forward its last lines before it aborts the world.
ABORT_GRACE_S = 0.5


def main(argv: list[str]) -> None:
    """One rank of tnt-run: ``--profile-dir=D --cluster-id=I -- SCRIPT ARGS...``."""
    import runpy
    import traceback

    options, script = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    profile_dir = next(a.split("=", 1)[1] for a in options if a.startswith("--profile-dir="))
    from mpi4py import MPI

    from tnt_notebook.cluster.cleanup import watch_this_host

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    host = socket.gethostname()

    def status(state: str) -> None:
        os.write(2, f"{RANK_STATUS} rank={rank} pid={os.getpid()} host={host} {state}\n".encode())

    status("started")
    no_gpu = ""  # the rank's own GPU, before the script can import TensorFlow
    try:
        device.keep_own_gpu()
    except RuntimeError as e:
        no_gpu = f"tnt-run: rank {rank} on {host}: {e}"
    watch_this_host(comm, profile_dir)
    # whole lines in one write each (also under PYTHONUNBUFFERED): ranks' lines do not mix
    sys.stdout.reconfigure(line_buffering=True, write_through=False)
    if rank != 0 and not settings.OUTPUT_ON_ALL_DEVICES.read():
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 1)
        os.close(devnull)
    code = 0
    try:
        if no_gpu:
            raise SystemExit(no_gpu)
        sys.argv = list(script)
        sys.path.insert(0, os.path.dirname(os.path.abspath(script[0])))
        runpy.run_path(script[0], run_name="__main__")
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the rank's failure, reported and turned into its code
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    if code:
        status(f"exit={code}")
        if comm.Get_size() > 1:
            # MPI_Abort tears the launcher's proxies down at once, and a proxy on another host
            # drops what it has not forwarded yet (the status line above): give it that long.
            time.sleep(ABORT_GRACE_S)
            comm.Abort(code)
    sys.exit(code)


if __name__ == "__main__":
    main(sys.argv[1:])

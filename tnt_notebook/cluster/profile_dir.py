"""A cluster's owner-only profile directory in the temporary directory: who owns it, the
controller's CurveZMQ configuration in it, and the removal of those that killed kernels left."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from tnt_notebook.cluster.cleanup import OWNER_FILE, PROFILE_PREFIX
from tnt_notebook.cluster.launchers import write_private
from tnt_notebook.cluster.processes import pid_alive


def owner_stamp(pid: int) -> str:
    """Who owns a profile directory: a pid and its start time (pids are reused)."""
    import psutil

    try:
        return f"{pid} {psutil.Process(pid).create_time():.3f}"
    except psutil.Error:
        return f"{pid} 0"


def remove_stale_profile_dirs() -> None:
    """Profile dirs of kernels that were SIGKILLed (no atexit ran): their owner is gone."""
    for d in Path(tempfile.gettempdir()).glob(PROFILE_PREFIX + "*"):
        try:
            if d.stat().st_uid != os.getuid():
                continue
            pid = int((d / OWNER_FILE).read_text().split()[0])
            if owner_stamp(pid) != (d / OWNER_FILE).read_text() or not pid_alive(pid):
                shutil.rmtree(d, ignore_errors=True)
        except (OSError, ValueError, IndexError):
            continue


def write_curve_config(profile_dir: str, key: str) -> str:
    """Beyond loopback every ZeroMQ connection is encrypted and the controller authenticated
    (CurveZMQ): its key pair goes into an owner-only config file that the controller reads from
    its profile directory (never a command line or an environment). Messages stay signed with
    `key` too (ipyparallel drops signing under CurveZMQ unless a key is configured). Returns the
    controller's public key, which engines and client need to connect at all."""
    import zmq

    public, secret = zmq.curve_keypair()
    write_private(
        os.path.join(profile_dir, "ipcontroller_config.py"),
        f"c.Session.key = {key.encode()!r}\n"
        "c.IPController.enable_curve = True\n"
        f"c.IPController.curve_publickey = {public!r}\n"
        f"c.IPController.curve_secretkey = {secret!r}\n",
    )
    return public.decode("ascii")

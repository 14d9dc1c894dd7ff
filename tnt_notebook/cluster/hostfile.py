"""Hostfiles in Tarantella's format (unique host names, one per line; blank lines and ``#``
comments ignored), ranks per host, and which host names are this machine."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

from tnt_notebook.cluster.errors import HostfileError

_HOST_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.\-]*[A-Za-z0-9_])?$")
_LOCAL_NAMES = {"localhost", "127.0.0.1", "::1", "ip6-localhost"}


def parse_hostfile_text(text: str, source: str = "hostfile") -> list[str]:
    """Host names of a hostfile's text, in order; rejects empty files, bad and duplicate names."""
    hosts: list[str] = []
    seen: dict[str, int] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not _HOST_RE.match(line):
            raise HostfileError(
                f"{source}, line {lineno}: {line!r} is not a host name "
                "(one host name per line, e.g. 'node01')"
            )
        if line in seen:
            raise HostfileError(
                f"{source}, line {lineno}: duplicate host {line!r} (first on line {seen[line]}); "
                "host names must be unique, use --n-per-node for several ranks per host"
            )
        seen[line] = lineno
        hosts.append(line)
    if not hosts:
        raise HostfileError(f"{source} is empty: it names no host")
    return hosts


def read_hostfile(path: str | os.PathLike) -> list[str]:
    """Host names listed in the hostfile at `path` (see :func:`parse_hostfile_text`)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise HostfileError(f"hostfile {str(p)!r} does not exist")
    if p.is_dir():
        raise HostfileError(f"hostfile {str(p)!r} is a directory, not a file")
    try:
        text = p.read_text()
    except PermissionError:
        raise HostfileError(f"hostfile {str(p)!r} is not readable (permission denied)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise HostfileError(f"hostfile {str(p)!r} cannot be read: {e}") from None
    return parse_hostfile_text(text, source=f"hostfile {str(p)!r}")


def validate_n_per_node(value: object) -> int:
    """A positive number of ranks per host; anything else is a HostfileError."""
    if isinstance(value, bool):
        raise HostfileError(f"--n-per-node must be a positive integer, got {value!r}")
    try:
        n = int(str(value).strip())
    except ValueError:
        raise HostfileError(f"--n-per-node must be a positive integer, got {value!r}") from None
    if n < 1:
        raise HostfileError(f"--n-per-node must be a positive integer, got {value!r}")
    return n


def is_local_host(name: str) -> bool:
    """True when `name` designates the machine we run on (controller may stay on loopback)."""
    if name in _LOCAL_NAMES or name.startswith("127."):
        return True
    me = {socket.gethostname(), socket.getfqdn()}
    return name in me or name.split(".")[0] == socket.gethostname().split(".")[0]


def all_local(hosts: list[str]) -> bool:
    """True when every host is this machine."""
    return all(is_local_host(h) for h in hosts)

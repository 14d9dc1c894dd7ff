"""Which address of this machine the hosts of a plan reach it at (where the controller listens),
the name ssh connects to for a host, and ports free on this machine."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable

from tnt_notebook.cluster.errors import PlanError
from tnt_notebook.cluster.hostfile import is_local_host


def ssh_target(host: str, ssh: str) -> str:
    """The name or address that `ssh` connects to for `host` (its configuration's HostName)."""
    try:
        out = subprocess.run([ssh, "-G", host], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return host
    for line in out.splitlines():
        key, _, value = line.partition(" ")
        if key == "hostname" and value.strip():
            return value.strip()
    return host


def route_source(address: str) -> str:
    """This machine's address on the route to `address` (nothing is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))
        return s.getsockname()[0]


def address_hosts_reach(hosts: list[str], target_of: Callable[[str], str]) -> str:
    """The one address of this machine on the routes to every remote host of `hosts`, each
    reached at ``target_of(host)`` (its ssh HostName, its Slurm NodeAddr)."""
    sources: dict[str, str] = {}
    for host in hosts:
        if is_local_host(host):
            continue
        target = target_of(host)
        try:
            address = socket.getaddrinfo(target, None, socket.AF_INET)[0][4][0]
            sources[host] = route_source(address)
        except OSError as e:
            raise PlanError(
                f"host {host!r} has no reachable IPv4 address ({e}); "
                "give the controller's address with --controller-ip"
            ) from None
    if len(set(sources.values())) > 1:
        seen = ", ".join(f"{h} via {a}" for h, a in sources.items())
        raise PlanError(
            f"the hosts are reached from different addresses of this machine ({seen}); "
            "choose the one they all reach with --controller-ip"
        )
    return next(iter(sources.values()))


def free_ports(ip: str, n: int) -> list[int]:
    """n distinct ports free right now (all held open together so none repeats)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((ip if ip != "0.0.0.0" else "", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()

"""What the launchers report when hosts or ranks fail: ssh's errors, Hydra's BAD TERMINATION
report, srun's task ends and its launch errors, read into hosts and ranks named the user's way."""

from __future__ import annotations

import re
import signal
import socket
from dataclasses import dataclass

from tnt_notebook.cluster.addresses import ssh_target

_SSH_FAILURE_RE = re.compile(
    r"^ssh: (?:connect to host (\S+) port \d+|Could not resolve hostname (\S+?)): (.+)$"
    r"|^(?:\S+@)?(\S+): (Permission denied .+)$",
    re.M,
)


def ssh_failures(stderr: str, hosts: list[str], ssh: str) -> list[str]:
    """'HOST (why)' for each host that ssh could not reach, as its errors in `stderr` say
    (they name the address connected to; this names the host of the hostfile)."""
    found = list(_SSH_FAILURE_RE.finditer(stderr))
    if not found:
        return []
    host_of: dict[str, str] = {}
    for host in hosts:
        target = ssh_target(host, ssh)
        host_of[host] = host_of[target] = host
        try:
            host_of[socket.gethostbyname(target)] = host
        except OSError:
            pass
    out = []
    for m in found:
        target = m.group(1) or m.group(2) or m.group(4)
        why = (m.group(3) or m.group(5)).strip().rstrip(".")
        item = f"{host_of.get(target, target)} ({why})"
        if item not in out:
            out.append(item)
    return out


_HYDRA_DEATH_RE = re.compile(
    r"PID (\d+) RUNNING AT (\S+)\s*\n=\s*(?:KILLED BY SIGNAL: (\d+)|EXIT CODE: (\d+))"
    r"(?:(?:.*\n)*?.*EXIT STRING: .*\(signal (\d+)\))?"
)


@dataclass
class RankDeath:
    """A rank that the launcher reports dead: by a signal, or with an exit code. Hydra names
    its pid, srun its rank (the task id)."""

    pid: int | None
    host: str
    signal: int | None
    code: int | None
    rank: int | None = None

    def how(self) -> str:
        if self.signal is not None:
            try:
                name = signal.Signals(self.signal).name
            except ValueError:
                name = str(self.signal)
            return f"killed by signal {name}"
        return f"exit code {self.code}"


def hydra_deaths(report: str) -> list[RankDeath]:
    """The ranks that Hydra's BAD TERMINATION report names, in its order. Hydra prints it only
    for a process that did not exit (its wait status not WIFEXITED), and its "EXIT CODE" is then
    that raw status: the signal (with 128 set where a core was dumped). It names the first such
    process of a host in the order it started them, which may be one that Hydra itself ended
    after another process of that host died."""
    out = []
    for m in _HYDRA_DEATH_RE.finditer(report):
        sig = int(m[3] or m[5] or m[4]) & 0x7F
        out.append(RankDeath(int(m[1]), m[2], sig, None))
    return out


_SRUN_DEATH_RE = re.compile(
    r"^srun: error: (\S+): tasks? ([\d,\-]+): (?:Exited with exit code (\d+)|(.+?))\s*$", re.M
)
_SIGNAL_BY_TEXT = {
    text: int(s) for s in signal.Signals if (text := signal.strsignal(s)) is not None
}


def srun_deaths(report: str) -> list[RankDeath]:
    """The tasks (ranks) that srun reports ended badly, in its order: the first is the one
    that ended the step under --kill-on-bad-exit, the others were ended by Slurm for it."""
    out = []
    for m in _SRUN_DEATH_RE.finditer(report):
        sig = _SIGNAL_BY_TEXT.get(m[4] or "")
        if m[3] is None and sig is None:
            continue
        for part in m[2].split(","):
            first, _, last = part.partition("-")
            for rank in range(int(first), int(last or first) + 1):
                code = int(m[3]) if m[3] is not None else None
                out.append(RankDeath(None, m[1], sig, code, rank))
    return out


_SRUN_ERROR_RE = re.compile(
    r"^srun: error: (?!\S+: tasks? [\d,\-]+: )(.+)$|^slurmstepd\S*: error: (mpi/.+)$", re.M
)


def srun_launch_error(stderr: str) -> str | None:
    """The first error of srun, or of Slurm's PMI server, other than a task's end: a step it
    could not create or launch (an unknown PMI, nodes it may not use), which Hydra, whose
    proxies srun starts, waits out forever, or PMI requests it cannot read, which leave the
    ranks waiting forever; None when there is none."""
    m = _SRUN_ERROR_RE.search(stderr)
    if m is None:
        return None
    if m[2]:  # seen with Slurm 22.05 and MPICH 5: the address exchange needs several messages
        return (
            f"Slurm's PMI server failed ({m[2].strip()}); its PMI2 cannot serve this MPI "
            "here: use --launcher mpiexec"
        )
    return m[1].strip()

"""A real Slurm cluster on this machine for tests: Debian's slurmctld and slurmd (22.05), no
systemd, each daemon in the foreground inside a test host of tests/testhosts.py.

The controller has a host of its own (``tnt<id>-ctl``), so nothing of Slurm listens in this
machine's network namespace; each node is a host (``tnt<id>-n1``, ``-n2``...) with its own
hostname, address, ``/tmp``, ``/dev/shm``, process ids and cgroup tree, and runs one slurmd.
``gpus=N`` gives each node N GPUs in ``gres.conf``: device files that stand for them, which Slurm
grants to jobs (``--gpus-per-node``, ``--gres=gpu:N``) with its GPU variables, as on a GPU cluster.
``auth/none`` (no munge), ``MpiDefault=none``, ``proctrack/linuxproc``: everything Slurm writes
(configuration, state, spool, logs) lies in the hosts' working directory, which every host sees
at the same path, as does ``shared_dir`` (a cluster's shared home). On the nodes the
configuration is also at ``/etc/slurm/slurm.conf``, as on a real node; here the client commands
(``sbatch``, ``salloc``, ``srun``, ``scontrol``, ``scancel``) need ``SLURM_CONF`` (in ``env``).
Needs root, the test hosts' tools and ``slurmctld``, ``slurmd``, ``slurm-client``
(``scripts/test.sh`` installs them as root).

From Python (the pytest fixture ``slurm`` in tests/conftest.py is one of these)::

    with SlurmCluster(2) as sl:
        sl.env                          # {"SLURM_CONF": ...} for the client commands
        sl.client(["sinfo"])            # a client command, its output
        job = sl.sbatch(script, "-N2", "--ntasks-per-node=2")
        sl.wait_state(job, "RUNNING"); sl.steps(job); sl.scancel(job)
        sl.nodes[1].run("ps -e")        # a command inside a node (test hosts' API)

From a shell (``up`` stays in the foreground until Ctrl-C, then takes everything down)::

    sudo .venv/bin/python tests/slurmcluster.py up --nodes 2
    sudo .venv/bin/python tests/slurmcluster.py down DIR   # what a killed `up` left behind

Auth/none lets whoever reaches the controller act as any user, root included: this is a sandbox
for tests, reachable only from this machine (the controller's bridge), and gone at the end.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tests.support.testhosts import TestHost, TestHosts, command_line
from tests.support.testhosts import unavailable as hosts_unavailable

# what a tnt cluster runs on a node: engines, Hydra's proxies, the watcher, its srun steps
TNT_PROCESS = re.compile(
    r"ipyparallel\.|hydra_pmi_proxy|mpiexec|tnt_notebook\.(?:cleanup|launch)|--job-name=tnt-"
)
# device files that stand for a node's GPUs in gres.conf (Slurm only names and counts them)
FAKE_GPU_FILES = tuple(f"/dev/tty{i}" for i in range(8))
DAEMONS = ("slurmctld", "slurmd", "sbatch", "salloc", "srun", "scontrol", "scancel", "squeue")


def unavailable() -> str | None:
    """Why a test Slurm cannot be made here (None when it can)."""
    reason = hosts_unavailable()
    if reason:
        return reason.replace("test hosts need", "a test Slurm needs")
    missing = [
        d for d in DAEMONS if shutil.which(d) is None and not Path(f"/usr/sbin/{d}").exists()
    ]
    if missing:
        return (
            f"a test Slurm needs {', '.join(missing)} (Debian: slurmctld, slurmd, slurm-client; "
            "scripts/test.sh installs them as root)"
        )
    return None


def _tool(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class SlurmCluster:
    """A controller host and `n` node hosts running Slurm; a context manager."""

    __test__ = False

    def __init__(
        self, n: int = 2, cpus: int = 2, gpus: int = 0, workdir: str | os.PathLike | None = None
    ):
        if not 1 <= n <= 7:
            raise ValueError("between 1 and 7 nodes")
        if not 0 <= gpus <= len(FAKE_GPU_FILES):
            raise ValueError(f"between 0 and {len(FAKE_GPU_FILES)} GPUs per node")
        self.cpus = cpus
        self.gpus = gpus
        self.hosts = TestHosts(
            names=["ctl", *(f"n{i}" for i in range(1, n + 1))], sshd=False, workdir=workdir
        )

    # ------------------------------------------------------------------ what users need
    @property
    def workdir(self) -> Path:
        return self.hosts.workdir

    @property
    def controller(self) -> TestHost:
        return self.hosts.hosts[0]

    @property
    def nodes(self) -> list[TestHost]:
        return self.hosts.hosts[1:]

    @property
    def names(self) -> list[str]:
        return [h.name for h in self.nodes]

    @property
    def shared_dir(self) -> Path:
        return self.hosts.shared_dir

    @property
    def conf_dir(self) -> Path:
        return self.workdir / "etc-slurm"

    @property
    def conf(self) -> Path:
        return self.conf_dir / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    def node(self, name: str) -> TestHost:
        return next(h for h in self.nodes if h.name == name)

    def client(
        self, argv: list[str], timeout: float = 30, check: bool = True, **kwargs
    ) -> subprocess.CompletedProcess:
        """A Slurm client command run here (this machine is the cluster's login node)."""
        env = {**os.environ, **kwargs.pop("env", {}), **self.env}
        r = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, **kwargs)
        if check and r.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
        return r

    def sbatch(self, script: str, *options: str, env: dict[str, str] | None = None) -> str:
        """Submit `script` (its text) with sbatch `options`; the job id."""
        path = self.shared_dir / f"job-{time.monotonic_ns()}.sh"
        path.write_text(script)
        r = self.client(["sbatch", "--parsable", *options, str(path)], env=env or {})
        return r.stdout.strip().split(";")[0]

    def job_state(self, job: str) -> str:
        """The job's state as the controller says (e.g. RUNNING, CANCELLED; '' once forgotten)."""
        r = self.client(["scontrol", "show", "job", "-o", job], check=False)
        m = re.search(r"\bJobState=(\S+)", r.stdout)
        return m[1] if m else ""

    def wait_state(self, job: str, *states: str, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while True:
            state = self.job_state(job)
            if state in states:
                return state
            if time.monotonic() > deadline:
                raise RuntimeError(f"job {job} is {state or 'gone'}, not {'/'.join(states)}")
            time.sleep(0.1)

    def steps(self, job: str) -> list[str]:
        """'STEPID NAME NODELIST' of the job's running steps (the batch step excluded)."""
        r = self.client(["squeue", "-h", "-s", "-j", job, "-o", "%i %j %N"], check=False)
        return [
            line for line in r.stdout.splitlines() if ".batch" not in line and ".extern" not in line
        ]

    def scancel(self, job: str) -> None:
        self.client(["scancel", job], check=False)

    def leftovers(self, job: str | None = None, timeout: float = 30) -> dict[str, list[str]]:
        """What tnt clusters left on the nodes once `timeout` has passed (at once when nothing):
        their processes (TNT_PROCESS), files in the nodes' /dev/shm and /tmp, and the job's
        steps named tnt-*; {} when there is nothing."""
        deadline = time.monotonic() + timeout
        while True:
            left = {}
            for h in self.nodes:
                items = [
                    item
                    for item in h.leftovers()
                    if not item.startswith("pid ") or TNT_PROCESS.search(item)
                ]
                if items:
                    left[h.name] = items
            steps = [s for s in self.steps(job) if " tnt-" in s] if job else []
            if steps:
                left["steps"] = steps
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)

    def log(self, name: str, chars: int = 3000) -> str:
        """The end of node (or controller) `name`'s Slurm daemon log, for a failure's message."""
        daemon = "slurmctld" if name == self.controller.name else f"slurmd-{name}"
        path = self.workdir / "log" / f"{daemon}.log"
        return path.read_text(errors="replace")[-chars:] if path.exists() else ""

    def idle_nodes(self) -> int:
        r = self.client(["sinfo", "-h", "-t", "idle", "-o", "%D"], check=False)
        return int(r.stdout.strip() or 0)

    # ------------------------------------------------------------------ up and down
    def __enter__(self) -> SlurmCluster:
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self, timeout: float = 30) -> None:
        reason = unavailable()
        if reason:
            raise RuntimeError(reason)
        self.hosts.up()
        state, log = self.workdir / "state", self.workdir / "log"
        for d in (self.conf_dir, state / "ctld", log, *(state / n for n in self.names)):
            d.mkdir(parents=True, exist_ok=True)
        self.conf.write_text(self._conf_text(state, log))
        (self.conf_dir / "plugstack.conf").write_text("")
        (self.conf_dir / "gres.conf").write_text(self._gres_text())
        for h in self.nodes:  # a node's configuration where Slurm looks for it by default
            h.run(["mount", "--bind", str(self.conf_dir), "/etc/slurm"])
        self.controller.start_daemon(
            [_tool("slurmctld"), "-D", "-f", str(self.conf)], log / "slurmctld.out"
        )
        for h in self.nodes:
            h.start_daemon([_tool("slurmd"), "-D", "-f", str(self.conf)], log / f"{h.name}.out")
        deadline = time.monotonic() + timeout
        while self.idle_nodes() != len(self.nodes):
            dead = [
                p
                for p in (*self.controller.daemons, *(d for h in self.nodes for d in h.daemons))
                if p.poll() is not None
            ]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(
                    p.read_text(errors="replace")[-1500:] for p in sorted(log.glob("*"))
                )
                raise RuntimeError(f"the test Slurm did not come up within {timeout:g} s:\n{logs}")
            time.sleep(0.1)

    def _conf_text(self, state: Path, log: Path) -> str:
        ctl = self.controller
        gres = f" Gres=gpu:{self.gpus}" if self.gpus else ""
        nodes = "".join(
            f"NodeName={h.name} NodeAddr={h.address} CPUs={self.cpus}{gres} State=UNKNOWN\n"
            for h in self.nodes
        )
        return (
            f"ClusterName=tnt{self.hosts.id}\n"
            f"SlurmctldHost={ctl.name}({ctl.address})\n"
            "SlurmUser=root\nSlurmdUser=root\n"
            "AuthType=auth/none\nCredType=cred/none\n"
            f"StateSaveLocation={state / 'ctld'}\n"
            f"SlurmdSpoolDir={state / '%n'}\n"
            f"SlurmctldPidFile={state / 'slurmctld.pid'}\n"
            f"SlurmdPidFile={state / 'slurmd-%n.pid'}\n"
            f"SlurmctldLogFile={log / 'slurmctld.log'}\n"
            f"SlurmdLogFile={log / 'slurmd-%n.log'}\n"
            "ProctrackType=proctrack/linuxproc\nTaskPlugin=task/none\n"
            "SelectType=select/cons_tres\nSelectTypeParameters=CR_Core\n"
            "AccountingStorageType=accounting_storage/none\n"
            "JobAcctGatherType=jobacct_gather/none\nJobCompType=jobcomp/none\n"
            + ("GresTypes=gpu\n" if self.gpus else "")
            + "MpiDefault=none\nMailProg=/bin/true\nReturnToService=2\n"
            "KillWait=5\nMinJobAge=30\n"
            "SchedulerParameters=bf_interval=1\n"  # a job that waits starts within 1 s, not 30
            "SlurmdParameters=config_overrides\n"  # 2-CPU nodes on fewer real cores
             + nodes + "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n"
        )

    def _gres_text(self) -> str:
        """The nodes' GPUs: device files that stand for them, as Slurm grants and numbers them
        (nothing detects real ones)."""
        if not self.gpus:
            return ""
        files = FAKE_GPU_FILES[: self.gpus]
        return "AutoDetect=off\n" + "".join(f"Name=gpu File={f}\n" for f in files)

    def down(self) -> None:
        """Take everything down: daemons, jobs, hosts, files (test hosts' down)."""
        self.hosts.down()

    @classmethod
    def from_dir(cls, workdir: str | os.PathLike) -> SlurmCluster:
        """The cluster a killed `up` left in `workdir`, to take it down."""
        sl = cls.__new__(cls)
        sl.hosts = TestHosts.from_state(workdir)
        return sl


def _report(sl: SlurmCluster) -> None:
    print(f"Slurm up in {sl.workdir}: controller {sl.controller.name} {sl.controller.address}")
    for h in sl.nodes:
        print(f"  node {h.name}  {h.address}  ({sl.cpus} CPUs, {sl.gpus} GPUs)")
    print(f"export SLURM_CONF={sl.conf}   (then sinfo, salloc, sbatch, srun from here)")
    print(f"shared dir: {sl.shared_dir}   (the same path on every node: work from here)")
    print(f"inside a node: {shlex.join(sl.nodes[0].command(['bash']))}")


def _options(up: argparse.ArgumentParser) -> None:
    up.add_argument("--nodes", type=int, default=2, help="how many (default 2)")
    up.add_argument("--cpus", type=int, default=2, help="CPUs per node (default 2)")
    up.add_argument("--gpus", type=int, default=0, help="fake GPUs per node (default 0)")


def main(argv: list[str] | None = None) -> int:
    return command_line(
        argv,
        "tests/slurmcluster.py",
        "the test Slurm",
        _options,
        lambda args: SlurmCluster(args.nodes, args.cpus, args.gpus),
        SlurmCluster.from_dir,
        unavailable,
        _report,
    )


if __name__ == "__main__":
    sys.exit(main())

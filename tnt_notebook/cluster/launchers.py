"""How a plan's ranks start: one small strategy per launcher backend, chosen once per plan.

- :class:`Hydra`: MPICH's ``mpiexec`` on this machine (``-n``, or a hostfile naming only it);
- :class:`HydraOverSsh`: Hydra reaching the hosts of a hostfile through ssh;
- :class:`HydraInSlurm`: Hydra inside a Slurm allocation, its proxies started by ``srun``;
- :class:`Srun`: ``srun`` itself, one rank per task of a job step (``--launcher srun``);
- :class:`OpenMpi`: Open MPI's ``mpiexec``, which spells hostfile and environment differently.

Each turns the plan, the variables exported on every rank and the ranks' program into the one
launcher command, and writes the owner-only files that command reads.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from tnt_notebook import settings
from tnt_notebook.cluster.slurm import step_name

if TYPE_CHECKING:
    from tnt_notebook.cluster.plan import LaunchPlan

LAUNCHERS = ("mpiexec", "srun")  # how ranks start inside a Slurm allocation
# what Slurm sets in a step's tasks to name the GPUs it granted on that task's node
SLURM_NODE_GPU_VARIABLES = (
    "CUDA_VISIBLE_DEVICES",
    "GPU_DEVICE_ORDINAL",
    "ROCR_VISIBLE_DEVICES",
    "ZE_AFFINITY_MASK",
    "SLURM_STEP_GPUS",
)


def default_mpiexec() -> str:
    """The launcher of the MPI the package uses: $TNT_MPIEXEC, else the mpich wheel's."""
    chosen = settings.MPIEXEC.read()
    if chosen:
        return chosen
    venv = Path(sys.executable).parent / "mpiexec"
    return str(venv) if venv.exists() else (shutil.which("mpiexec") or "mpiexec")


def launcher_flavor(mpiexec: str) -> str:
    """'hydra' (MPICH, Intel MPI) or 'openmpi': they spell hostfile and env options differently."""
    if mpiexec == str(Path(sys.executable).parent / "mpiexec"):
        return "hydra"  # the mpich wheel's
    try:
        out = subprocess.run(
            [mpiexec, "--version"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "hydra"
    return "openmpi" if ("Open MPI" in out or "OpenRTE" in out) else "hydra"


def write_private(path: str, text: str, executable: bool = False) -> None:
    """A new file only its owner can read (and run, when ``executable``)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    if executable:
        os.chmod(path, 0o700)


class Launcher:
    """One launcher backend: the command that starts every rank of ``plan``."""

    def __init__(self, plan: LaunchPlan) -> None:
        self.plan = plan

    def write_files(self, profile_dir: str, cluster_id: str) -> None:
        """The owner-only files the command reads: the hostfile where ranks are placed per host."""
        if self.plan.per_host:
            hosts = "\n".join(self.plan.hosts) + "\n"
            write_private(os.path.join(profile_dir, "hostfile"), hosts)

    def command(
        self,
        profile_dir: str,
        cluster_id: str,
        env: dict[str, str],
        program: list[str],
        address: str | None,
    ) -> list[str]:
        raise NotImplementedError

    def environment(self, environ: Mapping[str, str]) -> dict[str, str]:
        """The launcher command's environment, from this process's `environ`."""
        return dict(environ)


class Hydra(Launcher):
    """MPICH's mpiexec; ranks on this machine (its subclasses reach other hosts)."""

    def command(self, profile_dir, cluster_id, env, program, address):
        plan = self.plan
        cmd = [plan.mpiexec, "-n", str(plan.size)]
        if plan.per_host:
            cmd += ["-f", os.path.join(profile_dir, "hostfile"), "-ppn", str(plan.n_per_node)]
        cmd += ["-wdir", plan.cwd, *self.bootstrap(profile_dir, address)]
        for k, v in env.items():
            cmd += ["-genv", k, v]
        return cmd + program

    def bootstrap(self, profile_dir: str, address: str | None) -> list[str]:
        """How Hydra reaches the hosts and where their proxies connect back to."""
        return []

    def connect_back(self, address: str | None) -> list[str]:
        # proxies on the hosts connect back to this address, not to a name that the hosts may
        # resolve to something else (Debian maps its own name to 127.0.1.1)
        return ["-localhost", address or self.plan.listen_address]


class HydraOverSsh(Hydra):
    """Hydra reaching the hosts of a hostfile with ssh, through a wrapper that keeps the ranks'
    connection info out of ssh's environment."""

    def write_files(self, profile_dir, cluster_id):
        super().write_files(profile_dir, cluster_id)
        write_private(
            self.plan.ssh_wrapper(profile_dir), self.plan.ssh_wrapper_text(), executable=True
        )

    def bootstrap(self, profile_dir, address):
        wrapper = self.plan.ssh_wrapper(profile_dir)
        return [*self.connect_back(address), "-launcher", "ssh", "-launcher-exec", wrapper]


class HydraInSlurm(Hydra):
    """Hydra inside a Slurm allocation: srun starts its proxies (also for ranks on this node:
    they belong in the job)."""

    def write_files(self, profile_dir, cluster_id):
        super().write_files(profile_dir, cluster_id)
        wrapper = self.plan.srun_wrapper(profile_dir)
        write_private(wrapper, self.plan.srun_wrapper_text(cluster_id), executable=True)

    def environment(self, environ):
        """Without the GPUs Slurm granted this process's node: Hydra hands its own environment
        to the ranks of every node, where each proxy, a task of srun, has its own node's."""
        return {k: v for k, v in environ.items() if k not in SLURM_NODE_GPU_VARIABLES}

    def bootstrap(self, profile_dir, address):
        slurm = ["-launcher", "slurm", "-launcher-exec", self.plan.srun_wrapper(profile_dir)]
        return slurm if self.plan.local else [*self.connect_back(address), *slurm]


class OpenMpi(Launcher):
    """Open MPI's mpiexec: its own spelling of hostfile, ranks per node and exports."""

    def command(self, profile_dir, cluster_id, env, program, address):
        plan = self.plan
        cmd = [plan.mpiexec]
        if plan.per_host:
            hostfile = os.path.join(profile_dir, "hostfile")
            cmd += ["--hostfile", hostfile, "--npernode", str(plan.n_per_node)]
        cmd += ["-n", str(plan.size), "--wdir", plan.cwd, "-x", "IPP_CONNECTION_INFO"]
        for k, v in env.items():
            cmd += ["-x", f"{k}={v}"]
        return cmd + program


class Srun(Launcher):
    """One rank per task of a job step of our own name: PMI2 (the mpich wheel has no PMIx, and a
    site's default may be PMIx or none), sharing CPUs with the notebook's own step (--overlap),
    ended as a whole when one rank dies (--kill-on-bad-exit), ranks placed block by block
    whatever the step we run in says (its variables reach srun)."""

    def command(self, profile_dir, cluster_id, env, program, address):
        plan = self.plan
        assert plan.slurm is not None
        granted = dict(zip(plan.slurm.nodes, plan.slurm.tasks_per_node, strict=True))
        cmd = [
            "srun",
            f"--job-name={step_name(cluster_id)}",
            "--overlap",
            "--kill-on-bad-exit=1",
            "--mpi=pmi2",
            f"--nodes={len(plan.hosts)}",
            f"--ntasks={plan.size}",
            f"--ntasks-per-node={plan.n_per_node}",
            "--distribution=block",
            f"--nodelist={','.join(plan.hosts)}",
            f"--chdir={plan.cwd}",
            "--input=none",
        ]
        if any(int(plan.n_per_node or 1) > granted[h] for h in plan.hosts):
            cmd.append("--overcommit")  # more ranks per node than the job's tasks: asked for
        # srun hands its own environment to the ranks: the exports go through `env`
        return [*cmd, "env", *(f"{k}={v}" for k, v in env.items()), *program]


def launcher_for(plan: LaunchPlan) -> Launcher:
    """The backend that starts ``plan``'s ranks."""
    if plan.launcher == "srun":
        return Srun(plan)
    if plan.flavor == "openmpi":
        return OpenMpi(plan)
    if plan.slurm is not None:
        return HydraInSlurm(plan)
    return Hydra(plan) if plan.local else HydraOverSsh(plan)

"""The Slurm allocation this process runs in: its job, nodes and what it grants per node, and
what a cluster needs from Slurm at run time (node addresses, its steps, the job's state).

Inside an allocation (``SLURM_JOB_ID`` set: a batch script, an ``salloc`` shell, a notebook
server that batchspawner started with ``srun``) a cluster runs on the job's nodes as one job step
(see ``tnt_notebook.cluster.plan``). The job's variables are read, never the step's: inside a step
(``SLURM_STEP_ID`` set, as under batchspawner) ``SLURM_TASKS_PER_NODE`` describes that step,
so the grant per node comes from ``SLURM_NTASKS_PER_NODE`` or ``SLURM_JOB_CPUS_PER_NODE``
instead. Every Slurm command runs with a deadline; a failure is a one-line :class:`SlurmError`.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

SLURM_TIMEOUT = 15.0  # seconds any Slurm command may take
STEP_PREFIX = "tnt-"  # a cluster's job step is named tnt-<cluster id>
_COUNTS_RE = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")
# a job's nodes and what each group of them was granted, in scontrol show job --details
_NODE_GRES = re.compile(r"\bNodes=(\S+) CPU_IDs=\S+ Mem=\S+ GRES=(\S*)")
_GRES_GPUS = re.compile(r"\bgpu(?::[^:(),]+)?:(\d+)")  # gpu:2(IDX:0-1), gpu:a100:1(IDX:0)


class SlurmError(ValueError):
    """Slurm cannot tell what the allocation is (one-line message)."""


def expand_counts(text: str) -> list[int]:
    """Slurm's per-node counts, '2(x3),1' -> [2, 2, 2, 1]."""
    out: list[int] = []
    for part in text.split(","):
        m = _COUNTS_RE.match(part.strip())
        if not m:
            raise SlurmError(f"cannot read Slurm's per-node count {text!r}")
        out += [int(m[1])] * int(m[2] or 1)
    return out


def slurm_command(argv: list[str], timeout: float = SLURM_TIMEOUT) -> str:
    """stdout of a Slurm command; SlurmError with its own message when it fails."""
    try:
        r = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
        )
    except FileNotFoundError:
        raise SlurmError(
            f"{argv[0]} not found: Slurm's client commands are not installed here"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{' '.join(argv)} did not answer within {timeout:g} s") from None
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}"])[-1]
        raise SlurmError(f"{' '.join(argv)} failed: {why}")
    return r.stdout


@dataclass(frozen=True)
class SlurmAllocation:
    """A Slurm job's nodes (in the job's order) and the tasks it grants on each."""

    job_id: str
    nodelist: str  # Slurm's compressed form, e.g. node[01-02]
    nodes: tuple[str, ...]
    tasks_per_node: tuple[int, ...]
    # GPUs the job grants on each node (--gpus-per-node, --gres=gpu:N); None: its variables do
    # not say, Slurm is asked (gpus_granted)
    gpus_per_node: int | None = None

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> SlurmAllocation | None:
        """The allocation that `environ` (default: this process's) runs in; None outside one."""
        env = os.environ if environ is None else environ
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job:
            return None
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not nodelist:
            raise SlurmError(f"Slurm job {job}: SLURM_JOB_NODELIST is not set")
        nodes = tuple(slurm_command(["scontrol", "show", "hostnames", nodelist]).split())
        return cls(job, nodelist, nodes, tuple(_granted(env, len(nodes))), _gpus_granted(env))

    def per_node(self) -> int:
        """The tasks granted on every node (SlurmError when nodes differ)."""
        if len(set(self.tasks_per_node)) != 1:
            grants = ", ".join(
                f"{n}: {k}" for n, k in zip(self.nodes, self.tasks_per_node, strict=True)
            )
            raise SlurmError(
                f"Slurm job {self.job_id} grants different task counts per node ({grants}); "
                "give the ranks per node with --n-per-node"
            )
        return self.tasks_per_node[0]

    def gpus_granted(self) -> int:
        """GPUs the job grants on each node: as its variables say, else as Slurm shows the job
        (an ``salloc`` shell on the login node has no GPU variable, ``--gpus=N`` only the
        total); SlurmError when the nodes are granted different numbers."""
        if self.gpus_per_node is not None:
            return self.gpus_per_node
        out = slurm_command(["scontrol", "show", "job", "--details", "-o", self.job_id])
        grants = {
            nodes: sum(map(int, _GRES_GPUS.findall(gres)))
            for nodes, gres in _NODE_GRES.findall(out)
        }
        if len(set(grants.values())) > 1:
            listed = ", ".join(f"{n}: {k}" for n, k in grants.items())
            raise SlurmError(
                f"Slurm job {self.job_id} grants different GPU counts per node ({listed}); "
                "ranks per node follow the GPUs: ask for them with --gpus-per-node"
            )
        return next(iter(grants.values()), 0)

    def node_addresses(self) -> dict[str, str]:
        """Each node's address as Slurm reaches it (NodeAddr), for names this machine may not
        resolve (the nodes of a cluster seen from its login node)."""
        out = slurm_command(["scontrol", "show", "node", "-o", self.nodelist])
        found = dict(re.findall(r"\bNodeName=(\S+) .*?\bNodeAddr=(\S+)", out))
        return {n: found.get(n, n) for n in self.nodes}

    def state(self) -> str:
        """The job's state (RUNNING, CANCELLED, TIMEOUT...), '' when Slurm cannot say."""
        try:
            out = slurm_command(["scontrol", "show", "job", "-o", self.job_id])
        except SlurmError:
            return ""
        m = re.search(r"\bJobState=(\S+)", out)
        return m[1] if m else ""

    def final_state(self, timeout: float = 10.0) -> str:
        """The job's state, waiting up to `timeout` through COMPLETING (which hides why it ends:
        CANCELLED, TIMEOUT... shows once the nodes have ended its processes)."""
        deadline = time.monotonic() + timeout
        state = self.state()
        while state == "COMPLETING" and time.monotonic() < deadline:
            time.sleep(0.2)
            state = self.state()
        return state

    def steps(self, name: str) -> list[str]:
        """Ids (JOB.STEP) of the job's running steps called `name`."""
        try:
            out = slurm_command(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j"])
        except SlurmError:
            return []
        return [s for s, n in (line.split(maxsplit=1) for line in out.splitlines()) if n == name]

    def cancel_steps(self, name: str) -> list[str]:
        """End the job's steps called `name` on every node (the ranks a launcher could not end,
        on a node it lost); the step ids cancelled."""
        steps = self.steps(name)
        if steps:
            try:
                slurm_command(["scancel", "--quiet", *steps])
            except SlurmError:
                return []
        return steps


def step_name(cluster_id: str) -> str:
    return STEP_PREFIX + cluster_id


def _granted(env: Mapping[str, str], n_nodes: int) -> list[int]:
    """Tasks per node that the job grants (see the module's docstring)."""
    if not env.get("SLURM_STEP_ID") and env.get("SLURM_TASKS_PER_NODE"):
        counts = expand_counts(env["SLURM_TASKS_PER_NODE"])
    elif env.get("SLURM_NTASKS_PER_NODE"):
        counts = [int(env["SLURM_NTASKS_PER_NODE"])] * n_nodes
    elif env.get("SLURM_JOB_CPUS_PER_NODE"):
        per_task = int(env.get("SLURM_CPUS_PER_TASK") or 1)
        counts = [max(1, c // per_task) for c in expand_counts(env["SLURM_JOB_CPUS_PER_NODE"])]
    else:
        counts = [1] * n_nodes
    if len(counts) != n_nodes:
        raise SlurmError(f"Slurm's per-node counts {counts} do not match its {n_nodes} node(s)")
    return counts


def _gpus_granted(env: Mapping[str, str]) -> int | None:
    """GPUs the job grants per node: ``SLURM_GPUS_PER_NODE`` (``--gpus-per-node=[TYPE:]N``),
    else ``SLURM_GPUS_ON_NODE`` (this node's, ``--gres=gpu:N`` too), else the ids in
    ``SLURM_JOB_GPUS``; None when none of them is set."""
    per_node = env.get("SLURM_GPUS_PER_NODE", "").strip()
    if per_node:
        try:  # TYPE:N, or several types: a100:2,v100:1
            return sum(int(part.rsplit(":", 1)[-1]) for part in per_node.split(","))
        except ValueError:
            raise SlurmError(f"cannot read SLURM_GPUS_PER_NODE={per_node!r}") from None
    on_node = env.get("SLURM_GPUS_ON_NODE", "").strip()
    if on_node:
        if not on_node.isdigit():
            raise SlurmError(f"cannot read SLURM_GPUS_ON_NODE={on_node!r}")
        return int(on_node)
    job_gpus = env.get("SLURM_JOB_GPUS", "").strip()
    return len([g for g in job_gpus.split(",") if g.strip()]) if job_gpus else None

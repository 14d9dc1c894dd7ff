"""Tarantella's launcher options, shared by ``%tnt_cluster`` and ``tnt-run``, and the plan they
describe. Each launcher adds them to its own parser, so both speak the same words."""

from __future__ import annotations

from typing import Any

from tnt_notebook import settings
from tnt_notebook.cluster.errors import PlanError
from tnt_notebook.cluster.launchers import LAUNCHERS
from tnt_notebook.cluster.plan import LaunchPlan

# Tarantella's launcher options, shared by %tnt_cluster and tnt-run: (flags, argparse keywords)
LAUNCH_OPTIONS: list[tuple[tuple[str, ...], dict[str, Any]]] = [
    (("-n",), {"type": int, "default": None, "help": "number of ranks on this machine"}),
    (("--hostfile",), {"default": None, "help": "file with one unique host name per line"}),
    (
        ("--n-per-node", "--npernode", "--devices-per-node"),
        {
            "dest": "n_per_node",
            "default": None,
            "help": "ranks per host of the hostfile (1) or per node of the Slurm allocation "
            "(what it grants per node)",
        },
    ),
    (
        ("--launcher",),
        {
            "choices": LAUNCHERS,
            "default": None,
            "help": "inside a Slurm allocation: mpiexec (default; srun starts its proxies) or "
            "srun (one rank per task, PMI2)",
        },
    ),
    (
        ("-x",),
        {
            "dest": "exports",
            "action": "extend",
            "nargs": "+",
            "metavar": "NAME=VALUE",
            "help": "environment variable exported on every rank (repeatable)",
        },
    ),
    (
        ("--fusion-threshold",),
        {
            "type": float,
            "default": None,
            "metavar": "KB",
            "help": "gradient fusion bucket size in KB (TNT_FUSION_THRESHOLD)",
        },
    ),
    (("--no-gpu",), {"action": "store_true", "help": "hide GPUs from the ranks"}),
    (
        ("--reproducible",),
        {
            "action": "store_true",
            "help": "tnt.Model trains to the same bits on any number of ranks (TNT_REPRODUCIBLE)",
        },
    ),
    (
        ("--pin-to-socket",),
        {"action": "store_true", "help": "bind each rank to a NUMA socket with numactl"},
    ),
    (("--python-interpreter",), {"default": None, "help": "the ranks' Python (default: this)"}),
    (("--log-level",), {"default": None, "help": "TNT_LOG_LEVEL on the ranks"}),
    (
        ("--output-on-all-devices",),
        {"action": "store_true", "help": "every rank's output (merged), not only the master's"},
    ),
    (
        ("--collective-timeout",),
        {
            "type": float,
            "default": None,
            "metavar": "SECONDS",
            "help": "bounded wait of every collective on the ranks (default 30 s)",
        },
    ),
    (("--mpiexec",), {"default": None, "help": "MPI launcher (default: $TNT_MPIEXEC or venv's)"}),
    (
        ("--transport",),
        {
            "choices": settings.TRANSPORT.kind,
            "default": None,
            "help": "between nodes: mpi, or gaspi (GPI-2, where the build has it); "
            "default $TNT_TRANSPORT, else mpi",
        },
    ),
    (
        ("--ssh",),
        {
            "default": None,
            "metavar": "COMMAND",
            "help": "how to reach the hosts (default: $HYDRA_LAUNCHER_EXEC, else ssh)",
        },
    ),
    (("--dry-run",), {"action": "store_true", "help": "print the launch plan, start nothing"}),
]


def plan_from_options(options: Any) -> LaunchPlan:
    """The plan that the launchers' shared options describe (``%tnt_cluster``'s and
    ``tnt-run``'s parsed arguments: attributes named as the options, ``exports`` a list of
    NAME=VALUE); options a launcher does not have, or left out, keep the plan's defaults."""
    exports: dict[str, str] = {}
    for item in getattr(options, "exports", None) or []:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise PlanError(f"-x {item!r}: expected NAME=VALUE")
        exports[name] = value
    kwargs: dict[str, Any] = {"exports": exports}
    for key, option in (
        ("n", "n"),
        ("hostfile", "hostfile"),
        ("n_per_node", "n_per_node"),
        ("fusion_threshold_kb", "fusion_threshold"),
        ("no_gpu", "no_gpu"),
        ("reproducible", "reproducible"),
        ("pin_to_socket", "pin_to_socket"),
        ("log_level", "log_level"),
        ("output_on_all_devices", "output_on_all_devices"),
        ("python", "python_interpreter"),
        ("timeout", "timeout"),
        ("collective_timeout", "collective_timeout"),
        ("mpiexec", "mpiexec"),
        ("controller_ip", "controller_ip"),
        ("ssh", "ssh"),
        ("transport", "transport"),
        ("launcher", "launcher"),
    ):
        value = getattr(options, option, None)
        if value is not None and value is not False:
            kwargs[key] = value
    return LaunchPlan(**kwargs)

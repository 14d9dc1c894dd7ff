"""Every ``TNT_*`` environment variable, declared once: its name, kind, unit, default and meaning.

Code reads a variable only through its :class:`Setting` here
(``settings.COLLECTIVE_TIMEOUT.read()``), so a value is validated in one place and has one unit from
option to native code. A launcher's option is turned into the variable it sets by the same
declaration (:meth:`Setting.export`). The table in ``docs/guide/configuration.md`` is
:func:`markdown_table`'s output (a test compares).

Imported by the notebook kernel, the launchers and the ranks alike: it imports nothing heavy.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_TRUE = ("1", "true", "yes", "on")
_FALSE = ("", "0", "false", "no", "off")


@dataclass(frozen=True)
class Setting:
    """One environment variable: ``kind`` is int, float, bool, str or a tuple of the allowed
    words; ``unit`` is how its number counts (``bytes``, ``s``, ``µs``; empty for words)."""

    name: str
    kind: Any
    default: Any
    doc: str
    unit: str = ""
    minimum: float | None = None
    set_by: str = ""  # the launcher option that exports it, when there is one

    def read(self, environ: Mapping[str, str] = os.environ) -> Any:
        """The validated value (the default when unset or empty); a one-line ValueError else."""
        raw = environ.get(self.name, "").strip()
        if not raw:
            return self.default
        return self.parse(raw)

    def parse(self, raw: str) -> Any:
        if isinstance(self.kind, tuple):  # words, matched without regard to case
            for word in self.kind:
                if raw.lower() == word.lower():
                    return word
            raise ValueError(f"{self.name}={raw!r} must be {_one_of(self.kind)}")
        if self.kind is bool:
            if raw.lower() in _TRUE:
                return True
            if raw.lower() in _FALSE:
                return False
            raise ValueError(f"{self.name}={raw!r} must be 1 or 0")
        if self.kind is str:
            return raw
        try:
            value = self.kind(raw)
        except ValueError:
            raise ValueError(f"{self.name}={raw!r} is not a valid {self.kind.__name__}") from None
        self.check(value, f"{self.name}={raw!r}")
        return value

    def check(self, value: float, what: str, unit: str | None = None) -> None:
        """A one-line ValueError when ``value`` is below the minimum; ``what`` names it, ``unit``
        is the unit it counts in where that is not the variable's (an option's)."""
        if self.minimum is not None and value < self.minimum:
            bound = "positive" if self.minimum > 0 else f">= {self.minimum:g}"
            unit = unit or self.unit
            raise ValueError(f"{what} must be {bound}{' ' + unit if unit else ''}, got {value!r}")

    def export(self, value: Any) -> str:
        """The variable's text for ``value`` (what a launcher sets on the ranks)."""
        if self.kind is bool:
            return "1" if value else "0"
        if self.kind is float:
            return f"{value:g}"
        return str(value)


def _one_of(words: tuple[str, ...]) -> str:
    return ", ".join(words[:-1]) + f" or {words[-1]}" if len(words) > 1 else words[0]


# --- collectives (read when a rank's native engine is built) ---
COLLECTIVE_TIMEOUT = Setting(
    "TNT_COLLECTIVE_TIMEOUT",
    float,
    30.0,
    "seconds every collective waits at most for its peers before raising",
    unit="s",
    minimum=1e-9,
    set_by="--collective-timeout",
)
FUSION_THRESHOLD = Setting(
    "TNT_FUSION_THRESHOLD",
    int,
    32768,
    "fusion bucket size in bytes (0 disables fusion); `--fusion-threshold KB` sets it in "
    "Tarantella's unit, KB of 1024 bytes",
    unit="bytes",
    minimum=0,
    set_by="--fusion-threshold",
)
SHM_SEGMENT_BYTES = Setting(
    "TNT_SHM_SEGMENT_BYTES",
    int,
    0,
    "shared memory per local rank; pipeline rounds are half of it (0: the default, 2 MiB)",
    unit="bytes",
    minimum=0,
)
WAIT_SPIN_US = Setting(
    "TNT_WAIT_SPIN_US",
    int,
    -1,
    "how long a waiting rank spins before it sleeps (unset: 2000 where the machine's ranks do "
    "not outnumber its cores, else 0); where it is above 0, a wait on MPI's own collective (the "
    "`mpi` path) polls up to 200 ms, since MPI moves its data only while polled",
    unit="µs",
    minimum=0,
)
ALLREDUCE_PATH = Setting(
    "TNT_ALLREDUCE_PATH",
    ("auto", "engine", "mpi"),
    "auto",
    "`auto`: each allreduce call site takes the engine's own path or `MPI_Allreduce`, whichever "
    "measures faster, probed again now and then; `engine` or `mpi`: always that one (the same "
    "on every rank)",
)
TRANSPORT = Setting(
    "TNT_TRANSPORT",
    ("mpi", "gaspi"),
    "mpi",
    "what carries the engine's step between nodes: MPI's messages, or GASPI's one-sided writes "
    "(GPI-2, {doc}`gaspi`)",
    set_by="--transport",
)
GASPI_PORT = Setting(
    "TNT_GASPI_PORT",
    int,
    0,
    "with `gaspi`: the first of the 384 ports GPI-2 uses on each host (0: a range free on every "
    "host, chosen by the ranks)",
    minimum=0,
)
RANKS_PER_NODE = Setting(
    "TNT_RANKS_PER_NODE",
    int,
    0,
    "topology and testing knob: treat every k consecutive ranks as one node (0: ask MPI which "
    "ranks share memory)",
    minimum=0,
)
# --- the Keras wrapper (read on the ranks) ---
TF_OP = Setting(
    "TNT_TF_OP",
    bool,
    True,
    "`0`: reduce gradients through `tf.numpy_function` instead of the TensorFlow op",
)
OVERLAP = Setting(
    "TNT_OVERLAP",
    ("1", "steps", "0"),
    "1",
    "across hosts, how far a step's gradient buckets overlap: `1` start each as soon as its "
    "gradients exist and finish them after the last start; `steps`: leave them to the next step, "
    "which finishes them just before its forward pass reads the weights (where a step's transfer "
    "outlasts its backprop); `0`: one op per bucket after backprop ({doc}`/allreduce-paths`). "
    "The ranks take the least that any of them says",
)
REPRODUCIBLE = Setting(
    "TNT_REPRODUCIBLE",
    bool,
    False,
    "`1`: `tnt.Model` trains reproducibly unless told otherwise: the same bits on any number of "
    "ranks ({doc}`reproducibility`)",
    set_by="--reproducible",
)
CHECK_REPLICAS = Setting(
    "TNT_CHECK_REPLICAS",
    ("fit", "epoch"),
    "fit",
    "when `fit` checks that every rank holds the same weights: `fit` (once, at its end) or "
    "`epoch` (after every epoch too)",
)
NOTEBOOK_CACHE = Setting(
    "TNT_NOTEBOOK_CACHE",
    str,
    "",
    "where the TensorFlow op is cached (default `$XDG_CACHE_HOME/tnt_notebook`)",
)
TENSORBOARD_ON_ALL_DEVICES = Setting(
    "TNT_TENSORBOARD_ON_ALL_DEVICES",
    bool,
    False,
    "TensorBoard callbacks write on every rank, not only the master",
)
# --- what the launchers set on the ranks ---
NOTEBOOK_RANK = Setting(
    "TNT_NOTEBOOK_RANK",
    bool,
    False,
    "this process is a rank of a notebook's cluster: `fit` publishes its progress to the notebook",
    set_by="%tnt_cluster",
)
OUTPUT_ON_ALL_DEVICES = Setting(
    "TNT_OUTPUT_ON_ALL_DEVICES",
    bool,
    False,
    "every rank's output is shown (merged), not only the master's",
    set_by="--output-on-all-devices",
)
LOG_LEVEL = Setting(
    "TNT_LOG_LEVEL",
    ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
    "",
    "TensorFlow's log level on the ranks (default: errors only; TensorFlow's start-up lines held "
    "back)",
    set_by="--log-level",
)
NO_GPU = Setting(
    "TNT_NO_GPU",
    bool,
    False,
    "the ranks run on CPUs: their `CUDA_VISIBLE_DEVICES` is empty",
    set_by="--no-gpu",
)
GPU_PER_RANK = Setting(
    "TNT_GPU_PER_RANK",
    bool,
    False,
    "each rank keeps only the GPU of its node-local index in `CUDA_VISIBLE_DEVICES` (one of those "
    "the node offers), before TensorFlow is imported ({doc}`gpus`)",
    set_by="the launch rules",
)
# --- the notebook kernel and the launchers ---
GPU_INVENTORY = Setting(
    "TNT_GPU_INVENTORY",
    str,
    "",
    "a recorded `nvidia-smi -L` listing (one `GPU i: NAME (UUID: ...)` line per GPU) read in place "
    "of each host's GPU probe, at that path on each host (default: `nvidia-smi -L`, else the "
    "driver's `/proc/driver/nvidia/gpus`)",
)
MPIEXEC = Setting(
    "TNT_MPIEXEC",
    str,
    "",
    "the MPI launcher `%tnt_cluster`, `tnt-run` and the benchmarks use (default: the `mpich` "
    "wheel's `mpiexec` beside this Python, else the one on `PATH`)",
    set_by="--mpiexec",
)
TIMELINE = Setting(
    "TNT_TIMELINE",
    str,
    "",
    "a directory: every rank records the timeline of sampled train steps, and the master rank "
    "writes its summary, Chrome trace and plot there after each fit",
    set_by="tnt-run --timeline",
)
TIMELINE_STEPS = Setting(
    "TNT_TIMELINE_STEPS",
    int,
    20,
    "how many train steps of each fit the timeline samples (after the first 2 of the fit)",
    minimum=1,
)
PROGRESS_VIEW = Setting(
    "TNT_PROGRESS_VIEW",
    ("widget", "text"),
    "widget",
    "`text`: a text progress view instead of the widget",
)

SETTINGS: tuple[Setting, ...] = tuple(v for v in globals().values() if isinstance(v, Setting))


def exported(pairs: list[tuple[Setting, Any]]) -> dict[str, str]:
    """The variables that set ``pairs`` of (setting, value) on the ranks."""
    return {s.name: s.export(v) for s, v in pairs}


def markdown_table() -> str:
    """The table of ``docs/guide/configuration.md``: one row per variable."""
    rows = ["| variable | unit | default | meaning |", "|---|---|---|---|"]
    for s in SETTINGS:
        default = _shown_default(s)
        meaning = s.doc + (f" (set by `{s.set_by}`)" if s.set_by else "")
        rows.append(f"| `{s.name}` | {s.unit or ''} | {default} | {meaning} |")
    return "\n".join(rows)


def _shown_default(s: Setting) -> str:
    if s.kind is bool:
        return f"`{s.export(s.default)}`"
    if s.default in ("", None) or (s.name == WAIT_SPIN_US.name):
        return "see meaning"
    return f"`{s.default:g}`" if isinstance(s.default, float) else f"`{s.default}`"


if __name__ == "__main__":
    print(markdown_table())

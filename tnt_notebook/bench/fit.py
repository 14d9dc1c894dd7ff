"""``python -m tnt_notebook.bench fit``: training throughput of tnt.Model against its peers.

One run measures, on the same model, the same synthetic data and the same global batch, each
configuration in fresh processes with the same TensorFlow threads per process. The model is
``--model lenet`` (default), the classic LeNet-5 on MNIST-shaped inputs (Tarantella's quick start
and our tutorials train LeNet-5 variants), or ``--model mlp``, a 784-512-512-10 MLP: 15 times
LeNet-5's gradients (2.7 MB) computed in under a third of its time per sample, the worst case for
data parallelism. The configurations:

- ``keras``: plain Keras 3 ``fit`` in one process;
- ``tnt_1`` / ``tnt_2``: ``tnt.Model.fit`` under ``mpiexec -n 1`` / ``-n 2``;
- ``paired_1``: plain Keras and ``tnt.Model`` on 1 rank in one process, alternating epoch by epoch
  (ABBA), so that both see the same phases of a noisy host: the ratio of ``tnt_1`` and ``keras``
  taken from separate processes swings by +-10 % with the host, this one does not;
- ``paired_2``: the 2-rank efficiency from one ``mpiexec -n 2`` world whose epochs rotate
  (ABCD DCBA) over plain Keras on rank 0 alone with the global batch (rank 1 idle: the 1-rank
  reference),
  plain Keras on both ranks independently at half the batch (the ceiling: no communication), the
  same in lock-step (a barrier after every call of the step function: what synchronous training
  would reach if its allreduce took no time: the ceiling's loss to synchronising every step), and
  ``tnt.Model`` on both ranks; the ratios are per rotation, so all four see the same host phase;
- ``mwms_2``: ``tf.distribute.MultiWorkerMirroredStrategy`` with 2 workers on loopback ports. It
  fails in ``fit`` with Keras 3 (keras issue 20585), so it runs the legacy ``tf_keras`` package
  (``TF_USE_LEGACY_KERAS=1``), as stated in the output;
- ``timeline_2`` (``--timeline``): what the timeline costs, from one ``mpiexec -n 2`` world whose
  fits of one epoch each rotate over four ``tnt.Model`` s (each in every place of the rotation
  equally often): ``bare``, whose train step was traced without the timeline's two marks (the
  code without the timeline; the engine's check of its flag stays), ``off`` (as shipped, the
  timeline off), ``on`` (``tnt.timeline(True)``: every fit samples the default steps, then
  gathers them) and ``off_again``, the same as ``off``: its ratio to ``off`` shows what the host
  resolves. Each fit is timed from its epoch's start to its end, the gathering included; the
  ratios are per rotation, their median reported and every one kept. Measured apart, below
  what a noisy host blurs: the time the timeline's recorder takes in each ``on`` fit (its hooks
  and the gathering), and what a step's two marks cost while the timeline is off (a chain of
  marks against a chain of identities).

With ``--hostfile F --n-per-node K``, ``tnt_2`` and ``paired_2`` run 2 x K ranks on the first 2
hosts of F; ``mwms_2`` and ``keras_2x`` (the ceiling as 2 processes) only ever run on this host and
are left out.

Throughput is samples per second in the median epoch after the first (the first traces the step; the
median ignores the occasional 0.4-0.6 s stall in tf.data's iterator teardown that hits single
processes, plain Keras and ``tnt_1`` alike, in some epochs); each configuration runs ``--repeats``
times, interleaved with the others, and the best run is reported. Every epoch's time is in the JSON.
``--steps-per-execution`` K compiles every configuration alike with Keras's
``steps_per_execution=K`` (K steps per call of the step function: Keras's per-call Python cost,
about 0.8 ms here, is then paid once per K steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from tnt_notebook import settings
from tnt_notebook.bench import add_transport_option, use_transport, write_report
from tnt_notebook.cluster.addresses import free_ports
from tnt_notebook.cluster.launchers import default_mpiexec
from tnt_notebook.cluster.processes import die_with_parent

RESULT_TAG = "TNT-BENCH-FIT "
CONFIGS = (
    "keras", "tnt_1", "paired_1", "tnt_2", "paired_2", "mwms_2", "keras_2x", "reproducible_2",
    "timeline_2",
)  # fmt: skip
# --reproducible: the reproducible mode beside the default mode and the ceiling, in one run
REPRODUCIBLE_CONFIGS = ("tnt_2", "reproducible_2", "keras_2x")
# The timeline's ratios of throughput (timeline_2): (numerator, denominator) configurations.
TIMELINE_RATIOS = {
    "off_over_bare": ("off", "bare"),
    "on_over_off": ("on", "off"),
    "off_again_over_off": ("off_again", "off"),  # alike: what the host resolves
}
# Measured only when asked for (--reproducible, --timeline or --configs).
ON_REQUEST = ("reproducible_2", "timeline_2")
LABELS = {
    "keras": "plain Keras 3, 1 process",
    "tnt_1": "tnt.Model, 1 rank",
    "paired_1": "tnt.Model, 1 rank, epochs alternating with plain Keras in one process",
    "tnt_2": "tnt.Model, 2 ranks",
    "paired_2": "tnt.Model, 2 ranks, epochs rotating with 1-process Keras and the ceilings",
    "mwms_2": "MultiWorkerMirroredStrategy, 2 workers (tf_keras, TF_USE_LEGACY_KERAS=1)",
    "keras_2x": "ceiling: 2 independent plain Keras processes at half the batch, summed",
    "reproducible_2": "tnt.Model(reproducible=True), 2 ranks",
    "timeline_2": "tnt.Model, 2 ranks, the timeline off, fits rotating with it on, left out",
}


MODELS = ("mlp", "lenet")


def model_name(args) -> str:
    if args.model == "mlp":
        return f"MLP 784-{args.hidden}-{args.hidden}-10"
    return "LeNet-5 (28x28x1, conv 6-16, dense 120-84-10)"


# The worlds of 2 ranks, or of 2 hosts x K with --hostfile.
MULTI_RANK = ("tnt_2", "paired_2", "reproducible_2", "timeline_2")
# Ratios printed as n/a when their configurations did not run (the others are left out).
ALWAYS_SHOWN = ("paired_tnt_1_over_keras", "scaling_efficiency_2", "paired_scaling_efficiency_2")
# Two processes on this host whatever --hostfile says: compared with tnt_2 on the hosts, their
# ratios would set worlds of different sizes and places against each other.
THIS_HOST_ONLY = ("mwms_2", "keras_2x")


def parser() -> argparse.ArgumentParser:
    """The options of the driver and of its workers (the worker's own are hidden)."""
    p = argparse.ArgumentParser(prog="python -m tnt_notebook.bench fit", description=__doc__)
    p.add_argument("--samples", type=int, default=32768, help="samples per epoch (global)")
    p.add_argument("--epochs", type=int, default=6, help="epochs; the first is not timed")
    p.add_argument("--batch", type=int, default=256, help="global batch size")
    p.add_argument("--model", choices=MODELS, default="lenet", help="the model trained")
    p.add_argument("--hidden", type=int, default=512, help="width of the MLP's hidden layers")
    p.add_argument("--threads", type=int, default=1, help="TF intra-op threads per process")
    p.add_argument("--inter-op-threads", type=int, default=1, help="TF inter-op threads/process")
    p.add_argument(
        "--steps-per-execution",
        type=int,
        default=1,
        help="Keras compile(steps_per_execution=), the same for every configuration (default 1)",
    )
    p.add_argument(
        "--compression",
        choices=("none", "fp16", "bf16"),
        default="none",
        help="tnt.Model(compression=): the dtype gradients travel in (default: their own)",
    )
    p.add_argument(
        "--reproducible",
        action="store_true",
        help="measure tnt.Model(reproducible=True) beside the default mode and the ceiling "
        "(configurations " + ", ".join(REPRODUCIBLE_CONFIGS) + ")",
    )
    p.add_argument(
        "--timeline",
        action="store_true",
        help="measure the timeline's cost: 2 ranks with it off, on and left out, fits rotating "
        "in one world (configuration timeline_2)",
    )
    p.add_argument(
        "--chunk-size",
        type=int,
        default=None,
        help="samples per chunk of the reproducible mode (default: the mode's, 16)",
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per configuration (best kept)")
    p.add_argument(
        "--configs",
        help="comma-separated subset (default: all; with --hostfile all but "
        + ", ".join(THIS_HOST_ONLY)
        + ")",
    )
    p.add_argument("--timeout", type=float, default=600, help="seconds per configuration")
    p.add_argument("--json", default="bench-results/fit.json", help="where to write the results")
    p.add_argument(
        "--hostfile",
        help="run the multi-rank configurations (tnt_2, paired_2) on the first 2 hosts of this "
        "file (mpiexec -f F -ppn K; Hydra's launcher from the environment)",
    )
    p.add_argument(
        "--n-per-node",
        default="1",
        help="ranks per host with --hostfile (default 1): tnt_2 and paired_2 run 2 x K ranks",
    )
    p.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    p.add_argument("--mwms-ports", default="", help=argparse.SUPPRESS)
    p.add_argument("--mwms-index", type=int, default=0, help=argparse.SUPPRESS)
    add_transport_option(p)
    return p


def _worker_args(args, config: str, share: int = 1) -> list[str]:
    """The worker's command line; with ``share`` k it gets 1/k of the samples and of the batch."""
    return [
        "-m",
        "tnt_notebook.bench.fit_worker",
        "--worker",
        config,
        "--samples",
        str(args.samples // share),
        "--epochs",
        str(args.epochs),
        "--batch",
        str(args.batch // share),
        "--model",
        args.model,
        "--hidden",
        str(args.hidden),
        "--threads",
        str(args.threads),
        "--inter-op-threads",
        str(args.inter_op_threads),
        "--steps-per-execution",
        str(args.steps_per_execution),
        "--compression",
        args.compression,
        *(["--chunk-size", str(args.chunk_size)] if args.chunk_size else []),
    ]


def _run(cmds: list[list[str]], env: dict[str, str], timeout: float) -> tuple[str, list[int]]:
    """Start the processes, wait (bounded), kill their process groups at the deadline."""
    procs = [
        subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
            preexec_fn=die_with_parent,  # (and when this process is killed)
        )
        for cmd in cmds
    ]
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            outputs.append(out)
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
        for p in procs:
            p.communicate()
        raise
    return "\n".join(outputs), [p.returncode for p in procs]


def _measure(args, config: str) -> dict[str, Any]:
    env = {
        **os.environ,
        "TF_NUM_INTRAOP_THREADS": str(args.threads),
        "TF_NUM_INTEROP_THREADS": str(args.inter_op_threads),
        "TF_CPP_MIN_LOG_LEVEL": "3",
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("TF_USE_LEGACY_KERAS", None)
    py = [sys.executable, *_worker_args(args, config)]
    if config == "keras":
        cmds = [py]
    elif config == "keras_2x":  # what 2 ranks could reach here if communication were free
        half = [sys.executable, *_worker_args(args, "keras_2x", share=2)]
        cmds = [half, half]
    elif config in MULTI_RANK and args.hostfile:
        k = args.per_node
        cmds = [[default_mpiexec(), "-f", args.hostfile, "-ppn", str(k), "-n", str(2 * k), *py]]
        if config == "paired_2":
            env.setdefault(settings.COLLECTIVE_TIMEOUT.name, f"{args.timeout:g}")
    elif config in ("tnt_1", "paired_1", *MULTI_RANK):
        cmds = [[default_mpiexec(), "-n", config[-1], *py]]
        if config == "paired_2":  # rank 1 waits in a barrier through rank 0's solo epochs
            env.setdefault(settings.COLLECTIVE_TIMEOUT.name, f"{args.timeout:g}")
    else:
        env["TF_USE_LEGACY_KERAS"] = "1"
        ports = ",".join(str(p) for p in free_ports("127.0.0.1", 2))
        cmds = [[*py, "--mwms-ports", ports, "--mwms-index", str(i)] for i in range(2)]
    try:
        output, codes = _run(cmds, env, args.timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {args.timeout} s"}
    tag = len(RESULT_TAG)
    reports = [json.loads(x[tag:]) for x in output.splitlines() if x.startswith(RESULT_TAG)]
    if len(reports) == (2 if config == "keras_2x" else 1):
        result = reports[0]
        result["samples_per_s"] = sum(r["samples_per_s"] for r in reports)
        return result
    tail = "\n".join(output.strip().splitlines()[-8:])
    return {"error": f"exit codes {codes}: {tail}"}


def _best(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The fastest successful run (others listed under ``runs_samples_per_s``), else the error."""
    ok = [r for r in runs if "samples_per_s" in r]
    if not ok:
        return runs[-1]
    best = dict(max(ok, key=lambda r: r["samples_per_s"]))
    best["runs_samples_per_s"] = [r.get("samples_per_s") for r in runs]
    if "keras_samples_per_s" in best:  # paired_1: the median of the runs' own ratios
        best["runs_over_keras"] = [r["samples_per_s"] / r["keras_samples_per_s"] for r in ok]
        best["over_keras"] = statistics.median(best["runs_over_keras"])
    for key in ("efficiency", "ceiling_efficiency", "lockstep_efficiency"):  # paired_2: likewise
        if key in best:
            best[f"runs_{key}"] = [r[key] for r in ok]
            best[key] = statistics.median(best[f"runs_{key}"])
    for key in TIMELINE_RATIOS:  # timeline_2: every rotation's ratio, of all runs
        if key in best:
            best[f"rotations_{key}"] = [x for r in ok for x in r[f"rotations_{key}"]]
            best[key] = statistics.median(best[f"rotations_{key}"])
    return best


def _ratio(a: dict, b: dict, factor: float = 1.0) -> float | None:
    if "samples_per_s" in a and "samples_per_s" in b:
        return a["samples_per_s"] / (factor * b["samples_per_s"])
    return None


def main(argv: list[str] | None = None) -> int:
    options = parser()
    args = options.parse_args(argv)
    if args.steps_per_execution < 1:
        options.error("--steps-per-execution must be at least 1")
    if args.hostfile:
        from tnt_notebook.cluster.errors import HostfileError
        from tnt_notebook.cluster.hostfile import read_hostfile, validate_n_per_node

        try:
            hosts = read_hostfile(args.hostfile)
            per_node = validate_n_per_node(args.n_per_node)
        except HostfileError as e:
            options.error(str(e))
        if len(hosts) < 2:
            options.error("--hostfile runs the multi-rank configurations on 2 hosts: give 2+")
        args.per_node = per_node
    transport = use_transport(args)
    if args.configs is None and args.reproducible:
        configs = [c for c in REPRODUCIBLE_CONFIGS if not (args.hostfile and c in THIS_HOST_ONLY)]
    elif args.configs is None and args.timeline:
        configs = ["timeline_2"]
    elif args.configs is None:
        default = [c for c in CONFIGS if c not in ON_REQUEST]
        configs = [c for c in default if not (args.hostfile and c in THIS_HOST_ONLY)]
    else:
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configurations {sorted(unknown)}; choose from {CONFIGS}")
    if args.hostfile and set(configs) & set(THIS_HOST_ONLY):
        options.error(
            f"configuration(s) {', '.join(c for c in configs if c in THIS_HOST_ONLY)} always "
            "run on this host: with --hostfile, paired_2 gives the ceiling on the hosts"
        )
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    for _ in range(max(1, args.repeats)):  # interleaved, so slow phases of a noisy host spread out
        for c in configs:
            runs[c].append(_measure(args, c))
    results = {c: _best(runs[c]) for c in configs}
    # The multi-rank world (the "2" of tnt_2 and paired_2): 2 ranks, or 2 hosts x K.
    world = 2 * args.per_node if args.hostfile else 2
    where = f"2 hosts x {args.per_node} of {args.hostfile}" if args.hostfile else "this host"
    labels = {c: LABELS[c].replace("2 ranks", f"{world} ranks") for c in configs}
    ratios = {
        "tnt_1_over_keras": _ratio(results.get("tnt_1", {}), results.get("keras", {})),
        "paired_tnt_1_over_keras": results.get("paired_1", {}).get("over_keras"),
        "scaling_efficiency_2": _ratio(results.get("tnt_2", {}), results.get("tnt_1", {}), world),
        "paired_scaling_efficiency_2": results.get("paired_2", {}).get("efficiency"),
        "paired_ceiling_efficiency_2": results.get("paired_2", {}).get("ceiling_efficiency"),
        "paired_lockstep_efficiency_2": results.get("paired_2", {}).get("lockstep_efficiency"),
        "tnt_2_over_mwms_2": _ratio(results.get("tnt_2", {}), results.get("mwms_2", {})),
        "ceiling_efficiency_2": _ratio(results.get("keras_2x", {}), results.get("tnt_1", {}), 2.0),
        "tnt_2_over_ceiling": _ratio(results.get("tnt_2", {}), results.get("keras_2x", {})),
    }
    if "reproducible_2" in results:
        reproducible = results["reproducible_2"]
        ratios["reproducible_2_over_tnt_2"] = _ratio(reproducible, results.get("tnt_2", {}))
        ratios["reproducible_2_over_ceiling"] = _ratio(reproducible, results.get("keras_2x", {}))
    for key in TIMELINE_RATIOS if "timeline_2" in results else ():
        ratios[f"timeline_{key}"] = results["timeline_2"].get(key)
    print(
        f"fit throughput: {model_name(args)}, {args.samples} synthetic "
        f"samples/epoch, global batch {args.batch}, {args.epochs} epochs "
        "(median epoch after the first), "
        f"{args.threads} intra-op / {args.inter_op_threads} inter-op TF threads per process, "
        f"steps_per_execution {args.steps_per_execution}, "
        f"gradients compressed: {args.compression}, "
        f"best of {max(1, args.repeats)} interleaved runs, tnt.Model's ranks with {transport} "
        "between nodes"
    )
    print(f"{'configuration':<76} {'samples/s':>10}")
    for c in configs:
        r = results[c]
        value = f"{r['samples_per_s']:10.0f}" if "samples_per_s" in r else "    failed"
        print(f"{labels[c]:<76} {value}")
        if "error" in r:
            print(f"  error: {r['error']}")
        if "on_samples_per_s" in r:
            print(
                f"  the timeline left out / off / on: {r['bare_samples_per_s']:.0f} / "
                f"{r['samples_per_s']:.0f} / {r['on_samples_per_s']:.0f} samples/s; on, each fit "
                f"of {r['steps_per_fit']} steps sampled {r['sampled_steps']} of them, its "
                f"recorder taking {100 * r['on_recorder_share']:.2f} % of the fit (median)"
            )
            print(
                f"  off, a step's 2 marks: {2e6 * r['off_mark_seconds']:.2f} us, "
                f"{100 * r['off_marks_share']:.4f} % of the step"
            )
            for key in TIMELINE_RATIOS:
                values = r[f"rotations_{key}"]
                print(f"  {key} per rotation: {min(values):.3f}-{max(values):.3f}, "
                      f"{len(values)} rotations")  # fmt: skip
    names = {
        "tnt_1_over_keras": "tnt.Model 1 rank / plain Keras, separate processes",
        "paired_tnt_1_over_keras": "tnt.Model 1 rank / plain Keras, paired epochs (target >= 0.97)",
        "scaling_efficiency_2": f"{world}-rank scaling efficiency thr({world}) / ({world} thr(1)) "
        "(target >= 0.9)",
        "paired_scaling_efficiency_2": f"{world}-rank scaling efficiency, rotating epochs "
        "(target >= 0.9)",
        "paired_ceiling_efficiency_2": "the ceiling's efficiency, rotating epochs",
        "paired_lockstep_efficiency_2": "the ceiling in lock-step (a barrier per step), rotating",
        "tnt_2_over_mwms_2": "tnt.Model 2 ranks / MWMS 2 workers (target > 1)",
        "ceiling_efficiency_2": "ceiling / (2 thr(1)): best efficiency this machine allows",
        "tnt_2_over_ceiling": "tnt.Model 2 ranks / ceiling",
        "reproducible_2_over_tnt_2": "reproducible mode / default mode, 2 ranks (target >= 0.85)",
        "reproducible_2_over_ceiling": "reproducible mode 2 ranks / ceiling",
        "timeline_off_over_bare": "timeline off / its marks left out, rotating fits "
        "(target >= 0.995)",
        "timeline_on_over_off": "timeline on, sampling / off, rotating fits (target >= 0.98)",
        "timeline_off_again_over_off": "timeline off / off, the same fits again: the resolution",
    }
    for key, label in names.items():
        value = ratios.get(key)
        if value is None and (key not in ALWAYS_SHOWN or args.timeline):
            continue
        print(f"{label:<76} {'n/a' if value is None else f'{value:10.3f}':>10}")
    print("MWMS runs tf_keras (TF_USE_LEGACY_KERAS=1): it fails with Keras 3 (keras issue 20585).")
    report = {
        "benchmark": "fit",
        "config": {
            "model": model_name(args),
            "samples_per_epoch": args.samples,
            "global_batch": args.batch,
            "epochs": args.epochs,
            "timed_epochs": max(1, args.epochs - 1),
            "repeats": max(1, args.repeats),
            "statistic": "best of repeats (paired ratios: median of the runs' ratios; the "
            "timeline's: median of every rotation's)",
            "intra_op_threads": args.threads,
            "inter_op_threads": args.inter_op_threads,
            "steps_per_execution": args.steps_per_execution,
            "compression": args.compression,
            "transport": transport,
            "optimizer": "SGD(0.01)",
            "mwms_note": "tf_keras with TF_USE_LEGACY_KERAS=1 (Keras 3 fails: keras issue 20585)",
            "two_rank_worlds": f"{world} ranks on {where}",
        },
        "labels": labels,
        "results": results,
        "ratios": ratios,
    }
    write_report(args.json, report)
    return 0 if all("samples_per_s" in r for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

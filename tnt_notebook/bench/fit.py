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
  (``TF_USE_LEGACY_KERAS=1``), as stated in the output.

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
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tnt_notebook.bench import add_transport_option, use_transport, write_report
from tnt_notebook.processes import die_with_parent

RESULT_TAG = "TNT-BENCH-FIT "
CONFIGS = ("keras", "tnt_1", "paired_1", "tnt_2", "paired_2", "mwms_2", "keras_2x")
LABELS = {
    "keras": "plain Keras 3, 1 process",
    "tnt_1": "tnt.Model, 1 rank",
    "paired_1": "tnt.Model, 1 rank, epochs alternating with plain Keras in one process",
    "tnt_2": "tnt.Model, 2 ranks",
    "paired_2": "tnt.Model, 2 ranks, epochs rotating with 1-process Keras and the ceilings",
    "mwms_2": "MultiWorkerMirroredStrategy, 2 workers (tf_keras, TF_USE_LEGACY_KERAS=1)",
    "keras_2x": "ceiling: 2 independent plain Keras processes at half the batch, summed",
}


MODELS = ("mlp", "lenet")


def _model_name(args) -> str:
    if args.model == "mlp":
        return f"MLP 784-{args.hidden}-{args.hidden}-10"
    return "LeNet-5 (28x28x1, conv 6-16, dense 120-84-10)"


# Ratios printed as n/a when their configurations did not run (the others are left out).
ALWAYS_SHOWN = ("paired_tnt_1_over_keras", "scaling_efficiency_2", "paired_scaling_efficiency_2")
# Two processes on this host whatever --hostfile says: compared with tnt_2 on the hosts, their
# ratios would set worlds of different sizes and places against each other.
THIS_HOST_ONLY = ("mwms_2", "keras_2x")


def _parser() -> argparse.ArgumentParser:
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


# -- worker side (runs in the measured processes) ----------------------------------------------
def _data(args, tf, np, share: int = 1):
    """The synthetic data set; with ``share`` k, 1/k of the samples in batches of 1/k."""
    rng = np.random.default_rng(0)
    samples = args.samples // share
    x = rng.normal(size=(samples, *_input_shape(args))).astype("float32")
    y = rng.integers(0, 10, size=samples).astype("int64")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch // share).cache()


def _input_shape(args) -> tuple[int, ...]:
    return (784,) if args.model == "mlp" else (28, 28, 1)


def _model(keras, args):
    """A fresh, uncompiled copy of the ``--model`` (every configuration builds its own)."""
    layers = keras.layers
    if args.model == "mlp":
        body = [
            layers.Dense(args.hidden, activation="relu"),
            layers.Dense(args.hidden, activation="relu"),
        ]
    else:
        body = [
            layers.Conv2D(6, 5, activation="relu"),
            layers.MaxPooling2D(),
            layers.Conv2D(16, 5, activation="relu"),
            layers.MaxPooling2D(),
            layers.Flatten(),
            layers.Dense(120, activation="relu"),
            layers.Dense(84, activation="relu"),
        ]
    return keras.Sequential([keras.Input(_input_shape(args)), *body, layers.Dense(10)])


def _compile(model, keras, args) -> None:
    model.compile(
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        steps_per_execution=args.steps_per_execution,
    )


def _timer(keras):
    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times: list[float] = []
            self._t0 = 0.0

        def on_epoch_begin(self, epoch, logs=None):
            self._t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.times.append(time.perf_counter() - self._t0)

    return EpochTimer()


def _lockstep(keras, barrier):
    class Lockstep(keras.callbacks.Callback):
        """Every rank waits for the slowest after each step, as synchronous training does."""

        def on_train_batch_end(self, batch, logs=None):
            barrier()

    return Lockstep()


def _samples_per_s(args, times: list[float]) -> float:
    return args.samples / statistics.median(times[1:] or times)


def _paired(args, tf, np, keras) -> None:
    """Epochs rotating over 1-process Keras (rank 0), the ceiling, the ceiling in lock-step and
    tnt.Model on all P ranks; see the module (there P = 2)."""
    import tnt_notebook as tnt
    from tnt_notebook.keras.data import without_autotune_model

    p = tnt.get_size()
    solo, share, lockstep = _model(keras, args), _model(keras, args), _model(keras, args)
    wrapped = tnt.Model(_model(keras, args), compression=args.compression)
    for model in (solo, share, lockstep, wrapped):
        _compile(model, keras, args)
    runs = {
        "solo": (solo, _data(args, tf, np)),
        "ceiling": (share, without_autotune_model(_data(args, tf, np, share=p))),
        "lockstep": (lockstep, without_autotune_model(_data(args, tf, np, share=p))),
        "tnt": (wrapped, _data(args, tf, np)),
    }
    timers = {name: _timer(keras) for name in runs}
    barrier_per_step = [_lockstep(keras, tnt.barrier)]
    for epoch in range(args.epochs):
        for name in list(runs) if epoch % 2 == 0 else list(runs)[::-1]:
            tnt.barrier()  # all start together; the others wait here while rank 0 runs alone
            if name == "solo" and not tnt.is_master_rank():
                continue
            model, data = runs[name]
            extra = barrier_per_step if name == "lockstep" else []
            model.fit(data, initial_epoch=epoch, epochs=epoch + 1, verbose=0,
                      callbacks=[timers[name], *extra])  # fmt: skip
    # The ceilings' throughput in an epoch: the processes' samples/s, summed.
    shares = {
        name: [tnt.broadcast(timers[name].times, root=q) for q in range(p)]
        for name in ("ceiling", "lockstep")
    }
    if not tnt.is_master_rank():
        return
    per_epoch = {
        "solo": [args.samples / t for t in timers["solo"].times],
        **{
            name: [sum(args.samples / p / t[e] for t in times) for e in range(args.epochs)]
            for name, times in shares.items()
        },
        "tnt": [args.samples / t for t in timers["tnt"].times],
    }
    timed = range(1, args.epochs) or range(args.epochs)  # as _samples_per_s: after the first

    def efficiency(name: str) -> float:
        return statistics.median(per_epoch[name][e] / (p * per_epoch["solo"][e]) for e in timed)

    _report(
        args,
        wrapped,
        timers["tnt"].times,
        {
            "keras": keras.__version__,
            "ranks": p,
            "solo_epoch_seconds": timers["solo"].times,
            "ceiling_epoch_seconds": shares["ceiling"],
            "lockstep_epoch_seconds": shares["lockstep"],
            **{
                f"{name}_samples_per_s": statistics.median(per_epoch[name][e] for e in timed)
                for name in ("solo", "ceiling", "lockstep")
            },
            "efficiency": efficiency("tnt"),
            "ceiling_efficiency": efficiency("ceiling"),
            "lockstep_efficiency": efficiency("lockstep"),
        },
    )


def _report(args, model, times: list[float], extra: dict[str, Any]) -> None:
    print(
        RESULT_TAG
        + json.dumps(
            {
                "samples_per_s": _samples_per_s(args, times),
                "parameters": model.count_params(),  # which model this worker trained
                "timed_epochs": len(times[1:] or times),
                "steps_per_execution": args.steps_per_execution,  # as this worker compiled
                # how this worker's gradients travelled (None: a plain Keras model)
                "compression": model._tnt.compression.value if hasattr(model, "_tnt") else None,
                "epoch_seconds": times,
                **extra,
            }
        ),
        flush=True,
    )


def _worker(args) -> None:
    import numpy as np

    if args.worker == "mwms_2":
        ports = args.mwms_ports.split(",")
        os.environ["TF_CONFIG"] = json.dumps(
            {
                "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
                "task": {"type": "worker", "index": args.mwms_index},
            }
        )
    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    tf.config.threading.set_inter_op_parallelism_threads(args.inter_op_threads)
    if args.worker == "mwms_2":
        keras = tf.keras  # tf_keras, because TF_USE_LEGACY_KERAS=1 is set by the parent
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        with strategy.scope():
            model = _model(keras, args)
            _compile(model, keras, args)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA
        )
        dataset = _data(args, tf, np).with_options(options)
        timer = _timer(keras)
        model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=[timer])
        if args.mwms_index == 0:
            _report(args, model, timer.times, {"keras": "tf_keras", "tensorflow": tf.__version__})
        return
    import keras

    if args.worker == "paired_2":
        _paired(args, tf, np, keras)
        return
    dataset = _data(args, tf, np)
    if args.worker == "keras_2x":  # the same tf.data options as tnt.Model uses on 2 ranks
        from tnt_notebook.keras.data import without_autotune_model

        dataset = without_autotune_model(dataset)
    timer = _timer(keras)
    if args.worker in ("keras", "keras_2x"):
        model = _model(keras, args)
        _compile(model, keras, args)
        model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=[timer])
        _report(args, model, timer.times, {"keras": keras.__version__})
        return
    import tnt_notebook as tnt

    if args.worker == "paired_1":
        plain = _model(keras, args)
        _compile(plain, keras, args)
        wrapped = tnt.Model(_model(keras, args), compression=args.compression)
        _compile(wrapped, keras, args)
        runs = [(plain, _timer(keras)), (wrapped, _timer(keras))]
        for epoch in range(args.epochs):
            for model, epoch_timer in runs if epoch % 2 == 0 else runs[::-1]:
                model.fit(dataset, initial_epoch=epoch, epochs=epoch + 1, verbose=0,
                          callbacks=[epoch_timer])  # fmt: skip
        keras_times = runs[0][1].times
        _report(
            args,
            wrapped,
            runs[1][1].times,
            {
                "keras": keras.__version__,
                "ranks": 1,
                "keras_epoch_seconds": keras_times,
                "keras_samples_per_s": _samples_per_s(args, keras_times),
            },
        )
        return
    model = tnt.Model(_model(keras, args), compression=args.compression)
    _compile(model, keras, args)
    model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=[timer])
    if tnt.is_master_rank():
        _report(args, model, timer.times, {"keras": keras.__version__, "ranks": tnt.get_size()})


# -- driver side --------------------------------------------------------------------------------
def _mpiexec() -> str:
    return os.environ.get("TNT_MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")


def _free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def _worker_args(args, config: str, share: int = 1) -> list[str]:
    """The worker's command line; with ``share`` k it gets 1/k of the samples and of the batch."""
    return [
        "-m",
        "tnt_notebook.bench.fit",
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
    elif config in ("tnt_2", "paired_2") and args.hostfile:
        k = args.per_node
        cmds = [[_mpiexec(), "-f", args.hostfile, "-ppn", str(k), "-n", str(2 * k), *py]]
        if config == "paired_2":
            env.setdefault("TNT_COLLECTIVE_TIMEOUT", str(args.timeout))
    elif config in ("tnt_1", "paired_1", "tnt_2", "paired_2"):
        cmds = [[_mpiexec(), "-n", config[-1], *py]]
        if config == "paired_2":  # rank 1 waits in a barrier through rank 0's solo epochs
            env.setdefault("TNT_COLLECTIVE_TIMEOUT", str(args.timeout))
    else:
        env["TF_USE_LEGACY_KERAS"] = "1"
        ports = ",".join(str(p) for p in _free_ports(2))
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
    return best


def _ratio(a: dict, b: dict, factor: float = 1.0) -> float | None:
    if "samples_per_s" in a and "samples_per_s" in b:
        return a["samples_per_s"] / (factor * b["samples_per_s"])
    return None


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.steps_per_execution < 1:
        parser.error("--steps-per-execution must be at least 1")
    if args.hostfile and not args.worker:
        from tnt_notebook.launch import HostfileError, read_hostfile, validate_n_per_node

        try:
            hosts = read_hostfile(args.hostfile)
            per_node = validate_n_per_node(args.n_per_node)
        except HostfileError as e:
            parser.error(str(e))
        if len(hosts) < 2:
            parser.error("--hostfile runs the multi-rank configurations on 2 hosts: give 2 or more")
        args.per_node = per_node
    transport = use_transport(args)
    if args.worker:
        _worker(args)
        return 0
    if args.configs is None:
        configs = [c for c in CONFIGS if not (args.hostfile and c in THIS_HOST_ONLY)]
    else:
        configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(configs) - set(CONFIGS)
    if unknown:
        raise SystemExit(f"unknown configurations {sorted(unknown)}; choose from {CONFIGS}")
    if args.hostfile and set(configs) & set(THIS_HOST_ONLY):
        parser.error(
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
    print(
        f"fit throughput: {_model_name(args)}, {args.samples} synthetic "
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
    }
    for key, label in names.items():
        value = ratios[key]
        if value is None and key not in ALWAYS_SHOWN:
            continue
        print(f"{label:<76} {'n/a' if value is None else f'{value:10.3f}':>10}")
    print("MWMS runs tf_keras (TF_USE_LEGACY_KERAS=1): it fails with Keras 3 (keras issue 20585).")
    report = {
        "benchmark": "fit",
        "config": {
            "model": _model_name(args),
            "samples_per_epoch": args.samples,
            "global_batch": args.batch,
            "epochs": args.epochs,
            "timed_epochs": max(1, args.epochs - 1),
            "repeats": max(1, args.repeats),
            "statistic": "best of repeats (paired ratios: median of the runs' ratios)",
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

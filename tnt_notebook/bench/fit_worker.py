"""``python -m tnt_notebook.bench.fit_worker --worker CONFIG ...``: one measured process of
``bench fit`` (:mod:`tnt_notebook.bench.fit`, which starts it and reads the line it prints).

It builds the model and the synthetic data the driver's options describe, trains the
configuration ``CONFIG`` (plain Keras, ``tnt.Model``, the paired rotations, MWMS), and prints one
result line (:data:`~tnt_notebook.bench.fit.RESULT_TAG`, then JSON) with every epoch's time.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from typing import Any

from tnt_notebook.bench import use_transport
from tnt_notebook.bench.fit import RESULT_TAG, TIMELINE_RATIOS, parser


def synthetic_data(args, tf, np, share: int = 1):
    """The synthetic data set; with ``share`` k, 1/k of the samples in batches of 1/k."""
    rng = np.random.default_rng(0)
    samples = args.samples // share
    x = rng.normal(size=(samples, *_input_shape(args))).astype("float32")
    y = rng.integers(0, 10, size=samples).astype("int64")
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch // share).cache()


def _input_shape(args) -> tuple[int, ...]:
    return (784,) if args.model == "mlp" else (28, 28, 1)


def build_model(keras, args):
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


def _timer(keras, to_fit_end: bool = False):
    """Each epoch's time; ``to_fit_end``: until the fit's end (what the fit's end does counted)."""

    class EpochTimer(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.times: list[float] = []
            self._t0 = 0.0

        def on_epoch_begin(self, epoch, logs=None):
            self._t0 = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            if not to_fit_end:
                self.times.append(time.perf_counter() - self._t0)

        def on_train_end(self, logs=None):
            if to_fit_end:
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
    solo, share, lockstep = (
        build_model(keras, args),
        build_model(keras, args),
        build_model(keras, args),
    )
    wrapped = tnt.Model(build_model(keras, args), compression=args.compression)
    for model in (solo, share, lockstep, wrapped):
        _compile(model, keras, args)
    runs = {
        "solo": (solo, synthetic_data(args, tf, np)),
        "ceiling": (share, without_autotune_model(synthetic_data(args, tf, np, share=p))),
        "lockstep": (lockstep, without_autotune_model(synthetic_data(args, tf, np, share=p))),
        "tnt": (wrapped, synthetic_data(args, tf, np)),
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


@contextlib.contextmanager
def _without_timeline_marks():
    """A train step traced here has no timeline marks: the step as it would be without the
    timeline."""
    from tnt_notebook.keras import timeline_recorder

    shipped = timeline_recorder.mark
    timeline_recorder.mark = lambda library, label, tensors: tensors
    try:
        yield
    finally:
        timeline_recorder.mark = shipped


@contextlib.contextmanager
def _recorder_timed(spent: list[float]):
    """Adds to ``spent[0]`` the time the timeline's recorder takes in a fit: its hooks around
    the sampled steps and the gathering at the end (its Python cost, which the host's noise
    cannot blur)."""
    from tnt_notebook.rank.timeline import Recorder

    shipped = {name: getattr(Recorder, name) for name in ("begin_step", "end_step", "finish")}

    def timed(method):
        def wrapper(self):
            start = time.perf_counter()
            try:
                return method(self)
            finally:
                spent[0] += time.perf_counter() - start

        return wrapper

    for name, method in shipped.items():
        setattr(Recorder, name, timed(method))
    try:
        yield
    finally:
        for name, method in shipped.items():
            setattr(Recorder, name, method)


def _timeline(args, tf, np, keras) -> None:
    """Fits of one epoch rotating over tnt.Model with the timeline left out, off, on and off
    again, on all ranks (see :mod:`tnt_notebook.bench.fit`)."""
    import tnt_notebook as tnt

    names = ("bare", "off", "on", "off_again")
    models = {name: tnt.Model(build_model(keras, args), compression=args.compression)
              for name in names}  # fmt: skip
    for model in models.values():
        _compile(model, keras, args)
    data = synthetic_data(args, tf, np)
    timers = {name: _timer(keras, to_fit_end=True) for name in names}
    recorder_seconds: list[float] = []  # per "on" fit: in the recorder's Python hooks
    for epoch in range(args.epochs):
        for name in _rotation(names, epoch):
            tnt.timeline(name == "on")
            bare = _without_timeline_marks() if name == "bare" else contextlib.nullcontext()
            spent = [0.0]
            with bare, _recorder_timed(spent):
                models[name].fit(data, initial_epoch=epoch, epochs=epoch + 1, verbose=0,
                                 callbacks=[timers[name]])  # fmt: skip
            if name == "on":
                recorder_seconds.append(spent[0])
    tnt.timeline(False)
    if not tnt.is_master_rank():
        return
    times = {name: timers[name].times for name in names}
    timed = range(1, args.epochs) or range(args.epochs)  # as _samples_per_s: after the first
    summary = tnt.timeline_summary()
    step_s = statistics.median(times["off"][e] for e in timed) / -(-args.samples // args.batch)
    mark_s = _mark_seconds(tf)
    _report(
        args,
        models["off"],
        times["off"],
        {
            "keras": keras.__version__,
            "ranks": tnt.get_size(),
            **{f"{name}_epoch_seconds": times[name] for name in ("bare", "on", "off_again")},
            "bare_samples_per_s": _samples_per_s(args, times["bare"]),
            "on_samples_per_s": _samples_per_s(args, times["on"]),
            **_rotation_ratios(times, timed),
            "off_mark_seconds": mark_s,  # one mark, the timeline off; a step has 2
            "off_marks_share": 2 * mark_s / step_s,
            "on_recorder_seconds": recorder_seconds,
            "on_recorder_share": statistics.median(
                recorder_seconds[e] / times["on"][e] for e in timed
            ),
            "steps_per_fit": -(-args.samples // args.batch),
            "sampled_steps": len(summary["ranks"][0]["steps"]) if summary else 0,
        },
    )


def _mark_seconds(tf, chained: int = 2000, calls: int = 30) -> float:
    """What one of the train step's timeline marks costs while the timeline is off: a chain of
    marks against a chain of identities, best of ``calls``, per link."""
    from tnt_notebook.keras.allreduce_op import op_library

    library = op_library()

    def chain(link):
        @tf.function
        def run(x):
            for _ in range(chained):
                x = link(x)
            return x

        return run

    marked = chain(lambda x: library.tnt_timeline_mark([x], label=0)[0])
    plain = chain(tf.identity)
    x = tf.ones([8])
    best = {}
    for f in (marked, plain):
        f(x)  # (traced)
        best[f] = min(_seconds(f, x) for _ in range(calls))
    return max(0.0, best[marked] - best[plain]) / chained


def _seconds(f, x) -> float:
    start = time.perf_counter()
    f(x)
    return time.perf_counter() - start


def _rotation(names: tuple[str, ...], epoch: int) -> tuple[str, ...]:
    """The order of the rotation ``epoch``: shifted by one each time, reversed every other
    round, so that every configuration takes every place equally often."""
    k = epoch % len(names)
    order = names[k:] + names[:k]
    return order[::-1] if (epoch // len(names)) % 2 else order


def _rotation_ratios(times: dict[str, list[float]], timed: range) -> dict[str, Any]:
    """The throughput ratios of the timeline's rotations (``TIMELINE_RATIOS``): each rotation's,
    and their median."""
    out: dict[str, Any] = {}
    for key, (slow, fast) in TIMELINE_RATIOS.items():
        out[f"rotations_{key}"] = [times[fast][e] / times[slow][e] for e in timed]
        out[key] = statistics.median(out[f"rotations_{key}"])
    return out


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
            model = build_model(keras, args)
            _compile(model, keras, args)
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA
        )
        dataset = synthetic_data(args, tf, np).with_options(options)
        timer = _timer(keras)
        model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=[timer])
        if args.mwms_index == 0:
            _report(args, model, timer.times, {"keras": "tf_keras", "tensorflow": tf.__version__})
        return
    import keras

    if args.worker == "paired_2":
        _paired(args, tf, np, keras)
        return
    if args.worker == "timeline_2":
        _timeline(args, tf, np, keras)
        return
    dataset = synthetic_data(args, tf, np)
    if args.worker == "keras_2x":  # the same tf.data options as tnt.Model uses on 2 ranks
        from tnt_notebook.keras.data import without_autotune_model

        dataset = without_autotune_model(dataset)
    timer = _timer(keras)
    if args.worker in ("keras", "keras_2x"):
        model = build_model(keras, args)
        _compile(model, keras, args)
        model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=[timer])
        _report(args, model, timer.times, {"keras": keras.__version__})
        return
    import tnt_notebook as tnt

    if args.worker == "paired_1":
        plain = build_model(keras, args)
        _compile(plain, keras, args)
        wrapped = tnt.Model(build_model(keras, args), compression=args.compression)
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
    if args.worker == "reproducible_2":
        model = tnt.Model(build_model(keras, args), reproducible=True, chunk_size=args.chunk_size)
    else:
        model = tnt.Model(build_model(keras, args), compression=args.compression)
    _compile(model, keras, args)
    model.fit(dataset, epochs=args.epochs, verbose=0, callbacks=[timer])
    if tnt.is_master_rank():
        _report(args, model, timer.times, {"keras": keras.__version__, "ranks": tnt.get_size()})


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    use_transport(args)
    _worker(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

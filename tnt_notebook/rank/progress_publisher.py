"""The master rank's live progress: a Keras callback that publishes the aggregated state of a fit,
evaluate or predict as notebook display data.

:func:`progress_callback` is the one place that decides between a live notebook display and
Keras's own text progress bar. Inside a rank of a notebook's cluster (``TNT_NOTEBOOK_RANK=1``) it
returns a Keras callback that publishes the aggregated state as display data of MIME type
:data:`~tnt_notebook.progress_payload.PROGRESS_MIME` under a display id, updated in place with
``update_display_data`` and rate-limited so fast models are not slowed down. Elsewhere (scripts
under ``mpiexec``) it returns None and Keras prints its text progress on the master rank. The
notebook renders the payloads (:mod:`tnt_notebook.notebook.progress_views`).
"""

from __future__ import annotations

import contextlib
import functools
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

from tnt_notebook import settings
from tnt_notebook.progress_payload import (
    MODES,
    PAYLOAD_VERSION,
    PROGRESS_MIME,
    display_publish,
    finite_floats,
    normalize_verbose,
    ordered,
    text_line,
)
from tnt_notebook.rank import device

# Seconds between two live updates: one per second. Every update costs CPU on the master rank,
# the controller and the notebook kernel (about 3 ms in all, measured), taken from the ranks where
# they fill the cores; with two ranks in lockstep, a rank delayed delays both. 2 ranks, 2 vCPUs,
# 5 s fits: 4.4-4.8 % slower at 2 updates per second (python -m tnt_notebook.bench progress).
DEFAULT_MIN_INTERVAL = 1.0
DEFAULT_MAX_OVERHEAD = 0.005  # updates may cost the master rank at most this time fraction

Publish = Callable[[dict, str, bool], None]

#: The publisher of the most recent fit / evaluate / predict on this rank (for benchmarks).
last_publisher: ProgressPublisher | None = None


def _timed(method: Callable) -> Callable:
    """Adds the time spent in a hook to ``hook_seconds``: the display's direct cost on the rank."""

    @functools.wraps(method)
    def wrapper(self: ProgressPublisher, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            self.hook_seconds += time.perf_counter() - start

    return wrapper


def publishes_widget(verbose: int | str) -> bool:
    """Whether this process shows progress as notebook display data (True) or Keras text (False).

    The one decision point: ranks that are ipyparallel engines of a tnt cluster publish (the
    notebook renders a widget); any other process leaves progress to Keras's text progbar.
    ``verbose=0`` shows nothing either way.
    """
    if normalize_verbose(verbose) == 0:
        return False
    return settings.NOTEBOOK_RANK.read()


def progress_callback(mode: str, verbose: int | str, **params: Any) -> Any:
    """Return the Keras callback that shows progress on this (master) rank, or None.

    None means "let Keras's ProgbarLogger print text". Known ``params`` (all optional):
    ``epochs``, ``steps`` (per epoch), ``batch_size`` (global), ``num_samples``,
    ``world_size``, ``devices`` (what the ranks train on, in words; default: as this rank's
    environment tells, :func:`~tnt_notebook.rank.device.ranks_devices`), ``min_interval``
    (seconds between batch updates), ``max_overhead`` (fraction of the time that batch updates
    may cost), ``publish`` (a ``(bundle, display_id, update)`` sink; default: IPython's display
    machinery).
    """
    if mode not in MODES:
        raise ValueError(f"progress mode must be one of {MODES}, not {mode!r}")
    if not publishes_widget(verbose):
        return None
    if settings.OUTPUT_ON_ALL_DEVICES.read():
        from tnt_notebook.rank import api as ranks

        if not ranks.is_master_rank():  # one display per call: other ranks print Keras text
            return None
    if "devices" not in params:
        params["devices"] = device.ranks_devices()
    return _keras_callback_class()(mode, verbose, **params)


@contextlib.contextmanager
def flushed_on_error(callbacks: list) -> Iterator[None]:
    """Around a fit / evaluate / predict: if it raises, its display first gets what the rate
    limit held back (then the notebook marks the display failed, with the cell's error)."""
    try:
        yield
    except BaseException:
        for callback in callbacks:
            publisher = getattr(callback, "publisher", None)
            if isinstance(publisher, ProgressPublisher):
                with contextlib.suppress(Exception):  # the call's own error is the one to see
                    publisher.flush()
        raise


class ProgressPublisher:
    """Keeps the aggregated progress state of one fit / evaluate / predict and publishes it.

    Independent of Keras (the callback below feeds it), so it can be exercised directly.
    Updates are rate-limited to one per ``min_interval`` seconds, and further when publishing
    is slow (a busy machine): the interval grows to ``cost / max_overhead`` so updates take at
    most that fraction of the rank's time. Only the begin and the end are always published
    (with ``verbose=2``, Keras's one line per epoch, also every epoch end and nothing between):
    epochs shorter than the interval would otherwise publish at their own rate, and every
    update costs the notebook kernel and the controller CPU on the cores the ranks train on.
    The history travels in every payload, so a skipped epoch end shows in the next update.
    """

    def __init__(
        self,
        mode: str,
        verbose: int | str = 1,
        *,
        epochs: int | None = None,
        steps: int | None = None,
        batch_size: int | None = None,
        num_samples: int | None = None,
        world_size: int | None = None,
        devices: str | None = None,
        min_interval: float = DEFAULT_MIN_INTERVAL,
        max_overhead: float = DEFAULT_MAX_OVERHEAD,
        publish: Publish | None = None,
        clock: Callable[[], float] = time.perf_counter,
        **_ignored: Any,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"progress mode must be one of {MODES}, not {mode!r}")
        self.mode = mode
        self.verbose = normalize_verbose(verbose)
        self.epochs = epochs if mode == "fit" else None
        self.steps = steps
        self.batch_size = batch_size
        self.num_samples = num_samples
        self.world_size = world_size
        self.devices = devices
        self.min_interval = float(min_interval)
        self.max_overhead = float(max_overhead)
        self._interval = self.min_interval  # grows when publishing is slow
        self._emit_cost = 0.0  # smoothed seconds per publish
        self.display_id = f"tnt-progress-{uuid.uuid4().hex}"
        self.published = 0
        self.hook_seconds = 0.0
        self._publish = publish or display_publish
        self._clock = clock
        self._t0 = self._clock()
        self._epoch_t0 = self._t0
        self._last = float("-inf")
        self._status = "running"
        self._phase = "train" if mode == "fit" else mode
        self._epoch = 0  # 0-based index of the running epoch
        self._epochs_done = 0  # (fit) epochs finished, counting from epoch 0
        self._step = 0  # steps done in the running epoch (or the whole call outside fit)
        self._steps_before = 0  # steps of this call's earlier epochs
        self._samples_before = 0  # and their samples
        self._train_time = 0.0  # time spent in finished epochs' training phases
        self._logs: dict[str, float] = {}
        self._epoch_logs: dict[str, float] = {}
        self._history: dict[str, list[float]] = {}
        self._in_train = mode != "fit"  # the training clock runs between epoch begin and end

    def _stop_train_clock(self) -> None:
        if self._in_train and self.mode == "fit":
            self._train_time += self._clock() - self._epoch_t0
        self._in_train = False

    # Hooks, named after the moments Keras reports.
    @_timed
    def begin(self) -> None:
        """Start of the call: show the display at once."""
        self._t0 = self._epoch_t0 = self._clock()
        self._emit(force=True)

    @_timed
    def epoch_begin(self, epoch: int) -> None:
        self._epoch = epoch
        self._epochs_done = epoch
        self._steps_before += self._step
        self._samples_before += self._samples_in(self._step)
        self._step = 0
        self._phase = "train"
        self._epoch_t0 = self._clock()
        self._in_train = True

    @_timed
    def batch_end(self, batch: int, logs: dict | None = None) -> None:
        """Step ``batch`` done (with ``steps_per_execution`` > 1 Keras reports every k-th);
        publishes only if ``min_interval`` has passed since the last update. It runs after every
        step, so it only records: counts are derived when a payload is built."""
        self._step = batch + 1
        if logs:
            self._logs = logs
        if self._due():
            self._emit()

    @_timed
    def validation_begin(self) -> None:
        if self.mode == "fit":
            self._stop_train_clock()
            self._phase = "validate"
            if self.verbose == 2 or self._due():
                self._emit(force=True)

    @_timed
    def validation_batch_end(self) -> None:
        """A validation step inside fit: a long validation shows as such within the interval."""
        if self.mode == "fit" and self._due():
            self._emit()

    @_timed
    def epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        """Epoch finished, validation included: history extended, published when due."""
        self._stop_train_clock()
        self._epoch = epoch
        self._epochs_done = epoch + 1
        self._phase = "train"
        logs = finite_floats(logs)
        self._epoch_logs = logs
        self._logs = {k: v for k, v in logs.items() if not k.startswith("val_")}
        for key, value in ordered(logs).items():
            self._history.setdefault(key, []).append(value)
        if self.verbose == 2 or self._due():
            self._emit(force=True)

    @_timed
    def end(self, logs: dict | None = None) -> None:
        """The call returned normally: final state."""
        if logs:
            logs = finite_floats(logs)
            if self.mode == "fit":
                self._epoch_logs = logs or self._epoch_logs
            else:
                self._logs = logs
        self._status = "done"
        if self.steps is None and self.mode != "fit":
            self.steps = self._step
        self._emit(force=True)

    def flush(self) -> None:
        """Publish what the rate limit held back (the call is failing: no later update comes)."""
        if self.published and self._status == "running":
            self._emit(force=True)

    # Payload.
    def state(self) -> dict[str, Any]:
        """The JSON payload describing the current progress (what the notebook renders)."""
        now = self._clock()
        elapsed = now - self._t0
        if self.mode != "fit":
            train_time = elapsed
        elif self._in_train:
            train_time = self._train_time + (now - self._epoch_t0)
        else:
            train_time = self._train_time
        samples = self._samples_before + self._samples_in(self._step)
        rate = samples / train_time if train_time > 0 and samples else None
        steps_rate = (self._steps_before + self._step) / train_time if train_time > 0 else None
        return {
            "version": PAYLOAD_VERSION,
            "id": self.display_id,
            "mode": self.mode,
            "status": self._status,
            "phase": self._phase,
            "epoch": self._epoch + 1 if self.mode == "fit" else None,
            "epochs": self.epochs,
            "epochs_done": self._epochs_done if self.mode == "fit" else None,
            "step": self._step,
            "steps": self.steps,
            "batch_size": self.batch_size,
            "world_size": self.world_size,
            "devices": self.devices,
            "samples": samples,
            "samples_per_s": rate,
            "steps_per_s": steps_rate,
            "elapsed": elapsed,
            "eta": self._eta(steps_rate),
            "logs": finite_floats(self._logs),
            "epoch_logs": finite_floats(self._epoch_logs),
            "history": self._history,
        }

    def _eta(self, steps_rate: float | None) -> float | None:
        if self._status != "running":
            return 0.0
        if not steps_rate or self.steps is None:
            return None
        remaining = self.steps * ((self.epochs or 1) - self._epoch) - self._step
        return max(remaining, 0) / steps_rate

    def _samples_in(self, steps: int) -> int:
        """Samples in an epoch's first ``steps`` batches: a pass over the data may end in a short
        batch, and the data may repeat."""
        if not self.batch_size:
            return 0
        if not self.num_samples:
            return steps * self.batch_size
        passes, rest = divmod(steps, -(-self.num_samples // self.batch_size))
        return passes * self.num_samples + rest * self.batch_size

    def _due(self) -> bool:
        """Whether a live (``verbose=1``) update may go out now."""
        return self.verbose == 1 and self._clock() - self._last >= self._interval

    def _emit(self, force: bool = False) -> None:
        if self.verbose == 0:
            return
        if self.verbose == 2 and not force:
            return
        start = time.perf_counter()
        state = self.state()
        bundle = {PROGRESS_MIME: state, "text/plain": text_line(state)}
        self._publish(bundle, self.display_id, self.published > 0)
        cost = time.perf_counter() - start
        self._emit_cost = cost if not self.published else 0.7 * self._emit_cost + 0.3 * cost
        if self.max_overhead > 0:
            self._interval = max(self.min_interval, self._emit_cost / self.max_overhead)
        self.published += 1
        self._last = self._clock()


_CALLBACK_CLASS: type | None = None


def _keras_callback_class() -> type:
    """The Keras callback feeding a ProgressPublisher (defined on first use: Keras is heavy)."""
    global _CALLBACK_CLASS
    if _CALLBACK_CLASS is not None:
        return _CALLBACK_CLASS
    import keras

    class ProgressCallback(keras.callbacks.Callback):
        """Publishes aggregated progress of one fit / evaluate / predict to the notebook."""

        reads_weights_each_batch = False  # (only the logs)

        def __init__(self, mode: str, verbose: int | str = 1, **params: Any) -> None:
            super().__init__()
            self.mode = mode
            self._params = params
            self._verbose = verbose
            self.publisher: ProgressPublisher | None = None

        def set_params(self, params: dict) -> None:
            super().set_params(params)
            merged = {**{k: v for k, v in (params or {}).items() if k != "verbose"}}
            merged.update({k: v for k, v in self._params.items() if v is not None})
            self._params = merged

        def _begin(self) -> None:
            global last_publisher
            self.publisher = ProgressPublisher(self.mode, self._verbose, **self._params)
            last_publisher = self.publisher
            self.publisher.begin()

        # fit
        def on_train_begin(self, logs=None):
            if self.mode == "fit":
                self._begin()

        def on_epoch_begin(self, epoch, logs=None):
            if self.publisher and self.mode == "fit":
                self.publisher.epoch_begin(epoch)

        def on_train_batch_end(self, batch, logs=None):
            if self.publisher and self.mode == "fit":
                self.publisher.batch_end(batch, logs)

        def on_epoch_end(self, epoch, logs=None):
            if self.publisher and self.mode == "fit":
                self.publisher.epoch_end(epoch, logs)

        def on_train_end(self, logs=None):
            if self.publisher and self.mode == "fit":
                self.publisher.end(logs)

        # evaluate (and validation inside fit)
        def on_test_begin(self, logs=None):
            if self.mode == "evaluate":
                self._begin()
            elif self.publisher:
                self.publisher.validation_begin()

        def on_test_batch_end(self, batch, logs=None):
            if self.publisher and self.mode == "evaluate":
                self.publisher.batch_end(batch, logs)
            elif self.publisher:
                self.publisher.validation_batch_end()

        def on_test_end(self, logs=None):
            if self.publisher and self.mode == "evaluate":
                self.publisher.end(logs)

        # predict
        def on_predict_begin(self, logs=None):
            if self.mode == "predict":
                self._begin()

        def on_predict_batch_end(self, batch, logs=None):
            if self.publisher and self.mode == "predict":
                self.publisher.batch_end(batch, None)

        def on_predict_end(self, logs=None):
            if self.publisher and self.mode == "predict":
                self.publisher.end(None)

    _CALLBACK_CLASS = ProgressCallback
    return ProgressCallback

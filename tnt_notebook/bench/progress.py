"""Cost of the live progress display: training throughput with and without it, in a real kernel.

``python -m tnt_notebook.bench progress`` starts an IPython kernel (this Python) the way a
frontend does, boots ``%tnt_cluster -n 2`` in it and runs the same ``%%tnt`` fit alternately
with ``verbose=0`` (no display) and ``verbose=1`` (the live widget: the master rank publishes,
the notebook kernel renders the widget and sends its comm updates, this client reads them like a
browser would). Throughput is timed on the master rank around ``fit``; the overhead is
``1 - median(widget) / median(none)``. Writes JSON (default bench-results/progress.json).

:class:`KernelSession` (a kernel plus a client that collects every iopub message of a cell and
rebuilds the widget models from their comm messages) is also what the tests use.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from tnt_notebook.bench import write_report

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


@dataclass
class CellResult:
    """Everything one executed cell produced: reply, iopub messages, text output."""

    reply: dict
    messages: list[dict] = field(default_factory=list)

    @property
    def status(self) -> str:
        return self.reply["content"]["status"]

    @property
    def stdout(self) -> str:
        return "".join(
            m["content"]["text"]
            for m in self.messages
            if m["msg_type"] == "stream" and m["content"]["name"] == "stdout"
        )

    def displays(self, msg_type: str | None = None) -> list[dict]:
        """display_data / update_display_data contents, in order."""
        kinds = (msg_type,) if msg_type else ("display_data", "update_display_data")
        return [m["content"] for m in self.messages if m["msg_type"] in kinds]


class KernelSession:
    """A real IPython kernel of this Python, driven through jupyter_client with deadlines."""

    def __init__(self, cwd: str | None = None, env: dict[str, str] | None = None) -> None:
        from jupyter_client import KernelManager

        self.km = KernelManager(kernel_name="python3")
        kernel_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.km.start_kernel(cwd=cwd or os.getcwd(), env=kernel_env)
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=120)
        self.widgets: dict[str, dict[str, Any]] = {}  # model id -> latest state

    def execute(self, code: str, timeout: float = 300) -> CellResult:
        """Run one cell; collect its iopub messages until the kernel is idle again."""
        msg_id = self.kc.execute(code)
        deadline = time.monotonic() + timeout
        result = CellResult(reply={})
        idle = False
        while not idle or not result.reply:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"cell did not finish within {timeout} s:\n{code[:200]}")
            if not idle:
                try:
                    msg = self.kc.get_iopub_msg(timeout=min(left, 1.0))
                except Exception:  # queue.Empty
                    continue
                if msg["parent_header"].get("msg_id") != msg_id:
                    self._track_widgets(msg)
                    continue
                self._track_widgets(msg)
                result.messages.append(msg)
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
                    idle = True
            else:
                reply = self.kc.get_shell_msg(timeout=left)
                if reply["parent_header"].get("msg_id") == msg_id:
                    result.reply = reply
        return result

    def _track_widgets(self, msg: dict) -> None:
        kind = msg["msg_type"]
        content = msg["content"]
        if kind == "comm_open" and content.get("target_name") == "jupyter.widget":
            self.widgets[content["comm_id"]] = dict(content["data"].get("state", {}))
        elif kind == "comm_msg" and content["comm_id"] in self.widgets:
            data = content["data"]
            if data.get("method") in ("update", "echo_update"):
                self.widgets[content["comm_id"]].update(data.get("state", {}))

    def widget_tree(self, model_id: str) -> dict[str, Any]:
        """A widget's state with its references (``IPY_MODEL_``: children, layout, style)
        resolved recursively."""

        def resolve(value: Any) -> Any:
            if isinstance(value, list):
                return [resolve(v) for v in value]
            if isinstance(value, str) and value.startswith("IPY_MODEL_"):
                return self.widget_tree(value.removeprefix("IPY_MODEL_"))
            return value

        return {k: resolve(v) for k, v in self.widgets[model_id].items()}

    def close(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            self.km.shutdown_kernel(now=False)
            if self.km.is_alive():
                self.km.shutdown_kernel(now=True)


FIT_CELL = """%%tnt
import json, time
import numpy as np
import keras
import tnt_notebook as tnt
from tnt_notebook.rank import progress_publisher as progress
rng = np.random.default_rng(0)
x = rng.normal(size=({samples}, 64)).astype("float32")
y = rng.integers(0, 10, size={samples})
keras.utils.set_random_seed(0)
hidden = keras.layers.Dense({width}, activation="relu")
layers = [keras.Input((64,)), hidden, keras.layers.Dense(10)]
model = tnt.Model(keras.Sequential(layers))
model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size={batch}, epochs=1, verbose=0)  # warm-up
def timed(verbose):
    progress.last_publisher = None
    tnt.barrier()
    start = time.perf_counter()
    model.fit(x, y, batch_size={batch}, epochs={epochs}, verbose=verbose)
    seconds = time.perf_counter() - start
    hooks = progress.last_publisher.hook_seconds if progress.last_publisher else 0.0
    return {{"samples_per_s": {epochs} * len(x) / seconds, "seconds": seconds, "hooks": hooks}}
"""

RUN_CELL = """%%tnt
run = timed({verbose})
if tnt.is_master_rank():
    print(json.dumps(run))
"""


def _notebook_side(kernel_pid: int) -> list[Any]:
    """The notebook kernel and the ipyparallel controller (with its schedulers): the processes
    that handle the display besides the ranks."""
    import psutil

    kernel = psutil.Process(kernel_pid)
    procs = [kernel]
    for child in kernel.children(recursive=False):
        try:
            if "ipyparallel.controller" in " ".join(child.cmdline()):
                procs += [child, *child.children(recursive=True)]
        except psutil.Error:
            pass
    return procs


def _cpu_seconds(procs: list[Any]) -> float:
    import psutil

    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:
            pass
    return total


def measure(
    ranks: int = 2,
    repeats: int = 5,
    epochs: int = 3,
    samples: int = 16384,
    batch: int = 64,
    width: int = 128,
    threads: int = 1,
) -> dict[str, Any]:
    """Interleaved runs without / with the display; returns the JSON-ready result.

    Three views of the cost, because wall-clock throughput on a shared 2-core machine is noisy:
    the throughput ratio (median of adjacent pairs, and best run against best run), the time
    the master rank spends in the display's hooks, and the extra CPU time the notebook side
    (kernel + controller) spends per fit, both relative to the fit's duration.
    """
    env = {
        "TF_NUM_INTRAOP_THREADS": str(threads),
        "TF_NUM_INTEROP_THREADS": "1",
        "OMP_NUM_THREADS": str(threads),
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    session = KernelSession(env=env)
    runs: dict[str, list[dict]] = {"none": [], "widget": []}
    widget_messages: list[int] = []
    try:
        for code in ("%load_ext tnt_notebook", f"%tnt_cluster -n {ranks}"):
            cell = session.execute(code, timeout=180)
            if cell.status != "ok":
                raise RuntimeError(f"{code} failed: {cell.reply['content']}")
        cell = session.execute(
            FIT_CELL.format(samples=samples, batch=batch, epochs=epochs, width=width), 300
        )
        if cell.status != "ok":
            raise RuntimeError(f"model set-up failed: {cell.reply['content']}")
        side = _notebook_side(session.km.provisioner.process.pid)
        for i in range(repeats):
            order = (("none", 0), ("widget", 1)) if i % 2 == 0 else (("widget", 1), ("none", 0))
            for label, verbose in order:
                cpu = _cpu_seconds(side)
                cell = session.execute(RUN_CELL.format(verbose=verbose), 300)
                if cell.status != "ok":
                    raise RuntimeError(f"fit failed: {cell.reply['content']}")
                run = json.loads(cell.stdout.strip().splitlines()[-1])
                run["notebook_cpu"] = _cpu_seconds(side) - cpu
                runs[label].append(run)
                if verbose:
                    kinds = ("comm_open", "comm_msg")  # widgets created, widgets updated
                    widget_messages.append(sum(1 for m in cell.messages if m["msg_type"] in kinds))
        session.execute("%tnt_cluster stop", 120)
    finally:
        session.close()
    thr = {k: [r["samples_per_s"] for r in v] for k, v in runs.items()}
    pairs = [w / n for n, w in zip(thr["none"], thr["widget"], strict=True)]
    hooks = statistics.median(r["hooks"] / r["seconds"] for r in runs["widget"])
    extra_cpu = statistics.median(r["notebook_cpu"] for r in runs["widget"]) - statistics.median(
        r["notebook_cpu"] for r in runs["none"]
    )
    seconds = statistics.median(r["seconds"] for r in runs["widget"])
    return {
        "benchmark": "progress",
        "ranks": ranks,
        "global_batch": batch,
        "steps_per_fit": epochs * -(-samples // batch),
        "repeats": repeats,
        "runs": runs,
        "median_none": statistics.median(thr["none"]),
        "median_widget": statistics.median(thr["widget"]),
        "overhead": 1.0 - statistics.median(pairs),
        "overhead_best": 1.0 - max(thr["widget"]) / max(thr["none"]),
        "master_hook_fraction": hooks,
        "notebook_extra_cpu_fraction": extra_cpu / seconds,
        "widget_messages_per_fit": widget_messages,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tnt_notebook.bench progress", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=16384)
    parser.add_argument("--batch", type=int, default=64, help="global batch size")
    parser.add_argument("--threads", type=int, default=1, help="TF intra-op threads per rank")
    parser.add_argument("--json", default="bench-results/progress.json")
    args = parser.parse_args(argv)
    result = measure(
        args.ranks, args.repeats, args.epochs, args.samples, args.batch, threads=args.threads
    )
    print(
        f"progress display overhead, {args.ranks} ranks, {result['steps_per_fit']} steps per fit, "
        f"global batch {args.batch}, {args.repeats} interleaved repeats"
    )
    print(f"{'display':<10}{'median samples/s':>18}{'best samples/s':>16}")
    best = {k: max(r["samples_per_s"] for r in v) for k, v in result["runs"].items()}
    print(f"{'none':<10}{result['median_none']:>18,.0f}{best['none']:>16,.0f}")
    print(f"{'widget':<10}{result['median_widget']:>18,.0f}{best['widget']:>16,.0f}")
    print(
        f"throughput overhead: {100 * result['overhead']:.2f} % (median of adjacent pairs), "
        f"{100 * result['overhead_best']:.2f} % (best vs best); target < 2 %"
    )
    print(
        f"master rank in display hooks: {100 * result['master_hook_fraction']:.3f} % of fit time; "
        f"notebook kernel + controller extra CPU: "
        f"{100 * result['notebook_extra_cpu_fraction']:.2f} % of one core"
    )
    write_report(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

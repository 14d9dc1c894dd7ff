"""Drive a real IPython kernel through jupyter_client: execute cells, collect what they show."""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest
from jupyter_client.manager import KernelManager

ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass
class CellResult:
    """What a notebook would show for one executed cell."""

    status: str
    stdout: str = ""
    stderr: str = ""
    displays: list[dict] = field(default_factory=list)
    error: dict | None = None
    messages: list[tuple[float, dict]] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def traceback(self) -> str:
        if not self.error:
            return ""
        return ANSI.sub("", "\n".join(self.error.get("traceback", [])))

    @property
    def usage_error(self) -> str:
        """The one-line message IPython prints for a UsageError ('' if none)."""
        for line in self.stderr.splitlines():
            if line.startswith("UsageError: "):
                return line[len("UsageError: ") :]
        return ""

    def text(self) -> str:
        return self.stdout + self.stderr + self.traceback


class Kernel:
    """One IPython kernel with tnt_notebook loaded; execute() returns a CellResult."""

    def __init__(self, cwd: str | None = None, km: KernelManager | None = None) -> None:
        self.km = km or KernelManager(kernel_name="python3")
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.km.start_kernel(cwd=cwd or os.getcwd(), env=env)
        self.kc = self.km.blocking_client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.pid = self.km.provisioner.process.pid
        self.load_extension()

    def load_extension(self) -> None:
        r = self.execute("%load_ext tnt_notebook")
        assert r.status == "ok", r.text()

    def send(self, code: str) -> str:
        return self.kc.execute(code)

    def collect(self, msg_id: str, timeout: float = 120, on_message: Any = None) -> CellResult:
        """iopub messages of one execution until idle, then its reply; fail at the deadline."""
        start = time.monotonic()
        deadline = start + timeout
        res = CellResult(status="?")
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"cell did not finish within {timeout} s; so far: {res.text()}")
            try:
                msg = self.kc.get_iopub_msg(timeout=min(remaining, 1.0))
            except Exception:  # queue.Empty
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            now = time.monotonic() - start
            res.messages.append((now, msg))
            mtype, content = msg["msg_type"], msg["content"]
            if on_message is not None:
                on_message(now, msg)
            if mtype == "stream":
                if content["name"] == "stdout":
                    res.stdout += content["text"]
                else:
                    res.stderr += content["text"]
            elif mtype in ("display_data", "execute_result", "update_display_data"):
                res.displays.append(content)
            elif mtype == "error":
                res.error = content
            elif mtype == "status" and content["execution_state"] == "idle":
                break
        res.seconds = time.monotonic() - start
        while True:
            remaining = deadline + 10 - time.monotonic()
            reply = self.kc.get_shell_msg(timeout=max(remaining, 0.1))
            if reply["parent_header"].get("msg_id") == msg_id:
                res.status = reply["content"]["status"]
                return res

    def execute(self, code: str, timeout: float = 120) -> CellResult:
        return self.collect(self.send(code), timeout=timeout)

    def ok(self, code: str, timeout: float = 120) -> CellResult:
        """Execute and require success."""
        r = self.execute(code, timeout=timeout)
        assert r.status == "ok", r.text()
        return r

    def value(self, expr: str) -> Any:
        """Evaluate a Python literal-producing expression in the kernel."""
        import ast

        r = self.ok(f"print(repr({expr}))")
        return ast.literal_eval(r.stdout.strip())

    def descendants(self) -> list[psutil.Process]:
        try:
            return psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return []

    def shutdown(self) -> None:
        try:
            self.kc.stop_channels()
        finally:
            if self.km.is_alive():
                self.km.shutdown_kernel(now=False)
            self.km.cleanup_resources()


def running(procs: list[psutil.Process]) -> list[psutil.Process]:
    """Those of procs that still run (zombies do not count: nothing executes there)."""
    out = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


def processes_mentioning(text: str) -> list[psutil.Process]:
    """Running processes whose command line contains `text` (e.g. a cluster's profile dir)."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if any(text in a for a in p.info["cmdline"] or []):
                out.append(p)
        except psutil.Error:
            pass
    return running(out)


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until none of procs runs; return those still running at the deadline."""
    deadline = time.monotonic() + timeout
    left = running(procs)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = running(left)
    return left


def stopped_by_fail_fast(traceback: str, size: int) -> list[int]:
    """The ranks a failed cell's note says fail fast stopped: interrupted, or with their
    collectives aborted (a rank whose node peer's interrupt broke the node's collective before
    its own interrupt arrived)."""
    from tnt_notebook.notebook.magics import parse_targets

    specs = re.findall(
        r"rank\(s\) ([\d,-]+) (?:were interrupted|had their collectives aborted)", traceback
    )
    return sorted(r for spec in specs for r in parse_targets(spec, size))


def cluster_attr(kernel: Kernel, attr: str) -> Any:
    return kernel.value(f"get_ipython().magics_manager.registry['TntMagics'].cluster.{attr}")


def assert_death_named_by_the_next_cell(
    kernel: Kernel, rank: int, host: str, pid: int, cause_known: bool = False
) -> None:
    """After `rank` (`pid` on `host`) was killed with SIGKILL between cells: once the launcher has
    ended the others and exited, the next cell fails with ClusterDeadError naming the rank and its
    host, as does %tnt_cluster status; the cause must be there where `cause_known` (srun names
    every task's end; Hydra one process per host, not always this one)."""
    deadline = time.monotonic() + 30
    while cluster_attr(kernel, "_launcher.poll()") is None:
        assert time.monotonic() < deadline, "the launcher did not exit within 30 s"
        time.sleep(0.2)
    cause = "(: killed by signal SIGKILL)" + ("" if cause_known else "?")
    named = rf"rank {rank} on {re.escape(host)} died{cause} \(pid {pid}\)"
    r = kernel.execute("%%tnt\nprint(1)")
    assert r.status == "error" and r.error["ename"] == "ClusterDeadError", r.text()
    assert re.search(named, r.traceback), r.traceback
    status = kernel.ok("%tnt_cluster status").stdout
    assert re.search(f"DEAD: {named}", status), status


def profile_dir_gone(path: str) -> bool:
    return not Path(path).exists()


FIT = """%%tnt
import pathlib
import keras
import numpy as np

class Started(keras.callbacks.Callback):
    def on_train_batch_end(self, batch, logs=None):
        if batch == 3 and tnt.get_rank() == 0:
            pathlib.Path({flag!r}).touch()

x = np.random.default_rng(0).random((4096, 32), dtype="float32")
y = (x.sum(axis=1) > 16).astype("int32")
model = tnt.Model(keras.Sequential(
    [keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(2)]
))
model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=64, epochs=1000, verbose=0, callbacks=[Started()])
"""


def start_fit(kernel: Kernel, nb: Path) -> str:
    """Send a long fit; return its message id once it trains on every rank."""
    flag = nb / f"fitting-{time.monotonic_ns()}"
    msg_id = kernel.send(FIT.format(flag=str(flag)))
    deadline = time.monotonic() + 120
    while not flag.exists():
        assert time.monotonic() < deadline, "the fit did not start within 120 s"
        time.sleep(0.05)
    return msg_id

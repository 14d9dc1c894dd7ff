"""Who is stuck where, and who died, in a real kernel with 4 ranks: the stack report while three
ranks wait in a barrier that the fourth never reaches (asked from a thread, in the error of an
interrupted cell, in the error of a collective that timed out), and a rank killed between cells
named with its host in the next cell's error and in status."""

from __future__ import annotations

import os
import re
import signal
import socket
import time

import pytest

from tests.support.kernel_driver import assert_death_named_by_the_next_cell

pytestmark = [pytest.mark.notebook, pytest.mark.mpi]

N = 4
COLLECTIVE_TIMEOUT = 5

# Ranks 0-2 wait in a barrier at line 6 of the cell (the allreduce before it is collective #1);
# rank 3 sleeps at line 4 and never arrives.
STUCK_CELL = """%%tnt
import time
tnt.allreduce(1.0)
if tnt.get_rank() == 3:
    time.sleep({sleep})
else:
    tnt.barrier()
"""
WAITING = re.compile(
    r"^ranks 0-2: waiting \d+\.\d s in barrier #2 at <cell>:6; rank\(s\) 3 have not arrived\n"
    r"    <cell>:6 in <module>: tnt\.barrier\(\)$",
    re.M,
)
MISSING = re.compile(
    r"^rank 3: at <cell>:4, has not arrived at barrier #2\n"
    r"    <cell>:4 in <module>: time\.sleep\(",
    re.M,
)


@pytest.fixture(scope="module")
def kernel(kernel_factory):
    k = kernel_factory()
    k.ok(f"%tnt_cluster -n {N} --collective-timeout {COLLECTIVE_TIMEOUT}", timeout=120)
    return k


def test_between_cells_every_rank_is_idle(kernel):
    r = kernel.ok("%tnt_cluster stacks")
    assert r.stdout == "ranks 0-3: idle (its cell has ended)\n", r.text()


def test_a_rank_that_never_reaches_the_barrier_is_named_within_2_s_and_interrupting_shows_it(
    kernel,
):
    # a thread of the notebook asks while the cell runs (as a second console would)
    kernel.ok(
        "import threading, time\nasked = {}\n"
        "def ask():\n"
        "    time.sleep(2)\n"
        "    c = get_ipython().magics_manager.registry['TntMagics'].cluster\n"
        "    t0 = time.monotonic()\n"
        "    text = c.stacks().text()\n"
        "    asked.update(seconds=time.monotonic() - t0, text=text)\n"
        "threading.Thread(target=ask, daemon=True).start()"
    )
    msg_id = kernel.send(STUCK_CELL.format(sleep=60))
    time.sleep(3.5)
    kernel.km.interrupt_kernel()
    r = kernel.collect(msg_id, timeout=60)
    asked = kernel.value("asked")
    assert asked["seconds"] < 2, asked
    assert WAITING.search(asked["text"]) and MISSING.search(asked["text"]), asked["text"]
    assert r.status == "error" and "KeyboardInterrupt" in r.traceback, r.text()
    assert "Where the ranks were when interrupted by the user:" in r.traceback, r.traceback
    assert WAITING.search(r.traceback) and MISSING.search(r.traceback), r.traceback


def test_a_collective_time_out_error_shows_where_the_missing_rank_is(kernel):
    r = kernel.execute(STUCK_CELL.format(sleep=COLLECTIVE_TIMEOUT + 3), timeout=60)
    assert r.status == "error" and "CollectiveTimeoutError" in r.traceback, r.text()
    assert re.search(r"Where the ranks were when rank [0-2]'s collective timed out:", r.traceback)
    assert MISSING.search(r.traceback), r.traceback
    assert re.search(
        r"^ranks? [0-2,-]+: .*barrier #2.*; rank\(s\) 3 have not arrived$", r.traceback, re.M
    )


FIT_CELL = """%%tnt
import time, numpy as np, keras
class SlowOnRank3(keras.callbacks.Callback):
    def on_train_batch_begin(self, batch, logs=None):
        if batch == 3 and tnt.get_rank() == 3:
            time.sleep(60)
x = np.random.default_rng(0).random((512, 16), dtype="float32")
y = (x.sum(axis=1) > 8).astype("int32")
m = tnt.Model(keras.Sequential([keras.Input((16,)), keras.layers.Dense(2)]))
m.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
m.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[SlowOnRank3()])
"""


@pytest.mark.slow  # (TensorFlow on 4 ranks)
def test_in_a_fit_the_others_wait_in_a_gradient_bucket_of_the_op_while_one_rank_is_slow(
    kernel, tmp_path
):
    """The op waits on TensorFlow's threads: the engine's record still says which collective.
    A thread of the notebook asks until rank 3 is seen in its callback, and writes the report to
    a file (the kernel is busy with the cell)."""
    seen = tmp_path / "stacks.txt"
    kernel.ok(f"%tnt_cluster restart -n {N} --collective-timeout 120", timeout=120)
    kernel.ok(
        "import pathlib, threading, time\n"
        "def ask():\n"
        "    c = get_ipython().magics_manager.registry['TntMagics'].cluster\n"
        "    for _ in range(600):\n"
        "        time.sleep(0.5)\n"
        "        text = c.stacks().text()\n"
        "        if 'time.sleep(60)' in text and 'waiting' in text:\n"
        f"            pathlib.Path({str(seen)!r}).write_text(text)\n"
        "            return\n"
        "threading.Thread(target=ask, daemon=True).start()"
    )
    msg_id = kernel.send(FIT_CELL)
    deadline = time.monotonic() + 300
    while not seen.exists():
        assert time.monotonic() < deadline, "rank 3 was never seen in its callback"
        time.sleep(0.5)
    kernel.km.interrupt_kernel()
    kernel.collect(msg_id, timeout=120)
    text = seen.read_text()
    assert re.search(
        r"^ranks 0-2: waiting \d+\.\d s in allreduce #\d+ \([\d.]+ [KM]?B float32 sum, bucket 0\) "
        r"at <cell>:10; rank\(s\) 3 have not arrived$",
        text,
        re.M,
    ), text
    assert re.search(r"^rank 3: at <cell>:5, has not arrived at allreduce #\d+", text, re.M), text
    kernel.ok(f"%tnt_cluster restart -n {N} --collective-timeout {COLLECTIVE_TIMEOUT}", timeout=120)


def test_a_rank_killed_between_cells_is_named_with_its_host_in_the_next_cell_and_status(kernel):
    pids = kernel.value(
        "[r.pid for r in get_ipython().magics_manager.registry['TntMagics'].cluster.ranks]"
    )
    os.kill(pids[2], signal.SIGKILL)
    assert_death_named_by_the_next_cell(kernel, 2, socket.gethostname(), pids[2])

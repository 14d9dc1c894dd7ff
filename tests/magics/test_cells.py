"""%%tnt in a real kernel against one 4-rank cluster: numbering, output, errors, data, interrupt."""

from __future__ import annotations

import time

import pytest

pytestmark = [pytest.mark.notebook, pytest.mark.mpi]

N = 4


@pytest.fixture(scope="module")
def kernel(kernel_factory):
    k = kernel_factory()
    r = k.ok(f"%tnt_cluster -n {N}", timeout=120)
    assert f"tnt cluster ready: {N} rank(s)" in r.stdout
    return k


def test_engine_id_equals_mpi_rank_equals_tnt_rank(kernel):
    pairs = kernel.value(
        "sorted(zip(get_ipython().magics_manager.registry['TntMagics'].cluster.client.ids,"
        " get_ipython().magics_manager.registry['TntMagics'].cluster.view.apply_sync("
        "lambda: (__import__('tnt_notebook').get_rank(), __import__('tnt_notebook').get_size(),"
        " __import__('mpi4py.MPI').MPI.COMM_WORLD.Get_rank()))))"
    )
    assert pairs == [(i, (i, N, i)) for i in range(N)]


def test_default_output_is_the_master_ranks_only(kernel):
    r = kernel.ok('%%tnt\nprint(f"hello from {tnt.get_rank()} of {tnt.get_size()}")')
    assert r.stdout == f"hello from 0 of {N}\n"


def test_master_output_streams_live_while_the_cell_runs(kernel):
    r = kernel.ok('%%tnt\nimport time\nprint("first", flush=True)\ntime.sleep(2)\nprint("second")')
    times = {m["content"]["text"].strip(): t for t, m in r.messages if m["msg_type"] == "stream"}
    assert "first" in times and "second" in times, r.stdout
    assert times["second"] - times["first"] > 1.5


def test_all_ranks_output_is_merged_under_rank_labels(kernel):
    r = kernel.ok('%%tnt --all-ranks\nprint("same everywhere")\nprint("I am", tnt.get_rank())')
    expected = f"[stdout:0-{N - 1}]\nsame everywhere\n" + "".join(
        f"[stdout:{i}]\nI am {i}\n" for i in range(N)
    )
    assert r.stdout == expected


def test_all_ranks_stderr_and_rich_output_are_merged(kernel):
    r = kernel.ok(
        "%%tnt --all-ranks\nimport sys\nfrom IPython.display import display, HTML\n"
        'print("warn", file=sys.stderr)\ndisplay(HTML("<b>same</b>"))'
    )
    assert r.stderr == f"[stderr:0-{N - 1}]\nwarn\n"
    html = [d for d in r.displays if "text/html" in d.get("data", {})]
    assert len(html) == 1 and html[0]["data"]["text/html"] == "<b>same</b>"
    assert f"[output:0-{N - 1}]" in r.stdout


def test_targets_choose_the_ranks(kernel):
    r = kernel.ok('%%tnt --targets 1,3 --all-ranks\nprint("rank", tnt.get_rank())')
    assert r.stdout == "[stdout:1]\nrank 1\n[stdout:3]\nrank 3\n"
    r = kernel.ok('%%tnt --targets 2\nprint("rank", tnt.get_rank())')
    assert r.stdout == "rank 2\n"


def test_master_rich_output_is_shown(kernel):
    r = kernel.ok(
        '%%tnt\nfrom IPython.display import display, HTML\ndisplay(HTML("<i>rich</i>"))\n7*6'
    )
    data = [d["data"] for d in r.displays]
    assert {"text/html": "<i>rich</i>", "text/plain": "<IPython.core.display.HTML object>"} in data
    assert any(d.get("text/plain") == "42" for d in data)


def test_errors_are_merged_per_distinct_error_with_rank_labels_and_fail_the_cell(kernel):
    r = kernel.execute(
        "%%tnt\nr = tnt.get_rank()\n"
        'if r in (1, 3):\n    raise ValueError("odd rank")\n'
        "if r == 2:\n    1 / 0\n"
        'print("rank 0 is fine")'
    )
    assert r.status == "error"
    tb = r.traceback
    assert "[ranks 1,3] ValueError: odd rank" in tb
    assert "[rank 2] ZeroDivisionError: division by zero" in tb
    assert tb.count("Traceback (most recent call last)") == 2
    assert r.stdout == "rank 0 is fine\n"
    # the cluster is still usable after ordinary errors
    assert kernel.ok('%%tnt\nprint("still here")').stdout == "still here\n"


def test_push_and_pull_values(kernel):
    kernel.ok("x = 41\n%tnt_push x")
    kernel.ok("%%tnt\ny = x + tnt.get_rank()")
    kernel.ok("%tnt_pull y")
    assert kernel.value("y") == 41
    kernel.ok("%tnt_pull --all-ranks y")
    assert kernel.value("y") == [41 + i for i in range(N)]
    kernel.ok("%tnt_pull --all-ranks --targets 2-3 y")
    assert kernel.value("y") == [43, 44]
    r = kernel.execute("%tnt_pull not_defined_anywhere")
    assert r.status == "error"
    assert r.usage_error == "'not_defined_anywhere' is not defined on rank(s) 0"
    r = kernel.execute("%tnt_push nothing_here")
    assert r.status == "error" and r.usage_error == "not defined in the notebook: nothing_here"


def test_status_lists_every_rank_alive(kernel):
    r = kernel.ok("%tnt_cluster status")
    lines = r.stdout.splitlines()
    assert lines[:2] == [f"tnt cluster: {N} rank(s), running", "transport between nodes: mpi"]
    assert lines[2].split() == ["rank", "host", "pid", "alive", "device"]
    rows = [line.split() for line in lines[3:]]
    assert [int(row[0]) for row in rows] == list(range(N))
    assert all(row[3] == "yes" and row[4] in ("CPU", "GPU") for row in rows)  # GPU i (NAME)


def test_second_start_is_a_clear_error_and_keeps_the_running_cluster(kernel):
    r = kernel.execute("%tnt_cluster -n 2")
    assert r.status == "error"
    assert "already running" in r.usage_error and "%tnt_cluster restart" in r.usage_error
    assert kernel.ok("%%tnt\nprint(tnt.get_size())").stdout == f"{N}\n"


@pytest.mark.parametrize(
    "line, message",
    [
        ("%%tnt --targets 9", "no rank(s) [9]"),
        ("%%tnt --targets a-b", "use rank numbers and ranges"),
        ("%%tnt --timeout 0", "--timeout must be > 0"),
        ("%%tnt --bogus", "unrecognized arguments"),
    ],
)
def test_bad_cell_options_are_usage_errors(kernel, line, message):
    r = kernel.execute(line + "\nprint(1)")
    assert r.status == "error" and message in r.usage_error
    assert not r.traceback  # one line, no traceback


def test_interrupting_the_kernel_interrupts_all_ranks_and_the_next_cell_works(kernel):
    started = []
    msg_id = kernel.send('%%tnt\nimport time\nprint("started", flush=True)\ntime.sleep(120)')

    def on_message(t, msg):
        if msg["msg_type"] == "stream" and "started" in msg["content"]["text"] and not started:
            started.append(t)
            kernel.km.interrupt_kernel()

    t0 = time.monotonic()
    r = kernel.collect(msg_id, timeout=60, on_message=on_message)
    assert started, r.text()
    assert r.status == "error" and r.error["ename"] == "KeyboardInterrupt", r.text()
    assert time.monotonic() - t0 - started[0] < 10
    r = kernel.ok('%%tnt --all-ranks\nprint("alive", tnt.get_rank())')
    assert r.stdout == "".join(f"[stdout:{i}]\nalive {i}\n" for i in range(N))


def test_cell_timeout_interrupts_the_ranks_and_shows_where_they_were(kernel):
    r = kernel.execute("%%tnt --timeout 1\nimport time\ntime.sleep(60)", timeout=60)
    assert r.status == "error" and r.error["ename"] == "CellTimeoutError", r.text()
    assert r.traceback == (
        "CellTimeoutError: the cell exceeded its --timeout of 1 s; the ranks were interrupted\n"
        "Where the ranks were when the cell exceeded its --timeout of 1 s:\n"
        f"ranks 0-{N - 1}: at <cell>:2, in no collective\n"
        "    <cell>:2 in <module>: time.sleep(60)"
    )
    assert r.seconds < 15
    r2 = kernel.ok("%%tnt\nprint('ok')")
    print([(t, m["msg_type"], m["content"]) for t, m in r2.messages])
    assert r2.stdout == "ok\n"


def test_progress_displays_from_the_master_rank_go_to_the_progress_view(kernel):
    r = kernel.ok(
        "%%tnt\nfrom tnt_notebook.rank.progress_publisher import ProgressPublisher\n"
        "if tnt.is_master_rank():\n"
        "    p = ProgressPublisher('evaluate', 1, steps=3, batch_size=8, min_interval=0)\n"
        "    p.begin()\n"
        "    for b in range(3):\n"
        "        p.batch_end(b, {'loss': 0.5})\n"
        "    p.end({'loss': 0.5})\n"
        'print("done")'
    )
    assert r.stdout.endswith("done\n")
    mimes = {m for d in r.displays for m in d.get("data", {})}
    assert "application/vnd.tnt-notebook.progress+json" not in mimes  # consumed, not dumped
    first, last = r.displays[0], r.displays[-1]
    assert "application/vnd.jupyter.widget-view+json" in first["data"]  # the live view
    ids = {d.get("transient", {}).get("display_id") for d in (first, last)}
    assert len(ids) == 1 and None not in ids  # the summary replaces the live view in place
    summary = last["data"]["text/plain"]
    assert summary.startswith("evaluate done | step 3/3") and "loss: 0.5000" in summary

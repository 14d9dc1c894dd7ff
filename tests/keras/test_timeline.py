"""The timeline of a 2-rank fit under ``tnt-run --timeline``, whose rank 1 sleeps in its input
pipeline (timeline_worker.py), on one host and across two test hosts whose clocks differ; and the
bounds of what it writes."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.keras.timeline_worker import SLEEP_S
from tests.support.keras_worlds import ENV
from tnt_notebook import timeline_report

TNT_RUN = str(Path(sys.executable).parent / "tnt-run")
WORKER = Path(__file__).with_name("timeline_worker.py")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("timeline")
    proc = subprocess.run(
        [TNT_RUN, "-n", "2", "--timeline", str(out), "--", str(WORKER), str(out)],
        capture_output=True, text=True, timeout=240, env={**os.environ, **ENV},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, json.loads((out / "worker.json").read_text())


@pytest.mark.mpi
def test_a_rank_slowed_in_its_input_pipeline_is_named_the_straggler(run):
    summary = run[1]["summary"]
    assert summary["straggler"] == 1
    assert summary["straggler_lag_s"] > 0.6 * SLEEP_S
    slow, other = summary["ranks"][1], summary["ranks"][0]
    assert slow["input_s"] > 0.8 * SLEEP_S > other["input_s"]
    assert other["wait_s"] > 0.6 * SLEEP_S > slow["wait_s"]
    assert 0 < slow["compute_s"] and 0 < other["exposed_communication_s"]


@pytest.mark.mpi
def test_the_spans_add_up_to_the_step_time_measured_by_a_callback(run):
    summary, measured = run[1]["summary"], run[1]["step_times"]
    parts = ("input_s", "compute_s", "exposed_communication_s", "wait_s", "update_s", "other_s")
    for rank in summary["ranks"]:
        assert len(rank["steps"]) == summary["steps_sampled"] == 14  # (16 steps, 2 tracing)
        for step in rank["steps"]:
            assert sum(step[p] for p in parts) == pytest.approx(step["step_s"], rel=1e-6)
    sampled = measured[summary["first_step"] :]
    assert summary["step_s"] == pytest.approx(statistics.median(sampled), rel=0.1)


@pytest.mark.mpi
@pytest.mark.hosts
@pytest.mark.slow
def test_across_hosts_whose_clocks_differ_the_ranks_share_one_time_axis():
    from tests.support.testhosts import TestHosts, unavailable

    if unavailable():
        pytest.skip(unavailable())
    with TestHosts(2, clock_offsets={1: 1000}) as hosts:  # the second host's clock 1000 s ahead
        clock = [sys.executable, "-c", "import time; print(time.monotonic())"]
        assert float(hosts.hosts[1].run(clock).stdout) - time.monotonic() > 999
        out = hosts.shared_dir / "timeline"
        out.mkdir()
        hostfile = hosts.write_hostfile(hosts.hosts, out / "hosts")
        proc = subprocess.run(
            [TNT_RUN, "--hostfile", str(hostfile), "--ssh", str(hosts.ssh), "--no-gpu",
             "--timeline", str(out), "--", str(WORKER), str(out)],
            capture_output=True, text=True, timeout=300, cwd=hosts.shared_dir,
            env={**os.environ, **ENV},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stdout + proc.stderr
        worker = json.loads((out / "worker.json").read_text())
        names = hosts.names
    sample, summary = worker["sample"], worker["summary"]
    assert sample["across_hosts"] and sample["hosts"] == names
    steps = [r["steps"] for r in sample["ranks"]]
    assert len(steps[0]) == len(steps[1]) == 14
    # each step's last collective, which the ranks leave together, ends at one time on both
    last_ends = [[max(s["end"] for s in step["spans"] if s["cat"] == "allreduce")
                  for step in rank_steps] for rank_steps in steps]  # fmt: skip
    lags = [abs(a - b) for a, b in zip(*last_ends, strict=True)]
    assert statistics.median(lags) < 1e-3 and max(lags) < 0.05, lags
    begins = [step["begin"] for rank_steps in steps for step in rank_steps]
    assert 0 <= min(begins) and max(begins) < 60  # one axis from the sample's start, in seconds
    assert summary["straggler"] == 1  # the slowed rank, on the other host


@pytest.mark.mpi
def test_tnt_run_writes_the_summary_trace_and_plot(run):
    out = run[0]
    assert "Straggler: rank 1" in (out / "timeline_summary.txt").read_text()
    assert json.loads((out / "timeline_summary.json").read_text())["straggler"] == 1
    trace = json.loads((out / "timeline_trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1}
    assert any(e["cat"] == "allreduce" and e["args"]["bytes"] > 0 for e in spans)
    assert (out / "timeline.svg").read_text().startswith("<svg")


def test_the_trace_stays_under_5_mb_however_large_the_sample():
    step = {"begin": 0.0, "end": 0.01, "spans": [
        {"name": f"allreduce bucket {k}", "cat": "allreduce", "begin": k * 1e-4,
         "end": (k + 1) * 1e-4, "args": {"bucket": k, "bytes": 4096, "path": "engine"}}
        for k in range(60)
    ]}  # fmt: skip
    sample = {"first_step": 2, "across_hosts": False, "ranks": [
        {"rank": r, "host": "node", "steps": [step] * 200} for r in range(128)
    ]}  # fmt: skip
    text = timeline_report.trace_json(sample)
    assert 1_000_000 < len(text) < 5_000_000
    assert '"name":"step 2"' in text

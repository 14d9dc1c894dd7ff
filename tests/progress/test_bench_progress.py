"""The progress-overhead benchmark runs end to end (tiny settings) and writes its JSON."""

from __future__ import annotations

import json
import sys

import pytest

from tests.support.mpiworld import run_with_deadline

pytestmark = [pytest.mark.notebook, pytest.mark.mpi, pytest.mark.slow]


def test_progress_benchmark_writes_both_throughputs_and_the_overhead(tmp_path):
    out = tmp_path / "progress.json"
    cmd = [sys.executable, "-m", "tnt_notebook.bench", "progress", "--repeats", "1",
           "--epochs", "1", "--samples", "2048", "--json", str(out)]  # fmt: skip
    proc = run_with_deadline(cmd, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert result["ranks"] == 2 and result["steps_per_fit"] == 2048 // 64
    none, widget = result["runs"]["none"], result["runs"]["widget"]
    assert len(none) == len(widget) == 1
    assert result["median_none"] > 0 and result["median_widget"] > 0
    ratio = widget[0]["samples_per_s"] / none[0]["samples_per_s"]
    assert result["overhead"] == pytest.approx(1 - ratio)
    assert none[0]["hooks"] == 0.0 and 0 < widget[0]["hooks"] < widget[0]["seconds"]
    assert 0 < result["master_hook_fraction"] < 1
    assert widget[0]["notebook_cpu"] > 0
    assert result["widget_messages_per_fit"][0] > 0  # the widget really was shown
    assert "throughput overhead:" in proc.stdout

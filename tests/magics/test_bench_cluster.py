"""The cluster benchmark runs end to end in a reduced mode and writes its JSON (no timings)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.mpi, pytest.mark.notebook]


def test_cluster_benchmark_reduced_run_writes_json(tmp_path):
    out = tmp_path / "cluster.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tnt_notebook.bench",
            "cluster",
            "--starts",
            "1",
            "--cells",
            "5",
            "--warmup",
            "1",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "start-up, 2 ranks" in proc.stdout and "empty cell round trip" in proc.stdout
    res = json.loads(out.read_text())
    assert res["benchmark"] == "cluster" and res["ranks"] == 2
    s, c = res["startup_s"], res["empty_cell_ms"]
    assert len(s["tnt"]) == 1 and len(s["ipyparallel"]) == 1
    assert s["tnt_median"] > 0 and s["ipyparallel_median"] > 0
    assert s["ratio"] == pytest.approx(s["tnt_median"] / s["ipyparallel_median"])
    assert c["cells"] == 5 and c["tnt_median"] > 0 and c["px_median"] > 0
    assert c["ratio"] == pytest.approx(c["tnt_median"] / c["px_median"])

"""The cluster benchmark runs end to end in a reduced mode and writes its JSON (no timings)."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import pytest

from tests.support.mpiworld import run_with_deadline

pytestmark = [pytest.mark.mpi, pytest.mark.notebook, pytest.mark.slow]  # benchmarks' own runs


def reduced_run(cwd: Path, *options: str) -> tuple[str, dict]:
    out = cwd / "cluster.json"
    proc = run_with_deadline(
        [sys.executable, "-m", "tnt_notebook.bench", "cluster", "--starts", "1", "--cells", "5"]
        + ["--warmup", "1", "--json", str(out), *options],
        timeout=300,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_cluster_benchmark_reduced_run_writes_json(tmp_path):
    stdout, res = reduced_run(tmp_path)
    assert "start-up, 2 ranks on this machine" in stdout and "empty cell round trip" in stdout
    assert res["benchmark"] == "cluster" and res["ranks"] == 2
    s, c = res["startup_s"], res["empty_cell_ms"]
    assert len(s["tnt"]) == 1 and len(s["ipyparallel"]) == 1
    assert s["tnt_median"] > 0 and s["ipyparallel_median"] > 0
    assert s["ratio"] == pytest.approx(s["tnt_median"] / s["ipyparallel_median"])
    assert c["cells"] == 5 and c["tnt_median"] > 0 and c["px_median"] > 0
    assert c["ratio"] == pytest.approx(c["tnt_median"] / c["px_median"])


@pytest.mark.hosts
def test_cluster_benchmark_across_test_hosts(test_hosts):
    """Both sides start one rank on each of two test hosts (same hostfile, ssh, address)."""
    work = Path(tempfile.mkdtemp(dir=test_hosts.shared_dir))
    hostfile = test_hosts.write_hostfile(test_hosts.hosts[:2], work / "hosts")
    options = ["--hostfile", str(hostfile), "--n-per-node", "1", "--ssh", str(test_hosts.ssh)]
    stdout, res = reduced_run(work, *options)
    assert "start-up, 2 ranks on 2 hosts" in stdout, stdout
    assert res["ranks"] == 2 and res["startup_s"]["ipyparallel_median"] > 0
    assert res["empty_cell_ms"]["px_median"] > 0

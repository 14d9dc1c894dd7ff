"""python -m tnt_notebook.bench backup: a backup's write and read, its size, an epoch for scale."""

from __future__ import annotations

import json
import os
import sys

import pytest

from tests.support.keras_worlds import ENV
from tests.support.mpiworld import run_with_deadline


@pytest.mark.slow
def test_bench_backup_reports_write_read_size_and_epoch_for_every_optimizer(tmp_path):
    out = tmp_path / "backup.json"
    proc = run_with_deadline(
        [sys.executable, "-m", "tnt_notebook.bench", "backup", "--models", "lenet",
         "--samples", "2048", "--repeats", "3", "--json", str(out)],
        timeout=300, env={**os.environ, **ENV},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["results"]
    assert [r["optimizer"] for r in rows] == ["sgd_momentum", "adam"]
    for r in rows:
        assert r["parameters"] == 44426
        # weights and one (momentum) or two (Adam) slots each, in float32
        slots = 1 if r["optimizer"] == "sgd_momentum" else 2
        assert r["backup_bytes"] > 4 * r["parameters"] * (1 + slots)
        assert r["write_s"] > 0 and r["read_and_load_s"] > 0 and r["epoch_s"] > 0
        assert 0 < r["write_per_epoch"] == r["write_s"] / r["epoch_s"]
    assert "write/epoch" in proc.stdout

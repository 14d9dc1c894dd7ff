"""Every compiled metric equals serial Keras on every rank, from the first step of fit and evaluate.

The matrix: SGD, SGD with momentum, Adam x metrics given as a string, a Metric object, a user's
Metric subclass, a plain function, weighted metrics with sample weights x arrays and tf.data,
each through evaluate before fit, fit (train and validation logs that callbacks and History see)
and evaluate after; plus per-output metrics as a dict and as a list. Each world runs every
optimizer x form on one input kind, the 2- and 3-rank worlds on opposite ones, so that together
they run every combination; batches of 17 samples split unevenly on both. The 3-rank world (3
ranks on the suite's 2 cores) is marked slow. Optimizers without state and metric
objects made before compile are the cases where the ranks' metrics used to stay local.
"""

from __future__ import annotations

import pytest

from tests.support.keras_worlds import run_worker

pytestmark = pytest.mark.mpi

TOL = 1e-6


@pytest.mark.parametrize("ranks", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_every_metric_form_equals_serial_keras_on_every_rank(ranks, tmp_path):
    per_rank, _ = run_worker(ranks, "metrics_worker", tmp_path, timeout=600)
    assert [r["size"] for r in per_rank] == [ranks] * ranks
    assert len(per_rank[0]["results"]) == 17
    for rank, r in enumerate(per_rank):
        off = {name: res for name, res in r["results"].items() if not res["rel"] <= TOL}
        assert not off, f"rank {rank}: metrics differ from serial Keras: {off}"
        assert all(res["logs"] >= 30 for res in r["results"].values())

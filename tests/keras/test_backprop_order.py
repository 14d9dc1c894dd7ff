"""Across nodes, a step's backprop goes on only after each gradient bucket has started, so that
the buckets' exchange travels while the rest of backprop runs (whatever order TensorFlow's
executor would pick)."""

from __future__ import annotations

import math

import pytest

from tests.support.keras_worlds import run_worker


@pytest.mark.mpi
@pytest.mark.parametrize(
    ("overlap", "compression", "starts"),
    [
        ("1", "", 3),
        pytest.param("steps", "", 4, marks=pytest.mark.slow),
        pytest.param("1", "fp16", 3, marks=pytest.mark.slow),
    ],
    ids=["in-the-step", "across-steps", "fp16"],
)
def test_the_convolutions_backprop_runs_after_the_dense_layers_buckets_start(
    tmp_path, overlap, compression, starts
):
    """LeNet-5's buckets: the dense layers' (two; one in fp16) and the convolutions' (last),
    after the metric states' where those travel in a bucket of their own (across steps; in fp16,
    as buckets hold one dtype). Every gradient op of the convolutions waits for each earlier
    bucket's start. Where the metrics' bucket starts first, the loss's update (which
    tf.function orders before the metric states are read, by control edges of its own) stands
    between it and backprop: the step must still trace without a cycle. Without the edges,
    TensorFlow with one inter-op thread runs all of these gradients before any start."""
    env = {"TNT_RANKS_PER_NODE": "1", "TNT_OVERLAP": overlap, "TNT_TEST_COMPRESSION": compression}
    per_rank, _ = run_worker(2, "backprop_order_worker", tmp_path, env=env)
    for d in per_rank:
        assert d["in_halves"], d
        total, after = d["convolution_gradients"], d["after_each_start"]
        assert total >= 3, d  # (2 filters and 1 input gradient at least)
        assert after == [total] * (starts - 1) + [0], d


@pytest.mark.mpi
@pytest.mark.parametrize(
    "overlap",
    ["1", pytest.param("steps", marks=pytest.mark.slow)],
    ids=["in-the-step", "across-steps"],
)
def test_steps_with_stateful_layers_of_their_own_train_alike_on_every_rank(tmp_path, overlap):
    """BatchNormalization's moving statistics, Dropout's and the LSTM's seeds, an Embedding's
    lookup: variables and stateful ops that tf.function orders by control edges of its own
    beside the edges before the buckets' starts. The steps trace (no cycle), train (finite
    losses) and leave the same weights on every rank, in float32 and fp16."""
    env = {"TNT_RANKS_PER_NODE": "1", "TNT_OVERLAP": overlap, "TNT_TEST_LAYERS": "1"}
    per_rank, _ = run_worker(2, "backprop_order_worker", tmp_path, env=env)
    assert all(d["in_halves"] for d in per_rank), per_rank
    first, second = (d["layers"] for d in per_rank)
    assert len(first) == 4, first
    for name, result in first.items():
        assert all(math.isfinite(v) for v in result["losses"]), (name, result)
        assert result == second[name], name  # (the same weights: reduced alike on both ranks)

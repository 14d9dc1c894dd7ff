"""Every Keras training feature of features_worker.FEATURES ends on 1, 2 and 3 ranks where serial
Keras ends (weights, History, evaluate, predict), with identical weights on every rank.

One mpiexec world per rank count trains every feature (TensorFlow imported once per rank); each
feature is then its own test case.
"""

from __future__ import annotations

import pytest

from tests.keras.features_worker import EPOCHS, FEATURES
from tests.support.keras_worlds import run_worker

# The 3-rank world (uneven micro-batches) beside the 2-rank one is a larger variant: slow.
WORLDS = [
    pytest.param(1, id="1-ranks"),
    pytest.param(2, id="2-ranks"),
    pytest.param(3, id="3-ranks", marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def worlds(tmp_path_factory) -> dict:
    """Per rank count, each rank's results (the world runs when a test first asks for it)."""
    found: dict[int, list[dict]] = {}

    def results(ranks: int) -> list[dict]:
        if ranks not in found:
            out = tmp_path_factory.mktemp(f"features{ranks}")
            # (the per-epoch replica check off: the comparisons catch what differs on their own)
            env = {"TNT_CHECK_REPLICAS": "fit"}
            found[ranks], _ = run_worker(ranks, "features_worker", out, timeout=900, env=env)
        return found[ranks]

    return results


@pytest.mark.mpi
@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("ranks", WORLDS)
def test_feature_trains_as_serial_keras(worlds, ranks, feature):
    per_rank = worlds(ranks)
    for rank, d in enumerate(per_rank):
        assert d["size"] == ranks
        result = d["results"][feature]
        assert "error" not in result, f"rank {rank}: {result['error']}\n{result.get('traceback')}"
        if "worst" in result:
            assert result["worst"] <= 1.0, f"rank {rank}: {feature} differs at {result['where']}"
    assert len({d["results"][feature]["checksum"] for d in per_rank}) == 1, "ranks differ"


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", WORLDS)
def test_explicit_progbar_logger_prints_each_epoch_once_on_the_master_rank(worlds, ranks):
    lines = [
        d["results"]["explicit_progbar_logger_with_validation"]["per_rank"]["rank.epoch_lines"]
        for d in worlds(ranks)
    ]
    assert lines == [EPOCHS] + [0] * (ranks - 1)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", WORLDS[1:])
def test_ranks_draw_different_dropout_masks(worlds, ranks):
    masks = [d["results"]["dropout_draws_differ_between_ranks"]["per_rank"]["rank.mask"]
             for d in worlds(ranks)]  # fmt: skip
    assert len(set(masks)) == ranks


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", WORLDS)
def test_pydataset_batches_come_in_a_new_order_every_epoch(worlds, ranks):
    for d in worlds(ranks):
        assert d["results"]["pydataset_shuffled_each_epoch"]["per_rank"]["rank.shuffled"] == 1.0

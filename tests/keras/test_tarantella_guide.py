"""The data and training calls of Tarantella's guide, written as the guide writes them, on 3 ranks
(micro-batches of 16 or 64 samples split unevenly), give what serial Keras gives.

The model API calls (save/load, architecture, weights) are in test_api.py, callbacks in
test_callbacks.py; docs/tarantella-api.md maps every call of the guide to its test.
"""

from __future__ import annotations

import pytest

from tests.support.keras_worlds import run_worker

pytestmark = pytest.mark.mpi

SECTIONS = [
    "quick_start",
    "micro_batch_size_on_unbatched_data",
    "micro_batch_size_consistent_with_batched_data",
    "validation_micro_batch_size",
    "manually_distributed_datasets",
    "short_last_batch_kept",
    "history_callback_on_the_master_rank_only",
]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return run_worker(3, "guide_worker", tmp_path_factory.mktemp("guide"), timeout=600)[0]


@pytest.mark.parametrize("section", SECTIONS)
def test_the_guides_call_gives_serial_keras_results_on_every_rank(world, section):
    for rank, r in enumerate(world):
        assert r["size"] == 3
        assert r["results"][section] <= 1e-5, f"rank {rank}"

"""tnt.Model(reproducible=True): the same bits, weights, History and evaluate, for 1 to 4 ranks,
on arrays and on tf.data, over the engine's own path and over MPI_Allreduce, with and without
overlap, on one node and on pseudo-nodes (where a step's buckets travel in halves), for LeNet-5
with dropout, shuffling and a learning-rate schedule."""

from __future__ import annotations

import pytest

from tests.support.keras_worlds import run_worker
from tests.support.mpiworld import run_plain

pytestmark = pytest.mark.mpi

# 1, 2 and 3 ranks over both paths, with and without overlap; the plain 2- and 3-rank worlds and
# 4 ranks (larger variants of the same) are slow.
WORLDS = {
    "1 rank": (1, {}),
    "2 ranks, MPI_Allreduce, no overlap": (2, {"TNT_ALLREDUCE_PATH": "mpi", "TNT_OVERLAP": "0"}),
    "3 ranks on 3 pseudo-nodes": (3, {"TNT_RANKS_PER_NODE": "1", "TNT_ALLREDUCE_PATH": "engine"}),
}


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, list[dict]]:
    found = {}
    for name, (ranks, env) in WORLDS.items():
        out = tmp_path_factory.mktemp("reproducible")
        found[name], _ = run_worker(ranks, "reproducible_worker", out, timeout=600, env=env)
    return found


@pytest.mark.parametrize("inputs", ["arrays", "dataset"])
@pytest.mark.parametrize("what", ["weights", "history", "evaluate"])
def test_reproducible_training_gives_the_same_bits_on_any_number_of_ranks(outcomes, inputs, what):
    bits = {name: {r[inputs][what] for r in results} for name, results in outcomes.items()}
    assert all(len(b) == 1 for b in bits.values()), bits  # every rank alike
    assert len({b.pop() for b in bits.values()}) == 1, bits  # every world alike


def test_the_training_learns(outcomes):
    loss = outcomes["1 rank"][0]["arrays"]["loss"]
    assert loss[-1] < loss[0], loss


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_plain_worlds_of_more_ranks_give_the_bits_of_one(outcomes, tmp_path, ranks):
    found, _ = run_worker(ranks, "reproducible_worker", tmp_path, timeout=600)
    one = outcomes["1 rank"][0]
    for inputs in ("arrays", "dataset"):
        for what in ("weights", "history", "evaluate"):
            assert {r[inputs][what] for r in found} == {one[inputs][what]}, (inputs, what)


def test_what_the_reproducible_mode_does_not_cover_is_a_clear_error():
    result = run_plain(
        """
        import os
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
        import keras
        import tnt_notebook as tnt

        def refused(make, match):
            try:
                make()
            except ValueError as e:
                assert match in str(e), e
            else:
                raise AssertionError(f"accepted: {match}")

        dense = lambda: keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
        refused(lambda: tnt.Model(dense(), chunk_size=8), "give reproducible=True too")
        refused(lambda: tnt.Model(dense(), reproducible=True, chunk_size=0), "positive integer")
        normalized = keras.Sequential(
            [keras.Input((4,)), keras.layers.BatchNormalization(), keras.layers.Dense(2)]
        )
        refused(lambda: tnt.Model(normalized, reproducible=True), "BatchNormalization")
        refused(lambda: tnt.Model(dense(), reproducible=True, compression="fp16"), "compression")

        class OwnStep(keras.Model):
            def train_step(self, data):
                return super().train_step(data)

        inputs = keras.Input((4,))
        own = OwnStep(inputs, keras.layers.Dense(2)(inputs))
        refused(lambda: tnt.Model(own, reproducible=True), "own train_step")
        print("REFUSED")
        """,
        env={"TNT_REPRODUCIBLE": ""},
    )
    assert "REFUSED" in result.stdout, result.stderr

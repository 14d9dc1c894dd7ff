"""tnt.Model(reproducible=True): the same bits, weights, History, evaluate and predict, for 1 to 4
ranks, on arrays and on tf.data, over the engine's own path and over MPI_Allreduce, with and
without overlap, on one node, on pseudo-nodes (where a step's buckets travel in halves), across
test hosts and over GASPI, for LeNet-5 with dropout, shuffling and a learning-rate schedule, and a
net with BatchNormalization; a fit interrupted on one number of ranks and resumed on another ends
with the uninterrupted run's bits; tnt.reproducibility_report tells the same bits from others."""

from __future__ import annotations

import shutil

import pytest

from tests.support.keras_worlds import run_worker
from tests.support.mpiworld import GASPI_ENV, requires_gaspi, run_plain

pytestmark = pytest.mark.mpi

# 1, 2 and 3 ranks over both paths, with and without overlap (the 2-rank world's interrupted fit
# resumed on 1 and on 3 ranks); plain worlds of 2 to 4 ranks (4 interrupted, 2 and 3 resuming),
# test hosts and GASPI are slow.
WORLDS = {
    "2 ranks, MPI_Allreduce, no overlap": (2, {"TNT_ALLREDUCE_PATH": "mpi", "TNT_OVERLAP": "0"}),
    "1 rank": (1, {}),
    "3 ranks on 3 pseudo-nodes": (3, {"TNT_RANKS_PER_NODE": "1", "TNT_ALLREDUCE_PATH": "engine"}),
}
COMPARED = {
    "arrays": ["weights", "history", "evaluate", "predict"],
    "dataset": ["weights", "history", "evaluate", "predict"],
    "normalized": ["weights", "history"],
}


def interrupted_then_resumed(tmp_path, worlds: dict[str, tuple[int, dict]]) -> dict:
    """Each world's results: the first interrupts the arrays' fit after a backup, each other
    resumes it from a copy of that backup (on its own number of ranks)."""
    found, interrupted = {}, tmp_path / "backup"
    for i, (name, (ranks, env)) in enumerate(worlds.items()):
        role = "RESUME" if i else "INTERRUPT"
        backup = tmp_path / f"backup-{i}" if i else interrupted
        if i:
            shutil.copytree(interrupted, backup)
        out = tmp_path / f"world-{i}"
        out.mkdir()
        env = {**env, f"REPRODUCIBLE_{role}": str(backup)}
        found[name], _ = run_worker(ranks, "reproducible_worker", out, timeout=600, env=env)
    return found


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory) -> dict[str, list[dict]]:
    return interrupted_then_resumed(tmp_path_factory.mktemp("reproducible"), WORLDS)


def assert_the_bits_of_one_rank(one: dict, found: list[dict]) -> None:
    for part, kinds in COMPARED.items():
        for what in kinds:
            assert {r[part][what] for r in found} == {one[part][what]}, (part, what)


@pytest.mark.parametrize(
    ("part", "what"), [(part, what) for part, kinds in COMPARED.items() for what in kinds]
)
def test_reproducible_training_gives_the_same_bits_on_any_number_of_ranks(outcomes, part, what):
    bits = {name: {r[part][what] for r in results} for name, results in outcomes.items()}
    assert all(len(b) == 1 for b in bits.values()), bits  # every rank alike
    assert len({b.pop() for b in bits.values()}) == 1, bits  # every world alike


def test_the_training_learns_and_batch_statistics_move(outcomes):
    one = outcomes["1 rank"][0]
    assert one["arrays"]["loss"][-1] < one["arrays"]["loss"][0], one["arrays"]["loss"]
    assert one["normalized"]["moved"]


@pytest.mark.parametrize("world", ["1 rank", "3 ranks on 3 pseudo-nodes"])
def test_a_fit_interrupted_on_2_ranks_resumes_on_another_number_to_the_same_bits(outcomes, world):
    uninterrupted = outcomes["1 rank"][0]["arrays"]
    for rank in outcomes[world]:
        for what in COMPARED["arrays"]:
            assert rank["resumed"][what] == uninterrupted[what], what


def test_the_report_finds_the_same_bits_and_puts_the_model_back(outcomes):
    for name, results in outcomes.items():
        for r in results:
            assert r["report"]["identical"] and r["report"]["restored"], (name, r["report"])
            assert r["report"]["differing_weights"] == 0
            assert "The same bits on 1 rank" in r["report"]["summary"]


def test_the_report_finds_noise_drawn_from_each_ranks_own_stream(outcomes):
    """TensorFlow's own random ops, outside Keras's seed generators, draw per rank."""
    for name, results in outcomes.items():
        if len(results) > 1:
            for r in results:
                report = r["noisy_report"]
                assert not report["identical"] and report["restored"], (name, report)
                assert 0 < report["differing_weights"] <= report["weights"]
                assert "Different bits" in report["summary"]


@pytest.mark.slow
def test_a_fit_interrupted_on_4_ranks_resumes_on_2_and_3_to_the_same_bits(outcomes, tmp_path):
    worlds = {"4 ranks": (4, {}), "2 ranks": (2, {}), "3 ranks": (3, {})}
    found = interrupted_then_resumed(tmp_path, worlds)
    uninterrupted = outcomes["1 rank"][0]["arrays"]
    for name in ("2 ranks", "3 ranks"):
        for rank in found[name]:
            for what in COMPARED["arrays"]:
                assert rank["resumed"][what] == uninterrupted[what], (name, what)
    assert_the_bits_of_one_rank(outcomes["1 rank"][0], found["4 ranks"])


@pytest.mark.slow
@pytest.mark.hosts
@pytest.mark.parametrize(("hosts", "per_node"), [(2, 1), (2, 2)], ids=["2x1", "2x2"])
def test_worlds_across_test_hosts_give_the_bits_of_one(outcomes, test_hosts, hosts, per_node):
    out = test_hosts.shared_dir / f"reproducible-{hosts}x{per_node}"
    out.mkdir()
    hostfile = test_hosts.write_hostfile(test_hosts.hosts[:hosts], out / "hosts")
    found, _ = run_worker(
        hosts * per_node, "reproducible_worker", out, timeout=900, env=test_hosts.env,
        mpi_args=("-f", str(hostfile), "-ppn", str(per_node)),
    )  # fmt: skip
    assert_the_bits_of_one_rank(outcomes["1 rank"][0], found)


@requires_gaspi
@pytest.mark.slow
def test_worlds_over_gaspi_give_the_bits_of_one(outcomes, tmp_path):
    found, _ = run_worker(3, "reproducible_worker", tmp_path, timeout=600, env=GASPI_ENV)
    assert_the_bits_of_one_rank(outcomes["1 rank"][0], found)


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
        refused(lambda: tnt.Model(dense(), reproducible=True, compression="fp16"), "compression")

        class OwnStep(keras.Model):
            def train_step(self, data):
                return super().train_step(data)

        inputs = keras.Input((4,))
        own = OwnStep(inputs, keras.layers.Dense(2)(inputs))
        refused(lambda: tnt.Model(own, reproducible=True), "own train_step")
        default = tnt.Model(dense())
        default.compile("sgd", "mse")
        report = lambda: tnt.reproducibility_report(default, [[0.0] * 4], [[0.0] * 2])
        refused(report, "reproducible=True")
        print("REFUSED")
        """,
        env={"TNT_REPRODUCIBLE": ""},
    )
    assert "REFUSED" in result.stdout, result.stderr

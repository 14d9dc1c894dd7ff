"""tnt.Model on 1, 2 and 3 ranks ends where serial Keras ends (history, weights, outputs)."""

from __future__ import annotations

import os
import sys

import pytest

from tests.support.keras_worlds import ENV, run_worker
from tests.support.mpiworld import GASPI_ENV, requires_gaspi, run_with_deadline

TOL = 1e-4
FP16_TOL = 2e-2
SCENARIOS = {
    "dense_sgd",
    "lenet_sgd_momentum_dataset",
    "sequential_nesterov_validation",
    "subclassed_adam_4_steps_per_execution",
    "rmsprop_batch_21_class_weight",
    "adagrad_single_sample_last_batch",
    "per_rank_dataset_micro_batches",
    "unknown_cardinality_dataset_class_weight",
    "pydataset_input",
}
# With TNT_OVERLAP=steps: what callbacks see between steps.
PENDING_UPDATE_SCENARIOS = {"pending_updates_between_steps", "batch_callback_sees_serial_weights"}
# A conv net on a tf.data pipeline, and a last global batch of 1 sample (empty micro-batches).
GASPI_SCENARIOS = ["lenet_sgd_momentum_dataset", "adagrad_single_sample_last_batch"]


@pytest.fixture(scope="module")
def serial(tmp_path_factory) -> dict[str, str]:
    """Serial Keras's outcome of every scenario, computed once in a process of its own for the
    module's worlds (whose ranks would each compute it); the environment that hands it to them."""
    out = tmp_path_factory.mktemp("serial")
    code = f"from tests.keras import equivalence_worker as w; w.write_serial_outcomes({str(out)!r})"
    proc = run_with_deadline([sys.executable, "-c", code], env={**os.environ, **ENV}, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return {"TNT_TEST_SERIAL_OUTCOMES": str(out)}


@pytest.mark.mpi
@pytest.mark.parametrize(
    "ranks, reduction",
    [
        pytest.param(1, "op", marks=pytest.mark.slow),
        (2, "op"),
        pytest.param(3, "op", marks=pytest.mark.slow),  # 3 ranks on the suite's 2 cores
        pytest.param(2, "numpy_function", marks=pytest.mark.slow),
        (2, "op,numpy_function"),
    ],
    ids=["1-rank", "2-ranks", "3-ranks", "2-ranks-numpy_function-fallback", "2-ranks-mixed"],
)
def test_training_on_ranks_matches_serial_keras(ranks, reduction, tmp_path, serial):
    """``reduction``: the path of every rank, or of each rank (the op on rank 0, no op on rank 1:
    then the whole world takes the fallback, so that every rank runs the same graph). The mixed
    world runs two scenarios through the fallback; the fallback world (slow) runs all of them."""
    paths = reduction.split(",") if "," in reduction else [reduction] * ranks
    fallback = ",".join(str(r) for r, path in enumerate(paths) if path == "numpy_function")
    mixed = "," in reduction
    scenarios = {"dense_sgd", "sequential_nesterov_validation"} if mixed else SCENARIOS
    env = {"FALLBACK_RANKS": fallback, "TNT_TEST_SCENARIOS": ",".join(sorted(scenarios))}
    per_rank, _ = run_worker(ranks, "equivalence_worker", tmp_path, env={**serial, **env})
    assert all(d["size"] == ranks for d in per_rank)
    used = "numpy_function" if fallback else "op"
    for d in per_rank:  # the op was built and used, or the fallback
        assert d["op_library"] == (used == "op")
        if ranks > 1:
            assert (d["python_reductions"] > 0) == (used == "numpy_function")
    if mixed:  # the rank that has the op says why it does not use it
        assert any(
            f"rank(s) [{fallback}] have no TensorFlow op" in w for w in per_rank[0]["warnings"]
        )
    assert_matches_serial_keras(per_rank, scenarios)
    assert "val_loss" in per_rank[0]["results"]["sequential_nesterov_validation"]["history_keys"]
    assert per_rank[0]["results"]["dense_sgd"]["predict_shape"] == [103, 3]


@requires_gaspi
@pytest.mark.mpi
@pytest.mark.slow  # (a fit over GASPI across real hosts: test_gaspi_cluster_across_hosts.py)
@pytest.mark.parametrize("ranks", [2, 3], ids=["2-nodes", "3-nodes"])
def test_training_over_gaspi_between_pseudo_nodes_matches_serial_keras(ranks, tmp_path, serial):
    """Every gradient bucket crosses the GASPI ring (one rank per pseudo-node)."""
    env = {**GASPI_ENV, "TNT_TEST_SCENARIOS": ",".join(GASPI_SCENARIOS)}
    per_rank, _ = run_worker(ranks, "equivalence_worker", tmp_path, env={**serial, **env})
    assert all(d["transport"] == "gaspi" and d["num_nodes"] == ranks for d in per_rank)
    assert_matches_serial_keras(per_rank, set(GASPI_SCENARIOS))


@pytest.mark.mpi
@pytest.mark.parametrize(
    "ranks", [2, pytest.param(3, marks=pytest.mark.slow)], ids=["2-nodes", "3-nodes"]
)
def test_training_across_pseudo_nodes_in_halves_matches_serial_keras(ranks, tmp_path, serial):
    """Across nodes each bucket starts as soon as its gradients exist and finishes after the last
    start; batches of a step's buckets are posted or carried out whole, as measured (probes go
    both ways within the first steps). With TNT_OVERLAP=0 on one rank, no rank uses halves."""
    env = {"TNT_RANKS_PER_NODE": "1"}
    per_rank, _ = run_worker(ranks, "equivalence_worker", tmp_path, env={**serial, **env})
    assert all(d["num_nodes"] == ranks and d["in_halves"] for d in per_rank)
    assert not any(d["across_steps"] for d in per_rank)
    assert any(s["decisions"] > 0 for s in per_rank[0]["posting_sites"]), per_rank[0]
    assert_matches_serial_keras(per_rank, SCENARIOS)


@pytest.mark.mpi
def test_training_with_updates_left_to_the_next_step_matches_serial_keras(tmp_path, serial):
    """TNT_OVERLAP=steps: the next step finishes a step's buckets, just before it reads the
    weights. Updates are pending after each step; a callback that reads the weights after every
    step sees that step's update, as in serial Keras; validation, several steps per call, the end
    of data of unknown length and empty micro-batches give serial Keras's results."""
    scenarios = PENDING_UPDATE_SCENARIOS | {
        "lenet_sgd_momentum_dataset",
        "sequential_nesterov_validation",
        "subclassed_adam_4_steps_per_execution",
        "adagrad_single_sample_last_batch",
        "unknown_cardinality_dataset_class_weight",
    }
    env = {
        "TNT_RANKS_PER_NODE": "1",
        "TNT_OVERLAP": "steps",
        "TNT_TEST_SCENARIOS": ",".join(sorted(scenarios)),
    }
    per_rank, _ = run_worker(2, "equivalence_worker", tmp_path, env={**serial, **env})
    assert all(d["across_steps"] for d in per_rank)
    assert any(s["decisions"] > 0 for s in per_rank[0]["posting_sites"]), per_rank[0]
    assert_matches_serial_keras(per_rank, scenarios)
    for d in per_rank:
        pending = d["results"]["pending_updates_between_steps"]["pending_at_batch_end"]
        assert len(pending) == 3 * 6 and all(pending), pending  # 3 epochs of 6 steps
        flushed = d["results"]["batch_callback_sees_serial_weights"]
        assert not any(flushed["pending_at_batch_end"]), flushed
        assert flushed["batch_weights_abs"] <= TOL, flushed


@pytest.mark.mpi
def test_updates_left_to_the_next_step_only_where_every_rank_says_so(tmp_path, serial):
    """TNT_OVERLAP=steps on rank 0 only: every rank finishes its buckets within the step."""
    env = {
        "TNT_RANKS_PER_NODE": "1",
        "TNT_TEST_SCENARIOS": "pending_updates_between_steps",
        "ACROSS_STEPS_RANKS": "0",
    }
    per_rank, _ = run_worker(2, "equivalence_worker", tmp_path, env={**serial, **env})
    assert all(d["in_halves"] and not d["across_steps"] for d in per_rank)
    for d in per_rank:
        assert not any(d["results"]["pending_updates_between_steps"]["pending_at_batch_end"])
    assert_matches_serial_keras(per_rank, {"pending_updates_between_steps"})


@pytest.mark.mpi
def test_one_rank_saying_no_overlap_keeps_every_rank_in_one_op(tmp_path, serial):
    env = {"TNT_RANKS_PER_NODE": "1", "TNT_TEST_SCENARIOS": "dense_sgd", "NO_OVERLAP_RANKS": "1"}
    per_rank, _ = run_worker(2, "equivalence_worker", tmp_path, env={**serial, **env})
    assert not any(d["in_halves"] for d in per_rank)
    assert per_rank[0]["posting_sites"] == []
    assert_matches_serial_keras(per_rank, {"dense_sgd"})


@pytest.mark.mpi
def test_fp16_compressed_gradients_travel_in_16_bits_and_train_close_to_serial_keras(
    tmp_path, serial
):
    """Across pseudo-nodes (the case compression is for): the gradient buckets hold float16,
    the weights differ from serial Keras by fp16 rounding only and are identical on every rank."""
    scenarios = {"dense_sgd", "lenet_sgd_momentum_dataset"}
    env = {
        "TNT_RANKS_PER_NODE": "1",
        "TNT_TEST_COMPRESSION": "fp16",
        "TNT_TEST_SCENARIOS": ",".join(scenarios),
    }
    per_rank, _ = run_worker(2, "equivalence_worker", tmp_path, env={**serial, **env})
    for name in scenarios:
        res = per_rank[0]["results"][name]
        assert res["gradient_dtypes"] == ["float16"], (name, res)
        assert 1e-6 < res["weights_abs"] <= FP16_TOL, (name, res)  # rounded, and only that
        assert res["history_rel"] <= FP16_TOL and res["evaluate_rel"] <= FP16_TOL, (name, res)
    assert_matches_serial_keras(per_rank, scenarios, tol=1.0)  # (tolerances checked above)


def assert_matches_serial_keras(
    per_rank: list[dict], scenarios: set[str], tol: float = TOL
) -> None:
    for rank, d in enumerate(per_rank):
        assert set(d["results"]) == scenarios
        for name, res in d["results"].items():
            where = f"rank {rank}, {name}"
            assert res["epochs"] == 3, where
            assert "loss" in res["history_keys"] and "accuracy" in res["history_keys"], where
            assert res["history_rel"] <= tol, where
            assert res["weights_abs"] <= tol, where
            assert res["evaluate_rel"] <= tol, where
            assert res["predict_abs"] <= tol, where
    for name in scenarios:  # bitwise identical weights on every rank
        sums = {tuple(d["results"][name]["checksum"]) for d in per_rank}
        assert len(sums) == 1, f"{name}: weights differ between ranks"

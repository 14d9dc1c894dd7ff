"""tnt.Model's API on 2 ranks: weight broadcasts, saving, tnt.models, shuffling, bad input."""

from __future__ import annotations

import pytest
from keras_worlds import run_worker

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("api")
    return out, run_worker(2, "api_worker", out)[0]


def test_master_weights_are_broadcast_before_training(world):
    r0, r1 = world[1]
    assert r0["initial_broadcast"] != r1["initial_broadcast"]  # different seeds per rank
    assert r0["after_fit"] == r1["after_fit"]


def test_set_weights_broadcasts_the_master_rank_values(world):
    assert [r["set_weights"] for r in world[1]] == [1.0, 1.0]


def test_keras_attributes_are_delegated(world):
    for r in world[1]:
        a = r["attributes"]
        assert a["layers"] == 2 and a["trainable_weights"] == 4 and a["optimizer"] == "SGD"
        assert a["metrics_names"] == ["loss", "compile_metrics"]
        assert a["json_is_model"] == "Sequential" and a["call_shape"] == [3, 2]


def test_save_writes_on_master_only_unless_all_devices(world):
    out, (r0, r1) = world
    assert r0["saved"] == {k: True for k in r0["saved"]}
    assert r1["saved"] == {
        "only_mine": False,
        "models_api_mine": False,
        "weights_mine": False,
        "all_devices_mine": True,  # tnt_save_all_devices: rank 1 writes all.rank1.keras
        "shared_visible": True,  # written by the master before save returned on rank 1
    }
    assert (out / "all.keras").exists() and (out / "all.rank1.keras").exists()


def test_load_model_returns_compiled_tnt_model_with_saved_weights(world):
    for r in world[1]:
        lm = r["load_model"]
        assert lm["type"] == "tnt_notebook.keras.model.Model"
        assert lm["compiled"] and lm["optimizer"] == "SGD"
        assert lm["weights_equal"] and lm["evaluate_equal"]
        assert lm["uncompiled"] is False and lm["uncompiled_type"] == "Model"
        assert r["load_weights_equal"]


def test_models_api_returns_tnt_models(world):
    for r in world[1]:
        assert r["models_api"] == {
            "from_config": "Model",
            "from_json": "Model",
            "clone": "Model",
            "clone_layers": 2,
        }


def test_unseeded_shuffle_is_identical_on_all_ranks(world):
    r0, r1 = world[1]
    assert r0["shuffle"]["global_batch"] == 8
    for epoch in range(2):
        seen = [i for r in (r0, r1) for batch in r["shuffle"]["epochs"][epoch] for i in batch]
        assert sorted(seen) == list(range(40))  # the ranks' slices partition every epoch
    assert r0["shuffle"]["epochs"][0] != r0["shuffle"]["epochs"][1]  # reshuffled each epoch


def test_ranks_iterate_without_the_tf_data_autotune_model(world):
    # its thread made every iterator teardown (each epoch) wait 0.3-0.5 s on busy cores
    for r in world[1]:
        assert r["autotune_model"] == [False, False]


def test_numpy_inputs_are_freed_with_their_pipeline_not_left_to_gc(world):
    # held until a gc pass, each fit's copy of the arrays went to fresh memory: 0.35-0.6 s / 100 MB
    for r in world[1]:
        assert r["arrays_left_to_gc"] == [0, 0]


def test_a_dataset_given_again_reaches_tf_data_as_the_same_object(world):
    # tf.data optimizes (serializes) each new dataset object at its first iterator: 0.3-0.4 s a fit
    for r in world[1]:
        assert r["same_object_again"] == [True] * 4


def test_numpy_shuffle_is_identical_on_all_ranks_despite_different_global_seeds(world):
    r0, r1 = world[1]
    for epoch in range(2):
        seen = [i for r in (r0, r1) for batch in r["shuffle_arrays"][epoch] for i in batch]
        assert sorted(seen) == list(range(40))
    assert r0["shuffle_arrays"][0] != r0["shuffle_arrays"][1]


def test_numpy_batch_shuffle_reorders_whole_batches_alike_on_all_ranks(world):
    r0, r1 = world[1]
    orders = []
    for epoch in range(4):
        slices = (r["shuffle_batches"][epoch] for r in (r0, r1))
        batches = [b0 + b1 for b0, b1 in zip(*slices, strict=True)]
        starts = [b[0] for b in batches]
        assert batches == [list(range(s, min(s + 8, 42))) for s in starts]  # whole, in order
        assert starts[-1] == 40  # the short batch stays last
        orders.append(starts)
    assert len({tuple(o) for o in orders}) > 1  # reshuffled between epochs


@pytest.mark.parametrize(
    "case, kind, text",
    [
        ("batch_smaller_than_ranks", "ValueError", "smaller than the number of ranks"),
        ("dataset_batch_smaller_than_ranks", "ValueError", "smaller than the number of ranks"),
        ("inconsistent_micro_batch", "ValueError", "tnt_micro_batch_size=3 is inconsistent"),
        ("inconsistent_validation_micro_batch", "ValueError", "global validation batch size"),
        ("class_and_sample_weight", "ValueError", "`class_weight` and `sample_weight`"),
        ("ftrl_object", "ValueError", "Ftrl"),
        ("ftrl_name", "ValueError", "Ftrl"),
        ("train_on_batch", "NotImplementedError", "train_on_batch"),
        ("gradient_tape", "NotImplementedError", "GradientTape"),
        ("custom_train_step", "NotImplementedError", "overrides train_step"),
    ],
)
def test_bad_input_raises_clearly_on_every_rank(world, case, kind, text):
    for r in world[1]:
        assert r["errors"][case][0] == kind and text in r["errors"][case][1]


def test_consistent_micro_batch_is_accepted(world):
    assert all(r["consistent_micro_batch"] == ["no error", ""] for r in world[1])


def test_small_micro_batch_with_batch_norm_and_jit_compile_warn(world):
    for r in world[1]:
        assert any("BatchNormalization with a micro-batch of 4" in w for w in r["warnings"])
        assert any("jit_compile=True is ignored" in w for w in r["warnings"])
        assert r["warnings_large_micro_batch"] == []


def test_batch_norm_statistics_are_identical_on_all_ranks_after_fit(world):
    r0, r1 = world[1]
    assert r0["batch_norm_checksum"] == r1["batch_norm_checksum"]


def test_per_rank_validation_data_gives_global_metrics(world):
    # each rank validates on its own half of X; the aggregate equals evaluating all of X
    for r in world[1]:
        pv = r["per_rank_validation"]
        assert pv["val_loss"] == pytest.approx(pv["evaluate_loss"], rel=1e-5)


def test_global_and_per_rank_datasets_mix_on_one_model(world):
    # validation on per-rank halves, evaluation of the global batches and of the halves: same loss
    for r in world[1]:
        m = r["slicing_modes"]
        assert m["val_loss"] == pytest.approx(m["global_evaluate"], rel=1e-5)
        assert m["per_rank_evaluate"] == pytest.approx(m["global_evaluate"], rel=1e-5)

"""tnt.Model's API on 2 ranks: weight broadcasts, the guide's save/load/architecture/weights calls
on three kinds of model, saving on ranks, replica checks, shuffling, bad input."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tests.support.keras_worlds import run_worker

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    out = tmp_path_factory.mktemp("api")
    return out, run_worker(2, "api_worker", out)[0]


def test_master_weights_are_broadcast_before_training(world):
    r0, r1 = (r["initial_broadcast"] for r in world[1])
    assert r0["own_weights_before"] != r1["own_weights_before"]  # different seeds per rank
    assert r0["at_train_begin"] == r1["at_train_begin"] == r0["own_weights_before"]


def test_set_weights_broadcasts_the_master_rank_values(world):
    assert [r["set_weights"] for r in world[1]] == [1.0, 1.0]


def test_keras_attributes_are_those_of_the_keras_model(world):
    for r in world[1]:
        a = r["attributes"]
        assert a["layers"] == 2 and a["trainable_weights"] == 4 and a["optimizer"] == "SGD"
        assert a["metrics_names"] == ["loss", "compile_metrics"]
        assert a["json_is_model"] == "Sequential" and a["call_shape"] == [3, 2]


def test_a_tnt_model_is_a_keras_model_of_the_wrapped_class(world):
    for r in world[1]:
        assert r["is_keras_model"] == {
            "tnt_model": True,
            "tnt_sequential": True,
            "wrapping_sequential_gives_tnt_sequential": True,
            "functional_arguments": True,
            "strategy_argument": True,
            "class_name": "Functional",
        }


RESTORED = {"tnt_model": True, "same_weights_as_saved": True, "evaluate_equal": True}
REBUILT = {"tnt_model": True, "same_weights_as_saved": False, "evaluate_equal": True}
CLASS = {"functional": "Functional", "sequential": "Sequential", "subclassed": "Subclassed"}


@pytest.mark.parametrize("kind", ["functional", "sequential", "subclassed"])
def test_the_guides_save_load_architecture_and_weights_calls_work(world, kind):
    for r in world[1]:
        api = r["model_api"][kind]
        restored = {**RESTORED, "class": CLASS[kind]}
        rebuilt = {**REBUILT, "class": CLASS[kind]}
        assert api["load_model"] == restored
        assert api["load_model_saved_by_models_api"] == restored
        assert api["load_model_uncompiled_then_compiled"] == restored
        assert api["loaded_compiled"] is True
        for call in ("from_config_of_its_class", "model_from_json", "clone_model"):
            assert api[call] == rebuilt, call
        if kind == "subclassed":
            kind_, text = api["model_from_config"]
            assert kind_ == "TypeError" and "YourModel.from_config(config)" in text
        else:
            for call in ("model_from_config", "tnt_Model_from_config", "keras_style_config"):
                assert api[call] == rebuilt, call
        assert api["load_weights"] is True


def test_yaml_calls_explain_that_keras_3_has_no_yaml(world):
    for r in world[1]:
        for kind, text in r["yaml"]:
            assert kind == "NotImplementedError" and "to_json" in text


def test_save_writes_on_master_only_unless_all_devices(world):
    out, (r0, r1) = world
    assert r0["saved"] == {k: True for k in r0["saved"]}
    assert r1["saved"] == {
        "only_mine": False,
        "models_api_mine": False,
        "weights_mine": False,
        "all_devices_mine": True,  # tnt_save_all_devices: every rank writes the path it passed
        "shared_visible": True,  # written by the master before save returned on rank 1
    }
    assert not (out / "all_rank0.rank1.keras").exists()
    assert all(r["temporary_files_left"] == [] for r in world[1])  # writes are atomic


def test_a_failed_save_names_the_failing_rank_everywhere(world):
    r0, r1 = (r["errors_on_ranks"] for r in world[1])
    assert r0["master_fails"][0] == "FileNotFoundError"  # the master's own error
    assert r1["master_fails"][0] == "RankOperationError"
    assert "failed on rank 0 (FileNotFoundError" in r1["master_fails"][1]
    assert r1["rank1_fails"][0] == "FileNotFoundError"
    assert r0["rank1_fails"][0] == "RankOperationError"
    assert "failed on rank 1 (FileNotFoundError" in r0["rank1_fails"][1]
    assert r0["no_overwrite"][0] == "FileExistsError" and "overwrite=False" in r0["no_overwrite"][1]
    assert "rank 0 (FileExistsError" in r1["no_overwrite"][1]
    for r in (r0, r1):
        assert all("master's error" not in text for _, text in r.values())


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
        ("gradient_tape", "NotImplementedError", "tnt.distributed_optimizer"),
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


def test_batch_norm_statistics_are_averaged_over_the_ranks_at_the_end_of_fit(world):
    r0, r1 = (r["batch_norm"] for r in world[1])
    assert r0["at_train_end"] != r1["at_train_end"]  # each rank's statistics of its own samples
    assert r0["after_fit"] == r1["after_fit"]
    for got, a, b in zip(r0["after_fit"], r0["at_train_end"], r1["at_train_end"], strict=True):
        assert np.allclose(got, (np.asarray(a) + np.asarray(b)) / 2, rtol=1e-6)


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_ranks_whose_weights_drift_apart_raise_naming_them_and_nothing_is_repaired(world, where):
    """Whichever of the model's weights drifts (the first, a middle one, the last)."""
    for r in world[1]:
        kind, text = r["divergence"][where]
        assert kind == "ReplicaDivergenceError"
        assert "rank(s) [1] differ from the master rank's in" in text and "count" in text
        assert r["divergence_counts"][where] == [4 * (r["rank"] + 1)]  # 4 steps, unrepaired


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


@pytest.mark.skipif(os.geteuid() != 0, reason="private directories need mount namespaces (root)")
def test_saving_and_loading_work_where_each_host_has_its_own_directory(tmp_path):
    # every rank sees its own tmpfs at the same path, as hosts without a shared filesystem do
    private = tmp_path / "host"
    private.mkdir()
    own_tmpfs = ("unshare", "--mount", "--propagation", "private", "sh", "-c")
    mount = 'mount -t tmpfs -o mode=0700 tnt-host "$0" && exec "$@"'
    per_rank, _ = run_worker(
        2,
        "private_dirs_worker",
        tmp_path,
        env={"TNT_PRIVATE_DIR": str(private)},
        mpi_args=(*own_tmpfs, mount, str(private)),
    )
    for rank, r in enumerate(per_rank):
        assert r["all_devices_files"] == ["api.keras", "model.keras", "model.weights.h5"]
        assert r["master_file_here"] == (rank == 0)
        assert r["loaded_equal"] and r["load_weights_equal"] and r["own_copy_loads"]
    assert list(private.iterdir()) == []  # nothing reached the shared directory underneath

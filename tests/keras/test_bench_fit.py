"""`python -m tnt_notebook.bench fit` runs every configuration and writes its JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support.mpiworld import run_with_deadline

LENET_PARAMETERS = 156 + 2416 + 30840 + 10164 + 850  # conv 6, conv 16, dense 120, 84, 10


def _bench_fit(*options: str, timeout: float = 600, **run) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "tnt_notebook.bench", "fit", "--repeats", "1", *options]
    proc = run_with_deadline(cmd, timeout=timeout, **run)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc


def _bench_report(tmp_path, *options: str, timeout: float = 600):
    """The run and the JSON report it wrote."""
    out = tmp_path / "fit.json"
    proc = _bench_fit(*options, "--json", str(out), timeout=timeout)
    return proc, json.loads(out.read_text())


@pytest.mark.mpi
@pytest.mark.slow
def test_fit_benchmark_measures_every_configuration_and_writes_json(tmp_path):
    out = tmp_path / "fit.json"
    proc = _bench_fit(
        *("--samples", "512", "--epochs", "2", "--batch", "64", "--timeout", "240"),
        *("--steps-per-execution", "2", "--json", str(out)),  # every configuration compiled alike
    )
    report = json.loads(out.read_text())
    configs = {"keras", "tnt_1", "paired_1", "tnt_2", "paired_2", "mwms_2", "keras_2x"}
    assert set(report["results"]) == configs
    for name, result in report["results"].items():
        assert result["samples_per_s"] > 0, name
        assert result["timed_epochs"] == 1 and len(result["epoch_seconds"]) == 2, name
        assert result["steps_per_execution"] == 2, name  # the option reached every worker
    assert report["results"]["tnt_2"]["ranks"] == 2
    assert report["config"]["model"].startswith("LeNet-5")  # the default
    assert {r["parameters"] for r in report["results"].values()} == {LENET_PARAMETERS}
    paired = report["results"]["paired_1"]  # plain Keras's epochs, interleaved in the same process
    assert len(paired["keras_epoch_seconds"]) == 2 and paired["keras_samples_per_s"] > 0
    rotating = report["results"]["paired_2"]  # 1-process Keras, the ceilings and 2 ranks
    assert len(rotating["solo_epoch_seconds"]) == 2 and rotating["solo_samples_per_s"] > 0
    assert [len(t) for t in rotating["ceiling_epoch_seconds"]] == [2, 2]
    assert [len(t) for t in rotating["lockstep_epoch_seconds"]] == [2, 2]
    assert all(rotating[f"{k}efficiency"] > 0 for k in ("", "ceiling_", "lockstep_"))
    assert report["config"]["global_batch"] == 64 and report["config"]["intra_op_threads"] == 1
    assert report["config"]["steps_per_execution"] == 2
    assert set(report["ratios"]) == {
        "tnt_1_over_keras",
        "paired_tnt_1_over_keras",
        "scaling_efficiency_2",
        "paired_scaling_efficiency_2",
        "paired_ceiling_efficiency_2",
        "paired_lockstep_efficiency_2",
        "tnt_2_over_mwms_2",
        "ceiling_efficiency_2",
        "tnt_2_over_ceiling",
    }
    assert all(isinstance(v, float) and v > 0 for v in report["ratios"].values())
    assert "TF_USE_LEGACY_KERAS=1" in proc.stdout and "rotating epochs" in proc.stdout


@pytest.mark.mpi
@pytest.mark.slow
def test_fit_benchmark_trains_the_mlp_when_asked(tmp_path):
    out = tmp_path / "fit.json"
    _bench_fit(
        *("--model", "mlp", "--hidden", "32", "--configs", "keras,paired_2"),
        *("--samples", "512", "--epochs", "2", "--batch", "64", "--json", str(out)),
        *("--compression", "bf16"),
        timeout=300,
    )
    report = json.loads(out.read_text())
    assert report["config"]["model"] == "MLP 784-32-32-10"
    assert report["config"]["compression"] == "bf16"
    assert report["results"]["paired_2"]["compression"] == "bf16"  # what tnt.Model was given
    assert report["results"]["keras"]["compression"] is None
    mlp_parameters = 784 * 32 + 32 + 32 * 32 + 32 + 32 * 10 + 10
    assert {r["parameters"] for r in report["results"].values()} == {mlp_parameters}


@pytest.mark.mpi
@pytest.mark.hosts
@pytest.mark.slow
def test_fit_benchmark_runs_its_multi_rank_worlds_on_two_hosts_of_two_ranks(test_hosts, tmp_path):
    hostfile = test_hosts.write_hostfile(test_hosts.hosts[:2], tmp_path / "hosts")
    out = tmp_path / "fit.json"
    proc = _bench_fit(
        *("--hostfile", str(hostfile), "--n-per-node", "2", "--configs", "tnt_2,paired_2"),
        *("--model", "mlp", "--hidden", "32", "--samples", "512", "--epochs", "2"),
        *("--batch", "64", "--json", str(out)),
        env={**os.environ, **test_hosts.env},
        cwd=test_hosts.shared_dir,  # (where the ranks start on every host)
    )
    report = json.loads(out.read_text())
    assert report["results"]["tnt_2"]["ranks"] == 4
    rotating = report["results"]["paired_2"]
    assert rotating["ranks"] == 4 and len(rotating["ceiling_epoch_seconds"]) == 4
    assert 0 < rotating["efficiency"] and 0 < rotating["ceiling_efficiency"]
    assert report["config"]["two_rank_worlds"].startswith("4 ranks on 2 hosts x 2")
    assert "tnt.Model, 4 ranks" in proc.stdout and "4-rank scaling efficiency" in proc.stdout


def test_fit_benchmark_with_a_hostfile_refuses_the_configurations_of_this_host_only(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-a\nnode-b\n")
    cmd = [sys.executable, "-m", "tnt_notebook.bench", "fit", "--hostfile", str(hostfile)]
    proc = subprocess.run(
        [*cmd, "--configs", "tnt_2,mwms_2"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 2
    assert "configuration(s) mwms_2 always run on this host" in proc.stderr


@pytest.mark.mpi
@pytest.mark.slow
def test_fit_benchmark_measures_the_reproducible_mode_beside_the_default_and_the_ceiling(tmp_path):
    proc, report = _bench_report(
        tmp_path,
        *("--reproducible", "--chunk-size", "8"),
        *("--samples", "512", "--epochs", "2", "--batch", "64"),
        timeout=400,
    )
    assert set(report["results"]) == {"tnt_2", "reproducible_2", "keras_2x"}
    assert report["results"]["reproducible_2"]["ranks"] == 2
    assert report["ratios"]["reproducible_2_over_tnt_2"] > 0
    assert report["ratios"]["reproducible_2_over_ceiling"] > 0
    assert "reproducible mode / default mode" in proc.stdout


@pytest.mark.mpi
@pytest.mark.slow
def test_fit_benchmark_measures_the_timeline_off_and_on_in_one_world(tmp_path):
    proc, report = _bench_report(
        tmp_path, "--timeline", *("--samples", "512", "--epochs", "3", "--batch", "64"), timeout=300
    )
    assert set(report["results"]) == {"timeline_2"}
    result = report["results"]["timeline_2"]
    assert result["ranks"] == 2 and result["parameters"] == LENET_PARAMETERS
    for name in ("bare", "on"):  # beside "off", the run's own samples/s
        assert len(result[f"{name}_epoch_seconds"]) == 3 and result[f"{name}_samples_per_s"] > 0
    assert len(result["off_again_epoch_seconds"]) == 3  # the same as "off", for the resolution
    assert result["steps_per_fit"] == 8
    assert result["sampled_steps"] == 6  # each fit of 8 steps: all but the first 2
    assert len(result["on_recorder_seconds"]) == 3 and 0 < result["on_recorder_share"] < 1
    assert 0 <= result["off_mark_seconds"] < 1e-4 and result["off_marks_share"] >= 0
    for key in ("off_over_bare", "on_over_off", "off_again_over_off"):  # rotations 2 and 3
        assert len(result[f"rotations_{key}"]) == 2 and result[key] > 0
        assert report["ratios"][f"timeline_{key}"] == result[key]
    assert "the timeline left out / off / on" in proc.stdout
    assert "timeline on, sampling / off" in proc.stdout

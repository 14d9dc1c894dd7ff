"""Keras callbacks with tnt.Model on 2 ranks behave as in serial Keras; the master prints."""

from __future__ import annotations

import csv
import http.server
import json
import threading

import pytest

from tests.support.keras_worlds import run_worker

pytestmark = pytest.mark.mpi


@pytest.fixture(scope="module")
def monitor():
    """A real HTTP server for RemoteMonitor: path -> the JSON bodies posted to it."""
    posts: dict[str, list] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            posts.setdefault(self.path, []).append(json.loads(body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}", posts
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


@pytest.fixture(scope="module")
def world(tmp_path_factory, monitor):
    out = tmp_path_factory.mktemp("callbacks")
    results, proc = run_worker(2, "callbacks_worker", out, env={"TNT_TEST_MONITOR": monitor[0]})
    return out, results, proc.stdout


def test_early_stopping_stops_at_the_serial_epoch_on_every_rank(world):
    for r in world[1]:
        es = r["early_stopping"]
        assert es["same"] and es["epochs_tnt"] == es["epochs_ref"] < 30


def test_learning_rate_scheduler_matches_serial(world):
    for r in world[1]:
        assert r["lr_scheduler"]["same"]
        assert r["lr_scheduler"]["lr"] == pytest.approx([0.05, 0.025, 0.0125, 0.00625])


def test_reduce_lr_on_plateau_reduces_like_serial(world):
    for r in world[1]:
        rl = r["reduce_lr"]
        assert rl["same"] and rl["lr_tnt"] == pytest.approx(rl["lr_ref"]) and rl["lr_tnt"] < 0.1


def test_terminate_on_nan_stops_every_rank_like_serial(world):
    for r in world[1]:
        t = r["terminate_on_nan"]
        assert t["nan"] and t["same"] and t["epochs_tnt"] == t["epochs_ref"] == 1


def test_history_and_user_history_are_global(world):
    for r in world[1]:
        assert r["history"]["same"] and r["history"]["user_history_same"]


def test_lambda_and_user_callbacks_see_serial_logs_on_all_ranks(world):
    for r in world[1]:
        assert r["lambda"]["same"] and r["lambda"]["calls"] == 4
        uc = r["user_callback"]
        assert uc["same_batches"] and uc["same_epochs"] and uc["batches"] == 24
        assert uc["model_types"] == ["tnt.Model"]  # on every rank: saves are collective


def test_wrapped_callback_with_run_on_all_ranks_false_runs_on_master_only(world):
    assert [r["run_on_all_ranks_false"]["batches"] for r in world[1]] == [24, 0]
    # alone on the master, it sees the plain Keras model (whose saves are not collective)
    assert world[1][0]["run_on_all_ranks_false"]["model_types"] == ["Sequential"]


def test_csv_logger_written_by_master_only_with_serial_values(world):
    out = world[0]
    assert (out / "tnt_rank0.csv").exists() and not (out / "tnt_rank1.csv").exists()
    for r in world[1]:
        assert r["csv_logger"]["same"]
    with open(out / "tnt_rank0.csv") as a, open(out / "ref_rank0.csv") as b:
        rows_tnt, rows_ref = list(csv.DictReader(a)), list(csv.DictReader(b))
    assert len(rows_tnt) == len(rows_ref) == 4
    for t, s in zip(rows_tnt, rows_ref, strict=True):
        assert t.keys() == s.keys()
        for k in t:
            if "NA" in (t[k], s[k]):  # Keras's CSVLogger writes NA for absent val_ columns
                assert t[k] == s[k]
                continue
            assert float(t[k]) == pytest.approx(float(s[k]), rel=1e-4, abs=1e-6)


def test_model_checkpoint_written_by_master_only(world):
    out, (r0, r1), _ = world
    assert r0["model_checkpoint"] == {"written": True, "weights_equal_final": True}
    assert r1["model_checkpoint"]["written"] is False
    assert not (out / "tnt_ckpt_rank1.weights.h5").exists()


def test_tensorboard_logs_serial_values_on_master_only_unless_enabled_on_all_devices(world):
    out, (r0, r1), _ = world
    tb = r0["tensorboard"]
    logs = tb["logs"]
    assert set(logs) == {
        f"{top}/{part}"
        for top in ("tb", "tball/rank_0", "tball/rank_1")
        for part in ("train", "validation")
    }
    for where, scalars in logs.items():
        writer = r1 if where.startswith("tball/rank_1") else r0
        assert set(scalars["pids"]) == {writer["tensorboard"]["pid"]}, where
        expected = tb["serial"] if where.endswith("train") else tb["serial_validation"]
        for tag, values in expected.items():
            assert scalars[tag] == pytest.approx(values, rel=1e-4), (where, tag)


def test_verbose_output_printed_by_master_only(world):
    out = world[0]
    assert (out / "stdout_rank1.txt").read_text() == ""
    master = (out / "stdout_rank0.txt").read_text()
    assert "Epoch 1/2" in master and "Epoch 2/2" in master and "val_loss" in master
    assert "6/6" in master and "accuracy" in master


def test_master_rank_uses_the_progress_module_view_instead_of_keras_progbar(world):
    r0, r1 = (r["progress_hook"] for r in world[1])
    assert r1 == []  # other ranks neither ask for a view nor print
    fit, evaluate = r0  # predict with verbose=0 asks for nothing
    assert fit == {
        "mode": "fit",
        "verbose": 1,
        "epochs": 2,
        "steps": 6,
        "batch_size": 16,
        "num_samples": 96,
        "world_size": 2,
        "batches": 12,
    }
    assert evaluate["mode"] == "evaluate" and evaluate["verbose"] == "auto"
    assert evaluate["steps"] == 6 and evaluate["world_size"] == 2


def test_the_guides_model_checkpoint_example_writes_the_master_rank_file(world):
    out, (r0, r1), _ = world
    assert r0["guide_checkpoint"] == {"written": True, "loads_final_weights": True}
    assert r1["guide_checkpoint"]["written"] is False
    assert not (out / "guide_ckpt_rank1.keras").exists()


def test_remote_monitor_posts_each_epoch_once_from_the_master_rank(world, monitor):
    posts = monitor[1]
    assert sorted(posts) == ["/ref/rank0", "/ref/rank1", "/tnt/rank0"]  # not from rank 1
    assert len(posts["/tnt/rank0"]) == 2
    for got, serial in zip(posts["/tnt/rank0"], posts["/ref/rank0"], strict=True):
        assert got.keys() == serial.keys()
        for key, value in serial.items():
            assert got[key] == pytest.approx(value, rel=1e-5)

"""Engine side: the widget-or-text decision, rate limiting and the published payload."""

from __future__ import annotations

import pytest

from tnt_notebook.progress_payload import PROGRESS_MIME, ranks_text
from tnt_notebook.rank import progress_publisher as progress
from tnt_notebook.rank.device import ranks_devices
from tnt_notebook.rank.progress_publisher import ProgressPublisher


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make(mode="fit", verbose=1, **params):
    sent: list[tuple[dict, str, bool]] = []
    clock = Clock()
    pub = ProgressPublisher(
        mode, verbose, publish=lambda b, i, u: sent.append((b, i, u)), clock=clock, **params
    )
    return pub, sent, clock


def test_engines_of_a_tnt_cluster_publish_and_other_processes_leave_it_to_keras(monkeypatch):
    monkeypatch.delenv("TNT_NOTEBOOK_RANK", raising=False)
    assert not progress.publishes_widget(1)
    assert progress.progress_callback("fit", 1, epochs=1) is None
    monkeypatch.setenv("TNT_NOTEBOOK_RANK", "1")
    assert progress.publishes_widget(1)
    assert progress.publishes_widget("auto")
    assert not progress.publishes_widget(0)
    assert progress.progress_callback("fit", 0) is None


def test_bad_mode_and_verbose_are_clear_errors(monkeypatch):
    monkeypatch.setenv("TNT_NOTEBOOK_RANK", "1")
    with pytest.raises(ValueError, match="mode"):
        progress.progress_callback("train", 1)
    with pytest.raises(ValueError, match="verbose"):
        progress.publishes_widget("loud")


def run_epochs(pub, clock, epochs: int, steps: int, step_seconds: float, validation: int = 0):
    """Begin and the epochs of a fit, a simulated clock advancing by ``step_seconds`` a step."""
    pub.begin()
    for epoch in range(epochs):
        pub.epoch_begin(epoch)
        for step in range(steps):
            clock.now += step_seconds
            pub.batch_end(step, {"loss": 1.0})
        if validation:
            pub.validation_begin()
            for _ in range(validation):
                clock.now += step_seconds
                pub.validation_batch_end()
        pub.epoch_end(epoch, {"loss": 1.0, **({"val_loss": 2.0} if validation else {})})


def test_updates_are_rate_limited_and_only_begin_and_end_always_publish():
    pub, sent, clock = make(epochs=20, steps=10, batch_size=10, min_interval=0.2)
    run_epochs(pub, clock, epochs=20, steps=10, step_seconds=0.01)  # 20 epochs of 0.1 s
    pub.end({"loss": 1.0})
    running = [b[PROGRESS_MIME] for b, _, _ in sent if b[PROGRESS_MIME]["status"] == "running"]
    # begin + at most 5 updates per simulated second (2 s) + final, not one per epoch end
    assert 1 + 8 <= len(sent) <= 1 + 11
    assert len(running) == len(sent) - 1
    assert sent[0][2] is False and all(update for _, _, update in sent[1:])
    assert len({i for _, i, _ in sent}) == 1
    # a skipped epoch end still shows: the history travels in every payload
    assert [len(r["history"].get("loss", [])) for r in running] == sorted(
        len(r["history"].get("loss", [])) for r in running
    )
    final = sent[-1][0][PROGRESS_MIME]
    assert final["epochs_done"] == 20 and len(final["history"]["loss"]) == 20


def test_by_default_a_running_call_updates_at_most_once_per_second():
    pub, sent, clock = make(epochs=3, steps=100, batch_size=10)  # the default interval
    run_epochs(pub, clock, epochs=3, steps=100, step_seconds=0.01)  # 3 simulated seconds
    pub.end({"loss": 1.0})
    updates = [b for b, _, _ in sent[1:-1]]  # between begin and end
    assert 2 <= len(updates) <= 3


def test_every_finished_epoch_shows_within_the_interval():
    pub, sent, clock = make(epochs=3, steps=10, batch_size=10, min_interval=0.2)
    run_epochs(pub, clock, epochs=3, steps=10, step_seconds=0.05)  # 0.5 s per epoch
    done = [b[PROGRESS_MIME]["epochs_done"] for b, _, _ in sent]
    assert {1, 2} <= set(done)  # at their ends or in the next epoch's first update
    pub.end()
    assert sent[-1][0][PROGRESS_MIME]["epochs_done"] == 3


def test_a_long_validation_shows_its_phase_within_the_interval():
    pub, sent, clock = make(epochs=1, steps=2, batch_size=10, min_interval=0.2)
    run_epochs(pub, clock, epochs=1, steps=2, step_seconds=0.1, validation=10)
    phases = [b[PROGRESS_MIME]["phase"] for b, _, _ in sent]
    assert phases.count("validate") >= 3  # 1 s of validation, an update every 0.2 s


def test_a_failing_call_flushes_what_the_rate_limit_held_back():
    pub, sent, clock = make(epochs=5, steps=10, batch_size=10, min_interval=10.0)

    class Holder:
        publisher = pub

    with pytest.raises(RuntimeError, match="boom"), progress.flushed_on_error([Holder()]):
        run_epochs(pub, clock, epochs=2, steps=10, step_seconds=0.01)
        raise RuntimeError("boom")
    assert len(sent) == 2  # begin, then the flush
    state = sent[-1][0][PROGRESS_MIME]
    assert state["status"] == "running" and state["epochs_done"] == 2
    assert state["history"] == {"loss": [1.0, 1.0]}


def test_payload_carries_counters_totals_rates_eta_and_history():
    pub, sent, clock = make(epochs=3, steps=4, batch_size=32, num_samples=100, world_size=2)
    pub.begin()
    pub.epoch_begin(0)
    for step in range(4):
        clock.now += 0.5
        pub.batch_end(step, {"loss": 2.0 - step * 0.1, "accuracy": 0.5})
    state = pub.state()
    assert state["step"] == 4 and state["steps"] == 4
    assert state["samples"] == 100  # 32 + 32 + 32 + 4: the last batch is short
    assert state["samples_per_s"] == pytest.approx(100 / 2.0)
    assert state["eta"] == pytest.approx(8 * 0.5)  # 8 steps left at 2 steps/s
    assert state["logs"] == {"loss": pytest.approx(1.7), "accuracy": 0.5}
    pub.validation_begin()
    clock.now += 1.0  # validation time does not count as training time
    pub.epoch_end(0, {"loss": 1.8, "accuracy": 0.6, "val_loss": 1.9, "val_accuracy": 0.55})
    last = sent[-1][0][PROGRESS_MIME]
    assert last["epochs_done"] == 1 and last["epochs"] == 3
    assert last["samples_per_s"] == pytest.approx(50.0)
    assert last["epoch_logs"]["val_loss"] == 1.9
    assert last["history"] == {
        "loss": [1.8],
        "accuracy": [0.6],
        "val_loss": [1.9],
        "val_accuracy": [0.55],
    }
    assert last["world_size"] == 2 and last["batch_size"] == 32
    assert "epoch 1/3" in sent[-1][0]["text/plain"]
    assert "val_loss: 1.9000" in sent[-1][0]["text/plain"]


def test_final_state_is_done_with_eta_zero_and_the_summary_text():
    pub, sent, clock = make("evaluate", steps=None, batch_size=8)
    pub.begin()
    for step in range(3):
        clock.now += 1.0
        pub.batch_end(step, {"loss": 0.5})
    pub.end({"loss": 0.25, "accuracy": 0.75})
    final = sent[-1][0][PROGRESS_MIME]
    assert final["status"] == "done" and final["eta"] == 0.0
    assert final["steps"] == 3  # an unknown total becomes the count at the end
    assert final["logs"] == {"loss": 0.25, "accuracy": 0.75}
    assert final["epoch"] is None and final["epochs"] is None
    assert sent[-1][0]["text/plain"].startswith("evaluate done | step 3/3 | loss: 0.2500")


def test_verbose_2_publishes_only_begin_epoch_ends_and_end():
    pub, sent, clock = make(verbose=2, epochs=2, steps=50, batch_size=1, min_interval=0.0)
    run_epochs(pub, clock, epochs=2, steps=50, step_seconds=1.0)
    pub.end()
    assert len(sent) == 4


def test_sample_counts_follow_the_data_when_steps_exceed_one_pass():
    pub, _, clock = make(epochs=1, steps=7, batch_size=32, num_samples=100)
    pub.begin()
    pub.epoch_begin(0)
    for step in range(7):  # 4 batches per pass: 32, 32, 32, 4, then 32, 32, 32
        pub.batch_end(step)
    assert pub.state()["samples"] == 100 + 96


def test_slow_publishing_stretches_the_interval_to_keep_the_overhead_bounded():
    """A publish that costs 10 ms with a 1 % budget allows one batch update per second."""
    import time

    sent = []
    clock = Clock()

    def slow_publish(bundle, display_id, update):
        sent.append(bundle)
        time.sleep(0.01)

    pub = ProgressPublisher("fit", 1, epochs=1, steps=1000, min_interval=0.2,
                            max_overhead=0.01, publish=slow_publish, clock=clock)  # fmt: skip
    pub.begin()
    pub.epoch_begin(0)
    for step in range(1000):
        clock.now += 0.01  # 10 simulated seconds
        pub.batch_end(step)
    assert 1 + 5 <= len(sent) <= 1 + 11  # not the 50 that min_interval alone would allow


def test_counts_follow_the_steps_keras_reports_and_start_at_the_initial_epoch():
    # steps_per_execution=4: Keras reports every 4th step; fit(initial_epoch=2, epochs=4)
    pub, _, clock = make(epochs=4, steps=8, batch_size=10, num_samples=80)
    pub.begin()
    for epoch in (2, 3):
        pub.epoch_begin(epoch)
        for batch in (3, 7):
            clock.now += 1.0
            pub.batch_end(batch)
        if epoch == 2:
            state = pub.state()
            assert (state["step"], state["samples"], state["epochs_done"]) == (8, 80, 2)
            assert state["steps_per_s"] == 4.0 and state["eta"] == pytest.approx(8 / 4.0)
            pub.epoch_end(epoch, {"loss": 1.0})
            assert pub.state()["eta"] == pytest.approx(8 / 4.0)
    state = pub.state()
    assert (state["step"], state["samples"], state["epoch"]) == (8, 160, 4)
    assert state["eta"] == 0


def test_the_summary_names_the_devices_the_ranks_train_on_as_the_rank_sees_them(tmp_path):
    listing = tmp_path / "gpus.txt"  # a recorded `nvidia-smi -L`, as on a node of mixed GPUs
    listing.write_text(
        "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)\nGPU 1: NVIDIA A100-SXM4-40GB (UUID: GPU-1)\n"
    )
    per_rank = {"TNT_GPU_PER_RANK": "1", "TNT_GPU_INVENTORY": str(listing)}

    def summary(world: int, **environ: str) -> str:
        return ranks_text(world, ranks_devices(environ))

    assert summary(2, CUDA_VISIBLE_DEVICES="") == "2 ranks on CPU"  # the launch rules' CPU
    assert summary(1, CUDA_VISIBLE_DEVICES="") == "1 rank on CPU"
    assert summary(4, **per_rank, CUDA_VISIBLE_DEVICES="1") == (
        "4 ranks, one GPU each (NVIDIA A100-SXM4-40GB)"  # the GPU the rank kept, by index
    )
    assert summary(4, **per_rank, CUDA_VISIBLE_DEVICES="GPU-0") == (
        "4 ranks, one GPU each (NVIDIA H100 80GB HBM3)"  # or by UUID
    )
    unnamed = {**per_rank, "TNT_GPU_INVENTORY": str(tmp_path / "missing.txt")}
    assert summary(2, **unnamed, CUDA_VISIBLE_DEVICES="0") == "2 ranks, one GPU each"
    assert summary(2) == "2 ranks, every GPU visible to each"  # not started by the launch rules
    assert summary(2, CUDA_VISIBLE_DEVICES="2,3") == "2 ranks, GPU 2,3 visible to each"


def test_the_published_payload_carries_the_devices(monkeypatch):
    pub, sent, _ = make(world_size=2, devices="one GPU each (NVIDIA H100 80GB HBM3)")
    pub.begin()
    assert sent[-1][0][PROGRESS_MIME]["devices"] == "one GPU each (NVIDIA H100 80GB HBM3)"
    monkeypatch.setenv("TNT_NOTEBOOK_RANK", "1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("TNT_GPU_PER_RANK", raising=False)
    callback = progress.progress_callback("fit", 1, world_size=2)
    assert callback._params["devices"] == "CPU"  # as this rank's environment tells

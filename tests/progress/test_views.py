"""Notebook side: widget and text views built from real payload sequences (no browser)."""

from __future__ import annotations

import ipywidgets
import pytest

from tnt_notebook.notebook.progress_views import (
    GREEN,
    RED,
    ProgressDisplays,
    TextProgressView,
    WidgetProgressView,
    chart_svg,
    default_view_class,
    summary_html,
    summary_text,
)
from tnt_notebook.progress_payload import PROGRESS_MIME
from tnt_notebook.rank.progress_publisher import ProgressPublisher

WIDGET_MIME = "application/vnd.jupyter.widget-view+json"


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def fit_messages(epochs=3, steps=5, fail_after_epoch=None):
    """The display messages a master rank publishes for a fit (what remote.py hands over)."""
    sent = []
    clock = Clock()
    pub = ProgressPublisher(
        "fit",
        1,
        epochs=epochs,
        steps=steps,
        batch_size=16,
        world_size=2,
        devices="CPU",
        min_interval=0.0,
        max_overhead=0,
        publish=lambda b, i, u: sent.append((b, i, u)),
        clock=clock,
    )
    pub.begin()
    for epoch in range(epochs):
        pub.epoch_begin(epoch)
        for step in range(steps):
            clock.now += 0.1
            pub.batch_end(step, {"loss": 1.0 / (1 + epoch + step), "accuracy": 0.5})
        if fail_after_epoch == epoch:
            return sent
        pub.validation_begin()
        pub.epoch_end(
            epoch,
            {
                "loss": 1.0 / (1 + epoch),
                "accuracy": 0.5 + epoch / 10,
                "val_loss": 1.2 / (1 + epoch),
                "val_accuracy": 0.4,
            },
        )
    pub.end()
    return sent


def recording(cls):
    class Recording(cls):
        published: list = []
        publish = staticmethod(lambda b, i, u: Recording.published.append((b, i, u)))

    Recording.published = []
    return Recording


def feed(displays, messages):
    return [displays.handle(b, {}, i, u) for b, i, u in messages]


def test_a_successful_fit_shows_live_values_then_a_green_static_summary():
    view_class = recording(WidgetProgressView)
    displays = ProgressDisplays(view_class=view_class)
    assert all(feed(displays, fit_messages()))
    (view,) = displays.views.values()
    w = view.widgets
    assert view.finished and view.state["status"] == "done"
    # the live view as the last update before the end left it: every epoch done
    assert (w["epoch_bar"].value, w["epoch_bar"].max) == (3, 3)
    assert (w["step_bar"].value, w["step_bar"].max) == (5, 5)
    assert (w["epoch_bar"].description, w["step_bar"].description) == ("Epoch 3/3", "Step 5/5")
    assert "val_loss <b>0.4000</b>" in w["metrics"].value
    assert "samples/s" in w["metrics"].value
    assert "running" in w["header"].value and "2 ranks on CPU" in w["header"].value
    assert w["chart"].value.startswith('<img class="tnt-progress-chart"')
    assert isinstance(view.box, ipywidgets.VBox) and "tnt-progress" in view.box._dom_classes
    first, *_, last = view_class.published
    assert WIDGET_MIME in first[0] and first[0][WIDGET_MIME]["model_id"] == view.box.model_id
    assert first[2] is False
    # the final output replaces the widget by a static summary that survives in a saved notebook
    assert last[2] is True and last[1] == first[1] and WIDGET_MIME not in last[0]
    summary = last[0]["text/html"]
    assert 'data-status="done"' in summary and f"solid {GREEN}" in summary
    assert "<span>3/3</span>" in summary and "<span>5/5</span>" in summary
    assert "val_loss <b>0.4000</b>" in summary and "2 ranks on CPU" in summary
    assert last[0]["text/plain"].splitlines()[0].startswith("fit done | epoch 3/3 | step 5/5")
    assert len(last[0]["text/plain"].splitlines()) == 2 + 3  # status, header, one row per epoch


def test_a_cell_that_fails_mid_fit_turns_the_view_red_with_the_error():
    view_class = recording(WidgetProgressView)
    displays = ProgressDisplays(view_class=view_class)
    feed(displays, fit_messages(fail_after_epoch=1))
    (view,) = displays.views.values()
    assert not view.finished and view.widgets["step_bar"].bar_style == ""
    displays.end_of_cell("ValueError: boom (rank 1)")
    assert view.finished and view.state["status"] == "failed"
    final = view_class.published[-1][0]
    assert 'data-status="failed"' in final["text/html"] and f"solid {RED}" in final["text/html"]
    assert "ValueError: boom (rank 1)" in final["text/html"]
    assert "<span>1/3</span>" in final["text/html"]  # the second epoch never finished
    assert "fit failed" in final["text/plain"] and "error: ValueError: boom" in final["text/plain"]


def test_a_cell_that_ends_without_error_closes_unfinished_views_as_stopped():
    view_class = recording(WidgetProgressView)
    displays = ProgressDisplays(view_class=view_class)
    feed(displays, fit_messages(fail_after_epoch=0))
    displays.end_of_cell(None)
    (view,) = displays.views.values()
    assert view.state["status"] == "stopped"
    assert 'data-status="stopped"' in view_class.published[-1][0]["text/html"]


def test_finished_views_are_not_touched_by_later_cells():
    displays = ProgressDisplays(view_class=recording(WidgetProgressView))
    feed(displays, fit_messages())
    displays.end_of_cell("KeyboardInterrupt")
    (view,) = displays.views.values()
    assert view.state["status"] == "done"


def test_one_view_per_call_and_foreign_display_data_is_not_consumed():
    displays = ProgressDisplays(view_class=recording(TextProgressView))
    feed(displays, fit_messages())
    feed(displays, fit_messages(epochs=1))
    assert len(displays.views) == 2
    assert not displays.handle({"text/plain": "hello"}, {}, None, False)
    assert not displays.handle({PROGRESS_MIME: {"version": 99}}, {}, "x", False)


def test_the_text_view_updates_one_line_in_place_and_ends_with_the_summary():
    view_class = recording(TextProgressView)
    displays = ProgressDisplays(view_class=view_class)
    feed(displays, fit_messages(epochs=2, steps=3))
    (view,) = displays.views.values()
    ids = {i for _, i, _ in view_class.published}
    assert len(ids) == 1
    assert all(set(b) == {"text/plain"} for b, _, _ in view_class.published[:-1])
    assert "step 2/3" in view_class.published[2][0]["text/plain"]
    summary = view_class.published[-1][0]["text/plain"]  # what the frontend last received
    assert summary.startswith("fit done | epoch 2/2 | step 3/3 | loss: 0.5000")
    assert "val_loss" in summary.splitlines()[1]


def test_evaluate_and_predict_views_show_batches_without_epochs():
    sent = []
    pub = ProgressPublisher(
        "predict", 1, steps=4, batch_size=8, publish=lambda b, i, u: sent.append((b, i, u))
    )
    pub.begin()
    for step in range(4):
        pub.batch_end(step)
    pub.end()
    displays = ProgressDisplays(view_class=recording(WidgetProgressView))
    feed(displays, sent)
    (view,) = displays.views.values()
    assert view.widgets["epoch_bar"].layout.display == "none"
    assert view.widgets["step_bar"].description == "Batch 0/4"  # then the summary replaced it
    assert "Epoch" not in summary_html(view.state)
    assert ">Batch</span>" in summary_html(view.state)
    assert "<span>4/4</span>" in summary_html(view.state)


def test_chart_draws_loss_and_val_loss_per_epoch():
    assert chart_svg({}) is None
    svg = chart_svg({"loss": [1.0, 0.5, 0.25], "val_loss": [1.1, 0.6, 0.4], "accuracy": [0.1]})
    assert svg.count("<polyline") == 2 and svg.count("<circle") == 6
    assert ">loss<" in svg and ">val_loss<" in svg


def test_summary_text_lists_every_epoch():
    state = {
        "mode": "fit",
        "status": "done",
        "epochs": 2,
        "epochs_done": 2,
        "step": 4,
        "steps": 4,
        "logs": {},
        "epoch_logs": {"loss": 0.5},
        "elapsed": 65.0,
        "history": {"loss": [0.75, 0.5]},
    }
    text = summary_text(state)
    assert text.splitlines() == [
        "fit done | epoch 2/2 | step 4/4 | loss: 0.5000 | 01:05 total",
        "epoch        loss",
        "1          0.7500",
        "2          0.5000",
    ]


def test_default_view_is_the_widget_unless_text_is_requested(monkeypatch):
    monkeypatch.delenv("TNT_PROGRESS_VIEW", raising=False)
    assert default_view_class() is WidgetProgressView
    monkeypatch.setenv("TNT_PROGRESS_VIEW", "text")
    assert default_view_class() is TextProgressView


@pytest.mark.parametrize("value", [float("nan"), -1.0, None])
def test_unknown_durations_render_as_question_marks(value):
    from tnt_notebook.progress_payload import format_duration

    assert format_duration(value) == "?"


def test_a_nan_loss_is_shown_as_nan_and_left_out_of_the_chart():
    sent = []
    pub = ProgressPublisher("fit", 1, epochs=2, steps=1, publish=lambda b, i, u: sent.append(b))
    pub.begin()
    pub.epoch_begin(0)
    pub.batch_end(0, {"loss": 0.5})
    pub.epoch_end(0, {"loss": 0.5})
    pub.epoch_begin(1)
    pub.batch_end(0, {"loss": float("nan")})
    pub.epoch_end(1, {"loss": float("nan")})
    pub.end()
    import json

    state = json.loads(json.dumps(sent[-1][PROGRESS_MIME], allow_nan=False))  # strict JSON
    assert state["history"]["loss"] == [0.5, "nan"]
    assert "loss: nan" in sent[-1]["text/plain"]
    assert chart_svg(state["history"]).count("<circle") == 1


def test_a_failed_fit_reports_the_latest_training_values_beside_the_last_validation():
    displays = ProgressDisplays(view_class=recording(TextProgressView))
    feed(displays, fit_messages(epochs=3, steps=5, fail_after_epoch=1))
    displays.end_of_cell("boom")
    (view,) = displays.views.values()
    first = view.text.splitlines()[0]
    assert first.startswith("fit failed | epoch 1/3 | step 5/5 | loss: 0.1667 - ")
    assert "val_loss: 1.2000" in first and first.endswith("error: boom")

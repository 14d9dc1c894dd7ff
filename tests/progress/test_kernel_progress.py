"""The progress display produced by real %%tnt fits in a real kernel on a real 2-rank cluster.

The widget state is rebuilt from the comm messages the notebook kernel sends on iopub (what a
browser receives), so these tests see exactly what a frontend would render.
"""

from __future__ import annotations

import json

import psutil
import pytest

from tests.support.mpiworld import run_mpi
from tnt_notebook.bench.progress import WIDGET_MIME, KernelSession
from tnt_notebook.progress_payload import format_value, ordered

pytestmark = [pytest.mark.notebook, pytest.mark.mpi]

ENV = {
    "TF_CPP_MIN_LOG_LEVEL": "2",
    "TF_NUM_INTRAOP_THREADS": "1",
    "TF_NUM_INTEROP_THREADS": "1",
    "OMP_NUM_THREADS": "1",
}

SETUP = """%%tnt
import json
import numpy as np
import keras
import tnt_notebook as tnt

rng = np.random.default_rng(0)
x = rng.normal(size=(200, 8)).astype("float32")
y = (x.sum(axis=1) > 0).astype("int32")

def new_model():
    keras.utils.set_random_seed(1)
    dense = keras.layers.Dense(2, activation="softmax")
    m = tnt.Model(keras.Sequential([keras.Input((8,)), dense]))
    m.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"])
    return m

class Boom(keras.callbacks.Callback):
    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            raise RuntimeError("boom at the end of epoch 2")
"""


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    s = KernelSession(cwd=str(tmp_path_factory.mktemp("nb")), env=ENV)
    kernel = psutil.Process(s.km.provisioner.process.pid)
    try:
        for code in ("%load_ext tnt_notebook", "%tnt_cluster -n 2", SETUP):
            cell = s.execute(code, timeout=240)
            assert cell.status == "ok", cell.reply["content"]
        yield s
    finally:
        procs = kernel.children(recursive=True)
        try:
            s.execute("%tnt_cluster stop", timeout=60)
        finally:
            s.close()
        _, alive = psutil.wait_procs(procs, timeout=20)
        for p in alive:
            p.kill()
        assert not alive, f"processes outlived the kernel: {alive}"


def pull(session, expr: str):
    """The master rank's value of `expr`, through %tnt_pull (not through captured stdout)."""
    assert session.execute(f"%%tnt\n_pulled = {expr}").status == "ok"
    assert session.execute("%tnt_pull _pulled").status == "ok"
    return json.loads(session.execute("import json; print(json.dumps(_pulled))").stdout)


def widget_views(cell) -> list[str]:
    """Model ids of the widget views the cell displayed."""
    return [d["data"][WIDGET_MIME]["model_id"] for d in cell.displays("display_data")
            if WIDGET_MIME in d["data"]]  # fmt: skip


def final_output(cell, view_display: dict) -> dict:
    """The last update of a view's display: the static summary that a saved notebook keeps."""
    display_id = view_display["transient"]["display_id"]
    updates = [d for d in cell.displays("update_display_data")
               if d["transient"]["display_id"] == display_id]  # fmt: skip
    return updates[-1]["data"]


def parts(session, model_id: str) -> dict:
    """The progress view's widgets by role, from the rebuilt widget tree."""
    box = session.widget_tree(model_id)
    header, epoch_bar, step_bar, metrics, chart = box["children"]
    return {
        "box": box,
        "header": header["value"],
        "epoch_bar": epoch_bar,
        "epoch_count": epoch_bar["description"].split()[-1],  # "Epoch 3/3"
        "step_bar": step_bar,
        "step_count": step_bar["description"].split()[-1],
        "metrics": metrics["value"],
        "chart": chart["value"],
    }


def test_a_tnt_fit_shows_one_live_widget_that_ends_green_with_the_final_values(session):
    cell = session.execute(
        "%%tnt\nmodel = new_model()\n"
        "history = model.fit(x[:160], y[:160], batch_size=32, epochs=3,"
        " validation_data=(x[160:], y[160:]))",
        timeout=240,
    )
    assert cell.status == "ok", cell.reply["content"]
    assert "Epoch 1/3" not in cell.stdout  # Keras's text progbar is replaced
    (model_id,) = widget_views(cell)
    w = parts(session, model_id)  # the live view, as its last update left it
    assert "tnt-progress" in w["box"]["_dom_classes"]
    assert w["epoch_bar"]["max"] == 3 and w["step_bar"]["max"] == 5
    assert "2 ranks on CPU" in w["header"] and "global batch 32" in w["header"]  # (no GPU here)

    # the static summary that replaced it: final values, green
    history = pull(session, "history.history")
    view_display = next(d for d in cell.displays("display_data") if WIDGET_MIME in d["data"])
    final = final_output(cell, view_display)
    summary = final["text/html"]
    assert WIDGET_MIME not in final and 'data-status="done"' in summary
    assert "<span>3/3</span>" in summary and "<span>5/5</span>" in summary
    assert "done" in summary and "2 ranks on CPU" in summary and "global batch 32" in summary
    for name in ("loss", "accuracy", "val_loss", "val_accuracy"):
        assert f"{name} <b>{format_value(history[name][-1])}</b>" in summary
    assert "samples/s" in summary and '<img class="tnt-progress-chart"' in summary
    lines = final["text/plain"].splitlines()
    assert lines[0].startswith("fit done | epoch 3/3 | step 5/5 | loss: ")
    assert len(lines) == 2 + 3
    for epoch, line in enumerate(lines[2:]):
        assert line.split()[1:] == [format_value(history[k][epoch]) for k in ordered(history)]


def test_evaluate_and_predict_each_show_their_own_display(session):
    cell = session.execute(
        "%%tnt\nresult = model.evaluate(x, y, batch_size=50, return_dict=True)\n"
        "pred = model.predict(x, batch_size=64)",
        timeout=240,
    )
    assert cell.status == "ok", cell.reply["content"]
    shown = [d for d in cell.displays("display_data") if WIDGET_MIME in d["data"]]
    evaluate, predict = (final_output(cell, d)["text/html"] for d in shown)
    result = pull(session, "result")
    assert "evaluate</b> done" in evaluate and "<span>4/4</span>" in evaluate
    assert f"loss <b>{format_value(result['loss'])}</b>" in evaluate
    assert "predict</b> done" in predict and "<span>4/4</span>" in predict
    for model_id in widget_views(cell):
        w = parts(session, model_id)
        assert w["step_bar"]["description"].startswith("Batch ")
        assert w["epoch_bar"]["layout"]["display"] == "none"  # shown in fits only


def test_a_fit_that_raises_turns_the_widget_red_with_the_error(session):
    cell = session.execute(
        "%%tnt\nmodel = new_model()\nmodel.fit(x, y, batch_size=40, epochs=4, callbacks=[Boom()])",
        timeout=240,
    )
    assert cell.status == "error"
    (model_id,) = widget_views(cell)
    w = parts(session, model_id)
    # the failing fit flushed what the rate limit held back: one epoch done, the second running
    assert w["epoch_bar"]["value"] == 1 and w["epoch_count"] == "2/4"
    view_display = next(d for d in cell.displays("display_data") if WIDGET_MIME in d["data"])
    final = final_output(cell, view_display)
    summary = final["text/html"]
    assert 'data-status="failed"' in summary and "boom at the end of epoch 2" in summary
    assert "<span>1/4</span>" in summary  # the second epoch never finished
    assert final["text/plain"].startswith("fit failed | epoch 1/4")


def test_a_fit_failing_on_the_master_only_ends_at_once_and_the_world_survives(session):
    # rank 1 waits in the step's allreduce inside the TensorFlow op, where no SIGINT reaches it:
    # without the master's abort the cell would end only when the world is stopped after 10 s
    cell = session.execute(
        "%%tnt\nimport time\nmodel = new_model()\n"
        "class MasterOnlyBoom(keras.callbacks.Callback):\n"
        "    def on_epoch_end(self, epoch, logs=None):\n"
        "        if tnt.is_master_rank() and epoch == 1:\n"
        "            time.sleep(1)  # rank 1 waits in the next step's allreduce meanwhile\n"
        "            raise RuntimeError('checkpoint disk full')\n"
        "model.fit(x, y, batch_size=40, epochs=4, callbacks=[MasterOnlyBoom()])",
        timeout=240,
    )
    assert cell.status == "error"
    error = cell.reply["content"]["evalue"]
    assert "[rank 0] RuntimeError: checkpoint disk full" in error, error
    assert "rank(s) 1 had their collectives aborted" in error, error
    assert "stopped" not in error, error
    after = session.execute("%%tnt\nprint(tnt.allreduce(np.ones(2)).tolist())")
    assert after.status == "ok" and "[2.0, 2.0]" in after.stdout, after.reply["content"]


def test_the_timeline_magic_records_a_fit_and_shows_its_plot_and_table(session):
    on = session.execute("%tnt_timeline on --steps 3")
    assert on.status == "ok" and "timeline on: each fit records steps 2-4" in on.stdout
    try:
        fit = session.execute("%%tnt\n_ = new_model().fit(x, y, batch_size=40, verbose=0)")
        assert fit.status == "ok", fit.reply["content"]
    finally:
        assert session.execute("%tnt_timeline off").stdout == "timeline off\n"
    shown = session.execute("%tnt_timeline show")
    assert shown.status == "ok", shown.reply["content"]
    plot, table = (d["data"] for d in shown.displays("display_data"))
    svg = plot["image/svg+xml"]  # the plot, an image that a saved notebook keeps
    assert svg.startswith("<svg") and "rank 0" in svg and "rank 1" in svg
    assert "exposed comm." in table["text/html"] and table["text/html"].count("<tr>") == 1 + 2
    assert session.execute("%tnt_timeline show").status == "ok"  # (off: the last fit's, again)


def test_verbose_0_shows_no_progress(session):
    cell = session.execute("%%tnt\n_ = new_model().fit(x, y, batch_size=40, epochs=2, verbose=0)")
    assert cell.status == "ok", cell.reply["content"]
    assert cell.displays() == [] and cell.stdout == ""


def test_text_view_for_frontends_without_widgets(session):
    session.execute("import os; os.environ['TNT_PROGRESS_VIEW'] = 'text'")
    try:
        cell = session.execute("%%tnt\n_ = new_model().fit(x, y, batch_size=40, epochs=2)", 240)
    finally:
        session.execute("del os.environ['TNT_PROGRESS_VIEW']")
    assert cell.status == "ok", cell.reply["content"]
    displays = cell.displays()
    assert displays and all(WIDGET_MIME not in d["data"] for d in displays)
    assert len({d["transient"]["display_id"] for d in displays}) == 1
    assert displays[0]["data"]["text/plain"].startswith("fit | epoch 1/2 | step 0/5")
    final = displays[-1]["data"]["text/plain"].splitlines()
    assert final[0].startswith("fit done | epoch 2/2 | step 5/5 | loss: ")
    assert final[1].split() == ["epoch", "loss", "accuracy"]  # loss first


def test_with_output_on_all_devices_other_ranks_print_text_beside_the_one_widget(session):
    assert session.execute("%tnt_cluster stop", timeout=120).status == "ok"
    cell = session.execute("%tnt_cluster -n 2 --output-on-all-devices", timeout=240)
    assert cell.status == "ok", cell.reply["content"]
    assert session.execute(SETUP, timeout=240).status == "ok"
    cell = session.execute("%%tnt\n_ = new_model().fit(x, y, batch_size=40, epochs=2)", 240)
    assert cell.status == "ok", cell.reply["content"]
    assert len(widget_views(cell)) == 1
    assert "[stdout:1]" in cell.stdout and "Epoch 2/2" in cell.stdout
    assert "[stdout:0]" not in cell.stdout  # the master rank's progress is the widget


@pytest.mark.mpi
def test_scripts_under_mpiexec_print_keras_text_progress_on_the_master_rank_only():
    code = """
    import os
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    import numpy as np, keras, tnt_notebook as tnt
    x = np.random.default_rng(0).normal(size=(64, 4)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")
    keras.utils.set_random_seed(0)
    dense = keras.layers.Dense(2, activation="softmax")
    m = tnt.Model(keras.Sequential([keras.Input((4,)), dense]))
    m.compile("sgd", "sparse_categorical_crossentropy")
    m.fit(x, y, batch_size=16, epochs=2, verbose=2)
    print("finished", flush=True)
    """
    out = run_mpi(2, code, env=ENV, mpi_args=("-prepend-rank",), timeout=180).stdout
    epoch_lines = [line for line in out.splitlines() if "Epoch " in line]
    assert [line.split("]", 1)[0] for line in epoch_lines] == ["[0", "[0"]
    assert sum("loss:" in line for line in out.splitlines() if line.startswith("[0]")) == 2
    assert not any("loss:" in line for line in out.splitlines() if line.startswith("[1]"))
    assert out.count("finished") == 2

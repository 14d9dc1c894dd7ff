"""End to end: JupyterLab on loopback, headless Chromium runs 01_quickstart.ipynb.

Checks that the live progress widget was rendered while ``fit`` ran and that the cell ends with
the final progress summary (final values), and that the timeline's plot renders (two cells are
added to the quickstart's copy: ``%tnt_timeline on`` after the cluster starts, ``%tnt_timeline
show`` before it stops), and saves screenshots to test-artifacts/.
"""

from __future__ import annotations

import io
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "01_quickstart.ipynb"
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = os.environ.get("TNT_CHROMIUM", "/usr/bin/chromium")
RUN_DEADLINE = 420  # seconds for Run All (the notebook takes ~1 min on 2 busy cores)

pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(
        not Path(CHROMIUM).exists(),
        reason=f"Chromium not found at {CHROMIUM} (apt-get install chromium; set TNT_CHROMIUM)",
    ),
]

# Records, from the first page script on, whether the live widget view appeared and what its
# counters showed, so a fast fit cannot slip between two polls.
OBSERVER = """
window.__tnt = {widgetSeen: false, widgetTexts: []};
new MutationObserver(() => {
  for (const box of document.querySelectorAll('.jupyter-widgets.tnt-progress')) {
    window.__tnt.widgetSeen = true;
    const text = box.innerText;
    if (window.__tnt.widgetTexts.at(-1) !== text) window.__tnt.widgetTexts.push(text);
    if (window.__tnt.widgetTexts.length > 50) window.__tnt.widgetTexts.splice(1, 1);
  }
}).observe(document, {subtree: true, childList: true, characterData: true, attributes: true});
"""


TIMELINE_CELLS = {  # what the cell after which each is added to the quickstart's copy contains
    "%tnt_cluster -n 2": "%tnt_timeline on --steps 4",
    "for name, times in": "%tnt_timeline show",  # (the last fit's timings printed)
}


def with_timeline_cells(notebook: Path, out: Path) -> None:
    """The notebook with the timeline's cells added (TIMELINE_CELLS)."""
    nb = json.loads(notebook.read_text())
    cells = []
    for cell in nb["cells"]:
        cells.append(cell)
        source = "".join(cell["source"])
        code_cell = cell["cell_type"] == "code"
        added = [code for after, code in TIMELINE_CELLS.items() if code_cell and after in source]
        for code in added:
            cells.append({"cell_type": "code", "execution_count": None, "id": secrets.token_hex(4),
                          "metadata": {}, "outputs": [], "source": code})  # fmt: skip
    assert len(cells) == len(nb["cells"]) + len(TIMELINE_CELLS), "a timeline cell found no place"
    out.write_text(json.dumps({**nb, "cells": cells}))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.load(response)


@pytest.fixture
def jupyterlab(tmp_path):
    """JupyterLab of this venv on 127.0.0.1:<free port> with a token, root = a temp dir."""
    root = tmp_path / "root"
    root.mkdir()
    with_timeline_cells(NOTEBOOK, root / NOTEBOOK.name)
    settings = tmp_path / "config" / "lab" / "user-settings" / "@jupyterlab"
    (settings / "apputils-extension").mkdir(parents=True)
    (settings / "apputils-extension" / "notification.jupyterlab-settings").write_text(
        '{"fetchNews": "false"}'
    )
    # Every cell attached and rendered: by default cells scrolled out of view render nothing, and
    # their prompts and outputs read as empty.
    (settings / "notebook-extension").mkdir()
    (settings / "notebook-extension" / "tracker.jupyterlab-settings").write_text(
        '{"windowingMode": "none"}'
    )
    port, token = free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_DATA_DIR": str(tmp_path / "data"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "IPYTHONDIR": str(tmp_path / "ipython"),
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONUNBUFFERED": "1",
    }
    cmd = [
        sys.executable, "-m", "jupyterlab",
        "--no-browser",
        "--allow-root",
        "--ServerApp.ip=127.0.0.1",
        f"--ServerApp.port={port}",
        "--ServerApp.port_retries=0",
        f"--IdentityProvider.token={token}",
        f"--ServerApp.root_dir={root}",
        "--LabApp.news_url=",
        "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
    ]  # fmt: skip
    log = open(tmp_path / "jupyterlab.log", "w")  # noqa: SIM115
    server = subprocess.Popen(
        cmd, cwd=root, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        if server.poll() is not None:
            pytest.fail(f"JupyterLab exited {server.returncode}:\n{_tail(tmp_path)}")
        try:
            get_json(f"{base}/api/status?token={token}")
            break
        except OSError:
            if time.monotonic() > deadline:
                _stop(server)
                pytest.fail(f"JupyterLab did not answer within 90 s:\n{_tail(tmp_path)}")
            time.sleep(0.25)
    server_proc = psutil.Process(server.pid)
    try:
        yield {"base": base, "token": token, "root": root, "server": server_proc, "tmp": tmp_path}
    finally:
        children = server_proc.children(recursive=True)
        _stop(server)
        log.close()
        gone, alive = psutil.wait_procs(children, timeout=20)
        for proc in alive:
            proc.kill()
        assert not alive, f"processes outlived JupyterLab: {alive}"


def _stop(server: subprocess.Popen) -> None:
    """SIGTERM JupyterLab (it shuts its kernels down), then SIGKILL its group after a grace."""
    if server.poll() is None:
        server.send_signal(signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=10)


def _tail(tmp_path: Path, limit: int = 4000) -> str:
    return (tmp_path / "jupyterlab.log").read_text(errors="replace")[-limit:]


def colours(png: bytes) -> int:
    """How many colours a screenshot shows (1: blank)."""
    from PIL import Image

    return len(Image.open(io.BytesIO(png)).convert("RGB").getcolors(maxcolors=1 << 16) or [0] * 9)


def accept_kernel_dialog(page, wait_ms: int = 5000) -> None:
    """Lab may ask which kernel to start; take the notebook's own (python3 of this venv)."""
    dialog = page.locator(".jp-Dialog:has-text('Select Kernel')")
    try:
        dialog.wait_for(timeout=wait_ms)
    except Exception:  # no dialog: the kernel started by itself
        return
    dialog.locator(".jp-Dialog-button.jp-mod-accept").click()
    dialog.wait_for(state="detached", timeout=30_000)


def test_quickstart_runs_in_jupyterlab_and_shows_the_final_progress(jupyterlab):
    from playwright.sync_api import sync_playwright

    base, token = jupyterlab["base"], jupyterlab["token"]
    specs = get_json(f"{base}/api/kernelspecs?token={token}")
    python3 = specs["kernelspecs"]["python3"]["spec"]["argv"][0]
    # the kernel the browser gets is this venv's Python ("python" = the server's own Python)
    assert python3 in ("python", sys.executable)
    assert Path(jupyterlab["server"].exe()).resolve() == Path(sys.executable).resolve()
    settings_url = f"{base}/lab/api/settings/@jupyterlab/notebook-extension:tracker"
    tracker = get_json(f"{settings_url}?token={token}")
    assert tracker["settings"]["windowingMode"] == "none", tracker["settings"]
    ARTIFACTS.mkdir(exist_ok=True)

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000})
            page.add_init_script(OBSERVER)
            page.goto(f"{base}/lab/tree/{NOTEBOOK.name}?token={token}", timeout=120_000)
            page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=120_000)
            page.wait_for_selector(
                ".jp-Notebook-ExecutionIndicator[data-status='idle']", timeout=120_000
            )
            accept_kernel_dialog(page)
            page.click(".lm-MenuBar-itemLabel:text-is('Run')")
            page.click(".lm-Menu-itemLabel:text-is('Run All Cells')")
            deadline = time.monotonic() + RUN_DEADLINE
            shot_live = False
            while True:
                prompts = page.locator(".jp-CodeCell .jp-InputPrompt").all_text_contents()
                done = prompts and all(p.strip() not in ("[*]:", "[ ]:", "") for p in prompts)
                if done:
                    break
                live = page.locator(".jupyter-widgets.tnt-progress:has-text('samples/s')")
                if not shot_live and live.count():  # a live view with its first metrics
                    widget = live.first
                    widget.scroll_into_view_if_needed()
                    widget.screenshot(path=str(ARTIFACTS / "browser_quickstart_live.png"))
                    shot_live = True
                if time.monotonic() > deadline:
                    page.screenshot(path=str(ARTIFACTS / "browser_quickstart_timeout.png"))
                    pytest.fail(f"Run All did not finish within {RUN_DEADLINE} s: {prompts}")
                page.wait_for_timeout(500)

            errors = page.locator(
                ".jp-OutputArea-output[data-mime-type='application/vnd.jupyter.stderr']"
            )
            texts = errors.all_text_contents()
            error_texts = [t for t in texts if "Traceback" in t or "Error" in t]
            assert not error_texts, error_texts
            observed = page.evaluate("window.__tnt")
            assert observed["widgetSeen"], "the live progress widget was never rendered"
            assert any("Epoch" in t for t in observed["widgetTexts"])

            summary = page.locator(".tnt-progress-summary")
            assert summary.count() >= 1
            final = summary.first
            final.scroll_into_view_if_needed()
            final.screenshot(path=str(ARTIFACTS / "browser_quickstart_final.png"))
            page.screenshot(path=str(ARTIFACTS / "browser_quickstart.png"), full_page=False)
            text = final.inner_text()
            assert final.get_attribute("data-status") == "done"
            assert "fit done" in text and "2 ranks" in text and "global batch 64" in text
            assert "10/10" in text  # epochs
            assert "22/22" in text  # steps per epoch: ceil(1347 / 64)
            assert "val_loss" in text and "val_accuracy" in text and "samples/s" in text
            assert final.locator("table.tnt-progress-history tr").count() == 1 + 10
            assert final.locator("img.tnt-progress-chart").count() == 1

            # %tnt_timeline show: the plot of the last fit's ranks, an SVG image under the cell
            plot = page.locator(".jp-RenderedSVG img").first
            plot.scroll_into_view_if_needed()
            box = plot.bounding_box()
            assert box and box["width"] > 100 and box["height"] > 50, box
            assert plot.evaluate("img => img.complete && img.naturalWidth") > 0  # decoded
            shot = plot.screenshot(path=str(ARTIFACTS / "browser_quickstart_timeline.png"))
            assert colours(shot) > 4, "the timeline's plot rendered blank"
            table = page.locator(".jp-RenderedHTMLCommon table:has-text('exposed comm.')")
            assert table.count() == 1 and table.locator("tbody tr").count() == 2  # a row a rank
        finally:
            browser.close()

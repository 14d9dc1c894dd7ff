"""The tutorials' stored outputs, which the documentation shows, hold what their code prints and
never TensorFlow's start-up logs."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))
FRAMEWORK_LOGS = re.compile(
    r"All log messages before absl::InitializeLog\(\)|oneDNN custom operations are on"
    r"|failed call to cuInit|Could not find cuda drivers|^[IWEF]\d{4} [\d:.]+ +\d+ \S+:\d+\] "
    r"|AutoGraph could not transform",
    re.MULTILINE,
)


def texts(output: dict) -> Iterator[str]:
    """Every text a frontend could show for one output."""
    if output["output_type"] == "stream":
        yield "".join(output["text"])
    elif output["output_type"] == "error":
        yield "\n".join(output["traceback"])
    for mime, value in output.get("data", {}).items():
        if mime.startswith("text/"):
            yield "".join(value) if isinstance(value, list) else value


def framework_logs(notebook: dict) -> list[str]:
    """The framework log lines found in a notebook's stored outputs, with their cells."""
    found = []
    for index, cell in enumerate(notebook["cells"]):
        for output in cell.get("outputs", []):
            for text in texts(output):
                found += [f"cell {index}: {m[0]}" for m in FRAMEWORK_LOGS.finditer(text)]
    return found


def test_the_check_finds_framework_logs():
    stream = {
        "output_type": "stream",
        "name": "stderr",
        "text": ["x\n", "E0000 00:00:17.5  9 a.cc:52] failed\n"],
    }
    html = {"output_type": "display_data", "data": {"text/html": "oneDNN custom operations are on"}}
    warning = "WARNING: AutoGraph could not transform <bound method Comm.Get_rank of <...>>"
    autograph = {"output_type": "stream", "name": "stdout", "text": [warning]}
    notebook = {"cells": [{"cell_type": "code", "outputs": [stream, html, autograph]}]}
    assert framework_logs(notebook) == [
        "cell 0: E0000 00:00:17.5  9 a.cc:52] ",
        "cell 0: oneDNN custom operations are on",
        "cell 0: AutoGraph could not transform",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_stored_outputs_show_no_framework_logs(path: Path):
    notebook = json.loads(path.read_text())
    code = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    assert sum(bool(cell["outputs"]) for cell in code) > len(code) // 2, "outputs not stored"
    errors = [cell for cell in code if any(o["output_type"] == "error" for o in cell["outputs"])]
    assert all("raises-exception" in c.get("metadata", {}).get("tags", []) for c in errors)
    assert framework_logs(notebook) == []


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_each_tutorial_is_what_its_generator_writes(path: Path):
    """notebooks/build_notebooks.py is the tutorials' source: each stored notebook has its cells,
    in order, with the same ids, kinds, tags and sources."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "build_notebooks", path.parent / "build_notebooks.py"
    )
    generator = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generator)
    built = generator.build(path.name)
    stored = json.loads(path.read_text())

    def cells(nb) -> list[tuple]:
        return [
            (c["id"], c["cell_type"], c.get("metadata", {}).get("tags", []), "".join(c["source"]))
            for c in nb["cells"]
        ]

    assert cells(stored) == cells(built), "rewrite it: python notebooks/build_notebooks.py"

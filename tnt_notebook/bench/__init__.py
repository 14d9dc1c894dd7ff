"""Benchmarks: ``python -m tnt_notebook.bench <name>`` runs ``tnt_notebook.bench.<name>.main``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_report(path: str | Path, report: dict[str, Any]) -> Path:
    """Every benchmark's JSON: written where asked (folders created), and said so."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}", flush=True)
    return path

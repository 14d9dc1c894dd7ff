"""Benchmarks: ``python -m tnt_notebook.bench <name>`` runs ``tnt_notebook.bench.<name>.main``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from tnt_notebook import settings


def write_report(path: str | Path, report: dict[str, Any]) -> Path:
    """Every benchmark's JSON: written where asked (folders created), and said so."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}", flush=True)
    return path


def add_transport_option(parser: argparse.ArgumentParser) -> None:
    """The launchers' ``--transport`` (tnt_notebook.cluster.options.LAUNCH_OPTIONS): the ranks'
    step between nodes (on one machine, ``TNT_RANKS_PER_NODE=1`` makes every rank a node of its own,
    so that the transport carries data)."""
    from tnt_notebook.cluster.options import LAUNCH_OPTIONS

    flags, kwargs = next(option for option in LAUNCH_OPTIONS if option[0] == ("--transport",))
    parser.add_argument(*flags, **kwargs)


def use_transport(args: argparse.Namespace) -> str:
    """Exports ``--transport`` to this process and the ranks it starts; returns the transport."""
    if args.transport:
        os.environ[settings.TRANSPORT.name] = args.transport
    return settings.TRANSPORT.read()

"""``python -m tnt_notebook.bench <allreduce|fit|cluster|progress|backup> [options]``."""

from __future__ import annotations

import importlib
import sys

BENCHMARKS = ("allreduce", "fit", "cluster", "progress", "backup")


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help") or args[0] not in BENCHMARKS:
        print(f"usage: python -m tnt_notebook.bench {{{','.join(BENCHMARKS)}}} [options]")
        return 0 if args and args[0] in ("-h", "--help") else 2
    module = importlib.import_module(f"tnt_notebook.bench.{args[0]}")
    return int(module.main(args[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())

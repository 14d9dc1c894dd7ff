"""The Jupyter kernel "Python 3 (tnt_notebook)": ipykernel with the extension already loaded.

Install it for the current user with ``tnt-notebook-kernelspec install --user`` (or ``python -m
tnt_notebook.notebook.kernelspec install --user``); ``--prefix P`` / ``--sys-prefix`` install into
an environment instead. The installed spec runs the Python that installed it, so the kernel always
has tnt_notebook and its dependencies. ``kernelspec/tnt_notebook/kernel.json`` in the repository is
the same spec with the interpreter left as ``python`` (Jupyter substitutes its own).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

KERNEL_NAME = "tnt_notebook"
DISPLAY_NAME = "Python 3 (tnt_notebook)"


def kernel_command(executable: str = "python") -> list[str]:
    """The kernel's argv: ipykernel's launcher with ``tnt_notebook`` as an extra extension."""
    return [
        executable,
        "-m",
        "ipykernel_launcher",
        "-f",
        "{connection_file}",
        "--ext=tnt_notebook",
    ]


def kernel_dict(executable: str = "python") -> dict[str, Any]:
    """The content of ``kernel.json``."""
    return {
        "argv": kernel_command(executable),
        "display_name": DISPLAY_NAME,
        "language": "python",
        "metadata": {"debugger": True},
    }


def write_kernel_spec(path: str | Path, executable: str = "python") -> Path:
    """Write the kernel spec directory (``kernel.json``) to ``path``."""
    target = Path(path)
    target.mkdir(parents=True, exist_ok=True)
    (target / "kernel.json").write_text(json.dumps(kernel_dict(executable), indent=1) + "\n")
    return target


def install(
    *,
    user: bool = False,
    prefix: str | None = None,
    sys_prefix: bool = False,
    kernel_name: str = KERNEL_NAME,
    executable: str | None = None,
) -> str:
    """Install the kernel spec; returns the directory it was installed to.

    Exactly one location: ``user`` (~/.local/share/jupyter), ``prefix`` or ``sys_prefix``
    (this environment); with none of them, Jupyter's system-wide directory.
    """
    from jupyter_client.kernelspec import KernelSpecManager

    if sum([bool(user), prefix is not None, bool(sys_prefix)]) > 1:
        raise ValueError("choose at most one of user, prefix and sys_prefix")
    if sys_prefix:
        prefix = sys.prefix
    with tempfile.TemporaryDirectory() as tmp:
        source = write_kernel_spec(Path(tmp) / kernel_name, executable or sys.executable)
        return KernelSpecManager().install_kernel_spec(
            str(source), kernel_name, user=user, prefix=prefix
        )


def main(argv: list[str] | None = None) -> int:
    """``tnt-notebook-kernelspec install [--user | --prefix P | --sys-prefix]`` or ``show``."""
    parser = argparse.ArgumentParser(
        prog="tnt-notebook-kernelspec", description=f'Install the "{DISPLAY_NAME}" Jupyter kernel.'
    )
    sub = parser.add_subparsers(dest="command", required=True)
    inst = sub.add_parser("install", help="install the kernel spec")
    where = inst.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for the current user")
    where.add_argument("--prefix", help="into PREFIX/share/jupyter/kernels")
    where.add_argument("--sys-prefix", action="store_true", help=f"into {sys.prefix}")
    inst.add_argument("--name", default=KERNEL_NAME, help="kernel name (default %(default)s)")
    sub.add_parser("show", help="print the kernel.json this Python would install")
    args = parser.parse_args(argv)
    if args.command == "show":
        print(json.dumps(kernel_dict(sys.executable), indent=1))
        return 0
    path = install(
        user=args.user, prefix=args.prefix, sys_prefix=args.sys_prefix, kernel_name=args.name
    )
    print(f"Installed kernel spec {args.name!r} ({DISPLAY_NAME}) in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

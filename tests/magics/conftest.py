"""Module-scoped real kernels for the magics tests, shut down and checked for leftovers."""

from __future__ import annotations

import os

import psutil
import pytest

from tests.support.kernel_driver import Kernel, wait_gone


@pytest.fixture(scope="module")
def kernel_factory(tmp_path_factory):
    """Start kernels for a module; each is shut down and checked for leftovers at the end."""
    kernels: list[tuple[Kernel, list[psutil.Process]]] = []

    def make(cwd: str | os.PathLike | None = None) -> Kernel:
        k = Kernel(cwd=str(cwd or tmp_path_factory.mktemp("nb")))
        kernels.append((k, []))
        return k

    yield make
    problems = []
    for k, _ in kernels:
        procs = k.descendants()
        try:
            if k.km.is_alive():
                k.execute("%tnt_cluster stop", timeout=60)
        finally:
            k.shutdown()
        left = wait_gone(procs, 20)
        if left:
            problems.append([" ".join(p.cmdline()) for p in left])
            for p in left:
                p.kill()
    assert not problems, f"processes outlived the kernel: {problems}"

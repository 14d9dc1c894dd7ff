"""%tnt_cluster --transport gaspi across the test hosts (tests/testhosts.py): GPI-2 carries the
engine's step between hosts. One cluster of 2 hosts x 2 ranks: the rank API, every op and dtype,
training equal to serial Keras, a host cut off (every rank's own error is read from the shared
directory, where each writes it), and nothing left on any host after stop. (3 hosts x 1 rank and
a rank killed mid-collective: tests/native/test_gaspi_three_hosts.py.)"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests.support.kernel_driver import Kernel
from tests.support.mpiworld import requires_gaspi
from tests.support.rank_api_checks import API_CHECKS, PRELUDE
from tests.support.testhosts import leftovers_within

pytestmark = [pytest.mark.notebook, pytest.mark.mpi, pytest.mark.hosts, requires_gaspi]


COLLECTIVE_TIMEOUT = 8


@pytest.fixture(scope="module")
def hosts(test_hosts):
    """The test hosts, a hostfile of the first two and a directory they all see."""
    nb = Path(tempfile.mkdtemp(prefix="nb-gaspi-", dir=test_hosts.shared_dir))
    two = test_hosts.write_hostfile(test_hosts.hosts[:2], nb / "two")
    yield test_hosts, two, nb
    shutil.rmtree(nb, ignore_errors=True)


@pytest.fixture(scope="module")
def kernel(kernel_factory, hosts):
    test_hosts, two, nb = hosts
    k = kernel_factory(cwd=nb)
    # every allreduce takes the engine's path: GASPI carries it between the hosts
    r = k.ok(
        f"%tnt_cluster --hostfile {two} --n-per-node 2 --ssh {test_hosts.ssh} --transport gaspi"
        f" -x TNT_ALLREDUCE_PATH=engine --collective-timeout {COLLECTIVE_TIMEOUT}",
        timeout=180,
    )
    assert "tnt cluster ready: 4 rank(s)" in r.stdout, r.text()
    return k


EVERY_OP = """%%tnt
from tests.support import world_checks as w
from tnt_notebook.rank import api as ranks
info = ranks.engine_info()
checks = w.matrix([0, 1, 7, 1001, (33, 65)]) + w.matrix([1_100_001], ops=["sum", "max"])
print(info["transport"], info["num_nodes"], checks, w.fused(None) > 0)
"""


def test_the_rank_api_and_every_op_and_dtype_cross_two_hosts_over_gaspi(kernel):
    assert "transport between nodes: gaspi" in kernel.ok("%tnt_cluster status").stdout
    # (world_checks.say writes to the file descriptor, which the engines do not capture)
    r = kernel.ok("%%tnt --all-ranks" + PRELUDE + API_CHECKS + "print('API DONE')", timeout=300)
    assert r.stdout == "[stdout:0-3]\nAPI DONE\n", r.text()
    assert kernel.ok(EVERY_OP, timeout=300).stdout == "gaspi 2 132 True\n"


def test_model_fit_over_gaspi_across_hosts_equals_serial_keras(kernel):
    code = """%%tnt
from tests.keras import equivalence_worker as e
print(e.summary_on_ranks(("dense_sgd", "lenet_sgd_momentum_dataset"), 1e-4))
"""
    r = kernel.ok(code, timeout=600)
    result = [line for line in r.stdout.splitlines() if line.startswith("RESULT")]
    assert result and result[0].split()[1:3] == ["True", "True"], r.text()


# Allreduces until one fails; each rank then writes its error into the shared directory.
LOOP = """%%tnt
import json, os, time
import numpy as np
x = np.ones(500_000, np.float32)
try:
    for i in range(100_000):
        tnt.allreduce(x)
        if i == 5 and tnt.get_rank() == 0:
            open(os.path.join({d!r}, "started"), "w").close()
except Exception as e:
    with open(os.path.join({d!r}, f"lost-{{tnt.get_rank()}}"), "w") as f:
        json.dump({{"t": time.time(), "error": f"{{type(e).__name__}}: {{e}}"}}, f)
    raise
"""


def run_until_lost(kernel: Kernel, nb: Path, fault, ranks: list[int], bound: float) -> dict:
    """Starts LOOP, applies `fault` once every rank reduces, and returns the errors of `ranks`
    (each must come within `bound` seconds), once the cell has ended."""
    d = Path(tempfile.mkdtemp(dir=nb))
    msg_id = kernel.send(LOOP.format(d=str(d)))
    deadline = time.monotonic() + 120
    while not (d / "started").exists():
        assert time.monotonic() < deadline, "the allreduces did not start within 120 s"
        time.sleep(0.05)
    t0 = time.time()
    undo = fault()
    try:
        files = [d / f"lost-{r}" for r in ranks]
        while not all(f.exists() for f in files):
            assert time.time() - t0 < bound + 20, [f.name for f in d.iterdir()]
            time.sleep(0.05)
        time.sleep(0.2)  # (written whole)
        errors = {r: json.loads(f.read_text()) for r, f in zip(ranks, files, strict=True)}
        result = kernel.collect(msg_id, timeout=120)
    finally:
        if undo:
            undo()
    assert result.status == "error", result.text()
    for r, e in errors.items():
        assert e["t"] - t0 < bound, (r, e)
    return {r: e["error"] for r, e in errors.items()}


def test_a_host_cut_off_is_named_by_every_rank_before_the_collective_timeout(kernel, hosts):
    """Ranks 0-1 on the first host, 2-3 on the second (cut off): a neighbour that does not answer
    GASPI's probe for half the collective timeout is named, with its host, on both sides."""
    test_hosts, _, nb = hosts
    first, cut = test_hosts.hosts[:2]

    def fault():
        cut.link_down()
        return cut.link_up

    errors = run_until_lost(kernel, nb, fault, [0, 1, 2, 3], bound=COLLECTIVE_TIMEOUT)
    for r, error in errors.items():
        other = cut if r < 2 else first
        assert re.search(rf"rank [0-3] \(host {other.name}\) has not answered GASPI", error), (
            r,
            error,
        )


def test_stop_after_the_cut_leaves_nothing_on_any_host(kernel, hosts):
    """The cut host's ranks, which the launcher could not take down, are ended too."""
    test_hosts, _, _ = hosts
    assert "DEAD" in kernel.ok("%tnt_cluster status").stdout
    kernel.ok("%tnt_cluster stop", timeout=60)
    assert leftovers_within(test_hosts.hosts) == {}

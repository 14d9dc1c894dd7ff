"""The TensorFlow op built on first use: a cache keyed by the TensorFlow build and the sources,
one build per node however many processes start at once, and the fallback (with one warning
that says why) wherever the op cannot be had.

Each test has a cache of its own and a compiler wrapper that counts its runs (and can be slow, hang
or fail). The module's first build and the install's are real compiles; the other tests' wrapper
writes that build's library where the cache asks for its output (a compile is 7-12 s of the
suite's time, and what they test is the cache's keys, locks and records); what they load is a
real op library."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.support.keras_worlds import ENV
from tests.support.mpiworld import run_mpi
from tnt_notebook.keras import op_cache

REPO = Path(__file__).resolve().parents[2]
REAL_CXX = shutil.which("c++") or shutil.which("g++")

LOAD = """
import json
from tnt_notebook.keras import op_cache
try:
    module, path = op_cache.load({sources})
    result = {{"ok": hasattr(module, "tnt_allreduce"), "path": str(path)}}
except op_cache.OpUnavailable as exc:
    result = {{"ok": False, "error": str(exc)}}
print("RESULT", json.dumps(result), flush=True)
"""
NO_FLOCK = """
import errno, fcntl
def flock(fd, operation):  # what flock answers on NFS without a lock manager
    raise OSError(errno.ENOLCK, "No locks available")
fcntl.flock = flock
"""


def wrapper(
    tmp_path: Path, name: str, *, fail: bool = False, sleep: float = 0, built: dict | None = None
) -> Path:
    """A compiler that writes its arguments to <name>.count (a line per run) and its pid to
    <name>.count.pid, sleeps, then fails, writes the library of `built` (the module's real
    build) to its -o output, or runs the real compiler."""
    script = tmp_path / name
    count = tmp_path / f"{name}.count"
    if fail:
        body = 'echo "this compiler always fails" >&2; exit 1'
    elif built:
        body = (
            f'[ "$1" = --version ] && exec {REAL_CXX} "$@"\n'
            'while [ $# -gt 1 ] && [ "$1" != -o ]; do shift; done\n'
            f'[ "$1" = -o ] && exec cp {built["path"]} "$2"\nexit 2'
        )
    else:
        body = f'exec {REAL_CXX} "$@"'
    script.write_text(
        f'#!/bin/sh\necho "$*" >> {count}\necho $$ > {count}.pid\nsleep {sleep}\n{body}\n'
    )
    script.chmod(0o755)
    return script


def runs(compiler: Path) -> int:
    """How many builds ``compiler`` ran (not counting ``--version``)."""
    count = compiler.with_name(compiler.name + ".count")
    lines = count.read_text().splitlines() if count.exists() else []
    return sum(" -shared " in line for line in lines)


def start(cache: Path, cxx: Path | str, prelude: str = "", sources: Path | None = None):
    env = {**os.environ, **ENV, "TNT_NOTEBOOK_CACHE": str(cache), "CXX": str(cxx)}
    code = prelude + LOAD.format(sources=repr(str(sources)) if sources else "")
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=env,
    )  # fmt: skip


def finish(proc: subprocess.Popen, timeout: float = 150) -> dict:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"the op's lookup did not end within {timeout} s:\n{out}")
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and len(lines) == 1, out
    return json.loads(lines[0][len("RESULT ") :])


def run(cache: Path, cxx: Path | str, prelude: str = "", sources: Path | None = None) -> dict:
    return finish(start(cache, cxx, prelude, sources))


def cli(cache: Path, cxx: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TNT_NOTEBOOK_CACHE": str(cache), "CXX": str(cxx)}
    return subprocess.run(
        [sys.executable, "-m", "tnt_notebook.keras.op_cache", *args],
        capture_output=True, text=True, env=env, timeout=150,
    )  # fmt: skip


def temporaries(entry: Path) -> list[str]:
    return sorted(p.name for p in entry.glob(".*.tmp"))


def test_the_suite_has_a_cache_of_its_own():
    root = op_cache.cache_root()
    assert root == REPO / "build" / "test-op-cache"
    assert os.environ["TNT_NOTEBOOK_CACHE"] == str(root)


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    """One real build in a cache of the module's; tests copy it (``cached``)."""
    tmp = tmp_path_factory.mktemp("built")
    good = wrapper(tmp, "good")
    result = run(tmp / "cache", good)
    assert result["ok"] and runs(good) == 1, result
    return {"cache": tmp / "cache", "path": Path(result["path"])}


def cached(built: dict, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the built cache, and where its library is in the copy."""
    cache = tmp_path / "cache"
    shutil.copytree(built["cache"], cache)
    return cache, cache / built["path"].relative_to(built["cache"])


def test_a_second_process_finds_the_cache_even_with_a_broken_compiler(built, tmp_path):
    cache, library = cached(built, tmp_path)
    entry = library.parent
    assert entry.parent == cache / "tf_op" and entry.name.startswith("tf")
    assert {"libtnt_tf_op.so", "build.log", "key.json"} <= {p.name for p in entry.iterdir()}
    assert json.loads((entry / "key.json").read_text())["sources"] == op_cache.source_hash(
        op_cache.sources_dir()
    )
    assert (entry / "build.log").read_text().startswith(f"$ {tmp_path.parent}")
    assert temporaries(entry) == []
    broken = wrapper(tmp_path, "broken", fail=True)
    assert run(cache, broken) == {"ok": True, "path": str(library)} and runs(broken) == 0
    status = json.loads(cli(cache, broken, "--json").stdout)
    assert status["entry"] == str(entry) and status["status"] == "built, loads", status


def test_new_sources_or_a_new_tensorflow_get_a_build_of_their_own(built, tmp_path):
    (cache, library), good = cached(built, tmp_path), wrapper(tmp_path, "good", built=built)
    sources = tmp_path / "sources"
    shutil.copytree(op_cache.sources_dir(), sources)
    with open(sources / "tf_op.cpp", "a") as f:
        f.write("// one more line: another source hash\n")
    changed = run(cache, good, sources=sources)
    assert changed["ok"] and runs(good) == 1, changed
    newer_tf = run(cache, good, prelude="import tensorflow as tf\ntf.__version__ = '2.99.0'\n")
    assert newer_tf["ok"] and runs(good) == 2, newer_tf
    assert Path(newer_tf["path"]).parent.name.startswith("tf2.99.0-")
    assert len({str(library), changed["path"], newer_tf["path"]}) == 3
    assert sorted(p.name for p in (cache / "tf_op").iterdir()) == sorted(
        Path(p).parent.name for p in (str(library), changed["path"], newer_tf["path"])
    )


def test_three_processes_starting_at_once_compile_once(built, tmp_path):
    cache, slow = tmp_path / "cache", wrapper(tmp_path, "slow", sleep=2, built=built)
    results = [finish(p) for p in [start(cache, slow) for _ in range(3)]]
    assert all(r["ok"] for r in results) and len({r["path"] for r in results}) == 1, results
    assert runs(slow) == 1


@pytest.mark.slow
def test_a_builder_killed_mid_compile_does_not_wedge_the_next(built, tmp_path):
    cache, hanging = tmp_path / "cache", wrapper(tmp_path, "hanging", sleep=300)
    builder = start(cache, hanging)
    pid_file = hanging.with_name("hanging.count.pid")
    try:
        deadline = time.monotonic() + 120
        while not pid_file.exists() and builder.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pid_file.exists(), "the builder never started its compiler"
        builder.kill()
        builder.communicate()
        good = wrapper(tmp_path, "good", built=built)
        # the lock died with its holder: no wait for the op_cache.WAIT_S deadline
        result = finish(start(cache, good), timeout=op_cache.WAIT_S / 2)
        assert result["ok"] and runs(good) == 1, result
        assert temporaries(Path(result["path"]).parent) == []  # the killed one's files removed
    finally:
        builder.kill()
        builder.wait()
        if pid_file.exists():  # the compiler runs in a session of its own: end it
            with_pid = int(pid_file.read_text())
            try:
                os.kill(with_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.slow
def test_a_filesystem_without_locks_still_builds_and_loads(built, tmp_path):
    cache, slow = tmp_path / "cache", wrapper(tmp_path, "slow", sleep=2, built=built)
    results = [finish(p) for p in [start(cache, slow, prelude=NO_FLOCK) for _ in range(2)]]
    assert all(r["ok"] for r in results) and len({r["path"] for r in results}) == 1, results
    assert 1 <= runs(slow) <= 2  # each may build its own copy; the renames replace one by another
    assert temporaries(Path(results[0]["path"]).parent) == []


@pytest.mark.slow
def test_a_corrupt_entry_is_rebuilt_once(built, tmp_path):
    (cache, library), good = cached(built, tmp_path), wrapper(tmp_path, "good", built=built)
    library.write_bytes(b"not a shared library\n" * 100)
    results = [finish(p) for p in [start(cache, good) for _ in range(2)]]
    assert all(r["ok"] for r in results), results
    assert runs(good) == 1  # rebuilt by one of the two
    assert library.read_bytes()[:4] == b"\x7fELF"


def test_a_failed_build_is_recorded_once_and_retried_on_request(built, tmp_path):
    cache, broken = tmp_path / "cache", wrapper(tmp_path, "broken", fail=True)
    results = [finish(p) for p in [start(cache, broken) for _ in range(2)]]
    assert runs(broken) == 1, results  # the other found the failure recorded
    entry = cache / "tf_op" / next(iter(os.listdir(cache / "tf_op")))
    for r in results:
        assert not r["ok"]
        assert r["error"].startswith("building the TensorFlow op failed (")
        assert f"code 1; the compiler's output is in {entry / 'build.log'}" in r["error"]
        assert "-m tnt_notebook.keras.op_cache build" in r["error"]
    log = (entry / "build.log").read_text()
    assert log.startswith(f"$ {broken} ") and "this compiler always fails" in log
    status = json.loads(cli(cache, broken, "--json").stdout)
    assert status["status"].startswith("failed: ") and "run build to retry" in status["status"]
    retried = cli(cache, broken, "build")
    assert retried.returncode == 1 and runs(broken) == 2, retried.stderr
    assert "error: building the TensorFlow op failed" in retried.stderr
    good = wrapper(tmp_path, "good", built=built)  # another compiler: the next process tries it
    assert run(cache, good)["ok"] and runs(good) == 1
    built = cli(cache, good, "build")
    assert built.returncode == 0 and runs(good) == 1, built.stderr  # there: nothing to do
    assert "status:     built, loads" in built.stdout and str(entry) in built.stdout


def test_an_unusable_cache_gives_the_fallback_and_says_why(tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tf_op").write_text("a file where the entries' directory should be\n")
    result = run(cache, wrapper(tmp_path, "good"))
    assert not result["ok"] and "is not usable (" in result["error"], result
    assert "set TNT_NOTEBOOK_CACHE to a writable directory" in result["error"]


NO_COMPILER_FIT = """
import json, sys, warnings
import numpy as np, keras
import tnt_notebook as tnt
from tnt_notebook.keras import allreduce_op

rng = np.random.default_rng(0)
x = rng.normal(size=(96, 6)).astype("float32")
y = (x[:, 0] + x[:, 1] > 0).astype("int64")


def model():
    keras.utils.set_random_seed(3)
    m = keras.Sequential([keras.Input((6,)), keras.layers.Dense(8, activation="tanh"),
                          keras.layers.Dense(2)])
    m.compile(keras.optimizers.SGD(0.1),
              keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    parallel = tnt.Model(model())
    parallel.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
    loss = parallel.evaluate(x, y, batch_size=32, verbose=0)
serial = model()
serial.fit(x, y, batch_size=32, epochs=3, shuffle=False, verbose=0)
# one write per line: the ranks' lines reach mpiexec's stdout whole (PYTHONUNBUFFERED makes
# print write each of its pieces on its own)
sys.stdout.write("RESULT " + json.dumps({
    "rank": tnt.get_rank(),
    "op": allreduce_op.op_library() is not None,
    "warnings": [str(w.message) for w in caught if str(w.message).startswith("tnt:")],
    "weights": max(float(np.max(np.abs(a - b)))
                   for a, b in zip(parallel.get_weights(), serial.get_weights())),
    "loss": abs(loss - serial.evaluate(x, y, batch_size=32, verbose=0)),
}) + "\\n")
"""


@pytest.mark.mpi
def test_without_a_compiler_fit_warns_once_and_trains_alike_through_the_fallback(tmp_path):
    env = {
        **ENV,
        "TNT_NOTEBOOK_CACHE": str(tmp_path / "cache"),
        "CXX": "",
        "PATH": str(Path(sys.executable).parent),  # mpiexec and python; no c++, g++, clang++
    }
    proc = run_mpi(2, NO_COMPILER_FIT, env=env, timeout=180)
    results = [json.loads(line.split(" ", 1)[1]) for line in proc.stdout.splitlines()
               if line.startswith("RESULT ")]  # fmt: skip
    assert sorted(r["rank"] for r in results) == [0, 1], proc.stdout + proc.stderr
    for r in results:
        assert not r["op"]
        assert len(r["warnings"]) == 1, r["warnings"]
        (warning,) = r["warnings"]
        assert "no C++ compiler to build the TensorFlow op" in warning
        assert "apt-get install g++" in warning and "tf.numpy_function" in warning
        assert r["weights"] <= 1e-5 and r["loss"] <= 1e-5, r
    assert not list((tmp_path / "cache").rglob("*.so"))


FRESH_FIT = """
import json, sys
import numpy as np, keras
import tnt_notebook as tnt
from tnt_notebook.rank import api as ranks
from tnt_notebook.keras import allreduce_op

python_reductions = 0
reduce_bucket = ranks.FusedAllreduce.reduce_bucket


def counting(self, *args, **kwargs):  # the tf.numpy_function fallback's path
    global python_reductions
    python_reductions += 1
    return reduce_bucket(self, *args, **kwargs)


ranks.FusedAllreduce.reduce_bucket = counting
x = np.random.default_rng(0).normal(size=(128, 8)).astype("float32")
y = (x[:, 0] > 0).astype("int64")
model = tnt.Model(keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)]))
model.compile("sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True))
model.fit(x, y, batch_size=32, epochs=2, verbose=0)
library = allreduce_op.op_library()
sys.stdout.write("RESULT " + json.dumps({"rank": tnt.get_rank(), "op": library is not None,
                                         "python_reductions": python_reductions}) + "\\n")
"""


@pytest.mark.slow
@pytest.mark.mpi
@pytest.mark.timeout(1200)
def test_pip_install_with_build_isolation_then_fit_builds_and_uses_the_op(tmp_path):
    """As a user installs: a fresh virtual environment, `pip install ".[tensorflow]"` with pip's
    build isolation (no TensorFlow at build time), then a 2-rank fit."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    source = tmp_path / "tnt_notebook"
    for name in filter(None, files):
        if (REPO / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    install = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "-q", f"{source}[tensorflow]"],
        capture_output=True, text=True, timeout=1000,
    )  # fmt: skip
    assert install.returncode == 0, install.stdout[-3000:] + install.stderr[-3000:]
    package = next((venv / "lib").glob("python3*/site-packages/tnt_notebook"))
    assert (package / "tf_op" / "tf_op.cpp").is_file()
    assert (package / "tf_op" / "tnt" / "c_api.h").is_file()
    assert not list(package.rglob("*tf_op*.so"))  # nothing built for a TensorFlow at install
    cache = tmp_path / "cache"
    env = {**os.environ, **ENV, "TNT_NOTEBOOK_CACHE": str(cache)}
    env.pop("PYTHONPATH", None)
    fit = subprocess.run(
        [str(venv / "bin" / "mpiexec"), "-n", "2", str(venv / "bin" / "python"), "-c",
         textwrap.dedent(FRESH_FIT)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,  # not the checkout
    )  # fmt: skip
    results = [json.loads(line.split(" ", 1)[1]) for line in fit.stdout.splitlines()
               if line.startswith("RESULT ")]  # fmt: skip
    assert fit.returncode == 0 and len(results) == 2, fit.stdout + fit.stderr
    for r in results:
        assert r["op"] and r["python_reductions"] == 0, r
    (library,) = (cache / "tf_op").glob("*/libtnt_tf_op.so")
    assert (library.parent / "build.log").read_text().startswith("$ ")

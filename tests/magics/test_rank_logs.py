"""A %%tnt cell shows what the user's code prints, not TensorFlow's start-up logs, unless the
cluster's --log-level or the user's own TF_CPP_MIN_LOG_LEVEL asks for them."""

from __future__ import annotations

import re

import pytest

from tnt_notebook.rank.tf_logs import log_environment, passed_on

# What TensorFlow 2.21 writes while it loads and probes for a GPU on a machine without one.
START_UP = """\
WARNING: All log messages before absl::InitializeLog() is called are written to STDERR
I0000 00:00:1795607225.385831    8855 port.cc:153] oneDNN custom operations are on. You may see
I0000 00:00:1795607225.385831    8855 cpu_feature_guard.cc:227] This TensorFlow binary is optimized
To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow.
W0000 00:00:1795607225.385831    8855 some.cc:1] a warning
E0000 00:00:1795607225.385831    8855 other.cc:2] an error
  with a second line
"""
# An INFO line of TensorFlow's C++ logging; which ones a machine prints depends on its CPU (oneDNN's
# line only where the CPU has AVX-512 VNNI or newer) and on its drivers.
CPP_INFO_LINE = re.compile(r"^I\d{4} \d\d:\d\d:\d+\.\d+ +\d+ \w+\.cc:\d+\] ", re.M)
CELL = """%%tnt --all-ranks
import logging
import keras
import tensorflow as tf
print("GPUs:", len(tf.config.list_physical_devices("GPU")),
      "python level:", logging.getLevelName(logging.getLogger("tensorflow").level))
"""


@pytest.mark.parametrize(
    "level, expected",
    [
        (None, "2"),
        ("DEBUG", "0"),
        ("INFO", "0"),
        ("WARNING", "1"),
        ("ERROR", "2"),
        ("CRITICAL", "3"),
    ],
)
def test_the_cpp_log_level_follows_the_cluster_log_level(level, expected):
    assert log_environment(level, environ={}) == {"TF_CPP_MIN_LOG_LEVEL": expected}
    assert log_environment(level, environ={"TF_CPP_MIN_LOG_LEVEL": "0"}) == {}  # the user's wins


def test_lines_below_the_level_are_dropped_with_their_continuations():
    assert passed_on(START_UP, 0) == START_UP
    lines = START_UP.splitlines(keepends=True)
    assert passed_on(START_UP, 1) == "".join(lines[4:])
    assert passed_on(START_UP, 2) == "".join(lines[5:])
    assert passed_on(START_UP, 3) == ""
    assert passed_on("user text\n" + START_UP, 3) == "user text\n"


@pytest.fixture(scope="module")
def kernel(kernel_factory):
    k = kernel_factory()
    k.ok("import os\nos.environ.pop('TF_CPP_MIN_LOG_LEVEL', None)")
    yield k
    k.execute("%tnt_cluster stop", timeout=60)


@pytest.mark.mpi
@pytest.mark.notebook
def test_a_cell_shows_no_start_up_logs_at_the_default_level(kernel):
    kernel.ok("%tnt_cluster -n 2", timeout=120)
    r = kernel.ok(CELL, timeout=180)
    assert r.stdout == "[stdout:0-1]\nGPUs: 0 python level: ERROR\n", r.text()
    assert r.stderr == "", r.text()


@pytest.mark.mpi
@pytest.mark.notebook
def test_log_level_info_shows_them_but_not_the_probe_errors_without_a_gpu(kernel):
    kernel.ok("%tnt_cluster restart -n 2 --log-level INFO", timeout=120)
    r = kernel.ok(CELL, timeout=180)
    assert "GPUs: 0 python level: INFO" in r.stdout, r.text()
    assert CPP_INFO_LINE.search(r.stderr), r.text()
    assert "failed call to cuInit" not in r.text()


@pytest.mark.mpi
@pytest.mark.notebook
@pytest.mark.slow
def test_the_users_own_cpp_log_level_wins(kernel):
    kernel.ok("os.environ['TF_CPP_MIN_LOG_LEVEL'] = '3'")
    kernel.ok("%tnt_cluster restart -n 2 --log-level INFO", timeout=120)
    r = kernel.ok(CELL, timeout=180)
    assert r.stderr == "", r.text()
    kernel.ok("os.environ.pop('TF_CPP_MIN_LOG_LEVEL')")

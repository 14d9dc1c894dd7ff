"""For every test run, of tests/ and of notebooks/ alike: the TensorFlow op's cache is the run's own
(under build/, kept between runs), never the user's (tnt_notebook/keras/op_cache.py); and every
process a test starts (ranks, kernels, workers) imports the test helpers as ``tests.support``."""

import os
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parent
TEST_OP_CACHE = CHECKOUT / "build" / "test-op-cache"
os.environ["TNT_NOTEBOOK_CACHE"] = str(TEST_OP_CACHE)
os.environ["PYTHONPATH"] = os.pathsep.join(
    [str(CHECKOUT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)

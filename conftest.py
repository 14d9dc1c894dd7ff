"""For every test run, of tests/ and of notebooks/ alike: the TensorFlow op's cache is the run's own
(under build/, kept between runs), never the user's (tnt_notebook/keras/op_cache.py)."""

import os
from pathlib import Path

TEST_OP_CACHE = Path(__file__).resolve().parent / "build" / "test-op-cache"
os.environ["TNT_NOTEBOOK_CACHE"] = str(TEST_OP_CACHE)

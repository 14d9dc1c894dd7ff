"""Sphinx configuration of tnt_notebook's documentation (``sphinx-build -W docs build/docs``).

Pages are MyST Markdown; the tutorials are the notebooks of ``notebooks/`` (``tutorials`` links
there), rendered with their stored outputs and never executed here; the API reference comes
from the docstrings."""

from __future__ import annotations

import os

import tnt_notebook
from tnt_notebook.rank import tf_logs

tf_logs.quiet_import()  # autodoc imports TensorFlow: its start-up lines at the level below
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

project = "tnt_notebook"
author = "the tnt_notebook authors"
copyright = "the tnt_notebook authors, Apache-2.0"  # noqa: A001 - Sphinx's name
release = version = tnt_notebook.__version__

extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.viewcode"]
exclude_patterns = ["_build", "tutorials/build_notebooks.py", "**/.ipynb_checkpoints"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb"}

nb_execution_mode = "off"  # the stored outputs, as nbval checks them in the test run
nb_merge_streams = True
myst_heading_anchors = 3

autodoc_member_order = "bysource"
autodoc_typehints = "description"
nitpicky = True  # every cross-reference must resolve (other projects' names excepted: offline)
nitpick_ignore_regex = [
    (r"py:.*", r"(np|numpy|tf|tensorflow|keras|ipyparallel|IPython|pathlib|collections|typing)\..*")
]

html_theme = "furo"
html_title = f"tnt_notebook {release}"

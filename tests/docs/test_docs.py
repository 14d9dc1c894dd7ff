"""The documentation site builds with every warning an error, so that a broken reference,
docstring or page fails the test run. The tutorials are rendered with their stored outputs, never
executed here (nbval runs them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[2] / "docs"


def test_the_documentation_builds_without_a_warning(tmp_path):
    html = tmp_path / "html"
    build = subprocess.run(
        [sys.executable, "-m", "sphinx", "-E", "-W", "--keep-going", "-q", "-b", "html",
         str(DOCS), str(html)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    pages = {p.relative_to(html).as_posix() for p in html.rglob("*.html")}
    for page in ("installation", "quickstart", "guide/magics", "guide/ranks", "guide/keras",
                 "guide/failures", "architecture", "performance", "tutorials", "api"):  # fmt: skip
        assert f"{page}.html" in pages
    quickstart = (html / "tutorials" / "01_quickstart.html").read_text()
    assert "same final weights: True" in quickstart  # a stored output, rendered
    api = (html / "api.html").read_text()
    assert 'id="tnt_notebook.keras.model.Model.fit"' in api  # from the docstrings
    assert 'id="tnt_notebook.rank.api.allreduce"' in api


def test_the_configuration_page_lists_every_setting_as_declared():
    """docs/guide/configuration.md carries tnt_notebook.settings' own table, row for row."""
    from tnt_notebook import settings

    page = (DOCS / "guide" / "configuration.md").read_text()
    assert settings.markdown_table() in page, "regenerate it: python -m tnt_notebook.settings"

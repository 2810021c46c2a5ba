"""No import cycle among storage_backends' modules (issue 37: identity -> keys -> lmcache_keys -> identity was
one, made of imports inside functions, which is why every import counts here, at module level or not).

One deliberate exception: base.open_backend dispatches on the URL's scheme to the connector modules, which
subclass base.StorageBackend; its deferred imports of them are left out of the graph (EXEMPT)."""

from __future__ import annotations

import ast
from pathlib import Path

import storage_backends

PACKAGE = Path(storage_backends.__file__).parent
NAME = "storage_backends"
EXEMPT = {
    ("base", m)
    for m in ("local_connector", "redis_connector", "redis_cluster", "redis_sentinel", "s3_connector", "nixl_connector")
}


def _modules() -> dict[str, Path]:
    return {p.stem: p for p in sorted(PACKAGE.glob("*.py"))}


def _imports(path: Path, modules: set[str]) -> set[str]:
    """The package's modules that `path` imports anywhere in it ('__init__' for the package itself)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == NAME:
                    out.add(parts[1] if len(parts) > 1 else "__init__")
        elif isinstance(node, ast.ImportFrom):
            if node.level == 1:
                target = node.module
            elif node.level == 0 and node.module and node.module.split(".")[0] == NAME:
                target = node.module.partition(".")[2] or None
            else:
                continue
            if target:
                out.add(target.split(".")[0])
            else:  # `from . import x`: x is a module, or a name the package's __init__ gives
                out.update(a.name if a.name in modules else "__init__" for a in node.names)
    return out & modules


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    names = set(modules)
    return {m: {t for t in _imports(p, names) if t != m and (m, t) not in EXEMPT} for m, p in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of graph (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                return path[path.index(t) :] + [t]
            if t not in state and (found := visit(t)):
                return found
        state[m] = 2
        path.pop()
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_find_cycle_finds_the_old_circle_and_none_in_a_chain():
    old = {"identity": {"keys"}, "keys": {"lmcache_keys"}, "lmcache_keys": {"identity"}}
    assert find_cycle(old) == ["identity", "keys", "lmcache_keys", "identity"]
    assert find_cycle({"keys": {"identity", "lmcache_keys"}, "lmcache_keys": {"identity"}, "identity": set()}) is None


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "local_connector" in _imports(PACKAGE / "base.py", set(graph))  # open_backend's, inside the function
    assert {"identity", "lmcache_keys"} <= graph["keys"]


def test_storage_backends_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle among storage_backends modules: " + " -> ".join(cycle)

"""The modules a Python file imports, read from its source (no import runs), and the import graph of a package
built from them: tests/unit/test_layout.py checks that each level imports only the levels below it, and
tests/unit/test_storage_imports.py that a package's modules import no circle.

Every import counts, at module level or inside a function: issue 37's circle (identity -> keys -> lmcache_keys
-> identity) was made of imports inside functions."""

from __future__ import annotations

import ast
from pathlib import Path


def package_modules(folder: Path, name: str) -> dict[str, Path]:
    """Each module of the package in folder, imported as `name`, by its dotted name (a package's __init__.py
    by the package's own), in the order of their paths."""
    out = {}
    for path in sorted(folder.rglob("*.py")):
        parts = path.relative_to(folder).with_suffix("").parts
        parts = parts[:-1] if parts[-1] == "__init__" else parts
        out[".".join((name,) + parts)] = path
    return out


def imported(path: Path, module: str, known: set[str] | None = None) -> set[str]:
    """Every module the file `path` (the module named `module`) imports, top level and inside functions,
    relative imports resolved: `import a.b` and importlib.import_module("a.b") give a.b; `from a import b`
    gives a and a.b (b may be a module or a name a gives). With `known` (module names), `from a import b`
    gives a.b alone when it is one of them (a submodule), else a alone (a name a's own code gives)."""
    tree = ast.parse(path.read_text(), str(path))
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            names = {f"{target}.{a.name}" for a in node.names}  # `from . import rpc`
            if known is None:
                out |= {target} | names
            else:
                out |= {n if n in known else target for n in names}
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "import_module" and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and not arg.value.startswith("."):
                out.add(arg.value)
    return out


def import_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the other modules of `modules` (as package_modules gives them) that it imports."""
    names = set(modules)
    return {m: (imported(path, m, names) & names) - {m} for m, path in modules.items()}


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

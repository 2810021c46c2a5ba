"""Where things are, for tests that read the repository's own files or run its scripts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
K8S = ROOT / "k8s"
SUPPORT = ROOT / "tests" / "support"


def load_benchmark(name: str):
    """Import benchmarks/<name>.py as a module (the benchmarks are scripts, not a package)."""
    import sys

    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # the scripts import bench_paths, their sibling
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod

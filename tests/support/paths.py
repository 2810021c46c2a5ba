"""Where things are, for tests that read the repository's own files or run its scripts."""

from __future__ import annotations

import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
K8S = ROOT / "k8s"
SUPPORT = ROOT / "tests" / "support"


def load_benchmark(name: str):
    """benchmarks/<name>.py as the module benchmarks.<name> (the repository root is on sys.path under pytest:
    pyproject.toml's pythonpath)."""
    return importlib.import_module(f"benchmarks.{name}")

"""Import paths for the benchmark scripts.

A script run as a file (`python benchmarks/<script>.py`) first puts the repository root in place of its own
folder on sys.path (three lines at its top), so it imports `benchmarks.kit` and its sibling scripts as
`benchmarks.<name>`, as `python -m benchmarks.<script>` and the tests do. setup() then makes
`vericache_kernels` importable: installed, the kernels/ folder has that name; a bare copy of the tree (the GPU
machine has no pip install) gets it registered here from kernels/.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "results"


def setup() -> Path:
    """The repository root on sys.path and `vericache_kernels` importable; the root."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    if "vericache_kernels" not in sys.modules and importlib.util.find_spec("vericache_kernels") is None:
        spec = importlib.util.spec_from_file_location(
            "vericache_kernels", ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["vericache_kernels"] = module
        spec.loader.exec_module(module)
    return ROOT

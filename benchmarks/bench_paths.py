"""Import paths for the benchmark scripts (each does `import bench_paths` then calls setup()).

The repository root (the packages, when not installed), tests/support (the vLLM server launcher the
vLLM benchmarks share with the tests), and `vericache_kernels`: installed, the kernels/ folder has that
name; a bare copy of the tree (the GPU machine has no pip install) gets it registered here from kernels/.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def setup() -> Path:
    for path in (ROOT / "tests" / "support", ROOT):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))
    if "vericache_kernels" not in sys.modules and importlib.util.find_spec("vericache_kernels") is None:
        spec = importlib.util.spec_from_file_location(
            "vericache_kernels", ROOT / "kernels" / "__init__.py", submodule_search_locations=[str(ROOT / "kernels")]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["vericache_kernels"] = module
        spec.loader.exec_module(module)
    return ROOT

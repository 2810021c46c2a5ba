"""The fused CPU kernel of paged_packed.py: attention over a packed (quantized) paged prefix and a float paged
tail in ONE pass, each block's codes dequantized into an L1-sized buffer (never the whole prefix).

A small plain C++ file beside this one, _packed_cpu.cpp (no torch headers: it builds in ~2 s with g++ on 2 cores,
where a torch extension takes over a minute), compiled on first use into a per-user cache keyed by the source and
the compiler flags, and called through ctypes (the GIL is released; work is split over (row, KV head) on
std::threads). Flags: -O3 and, where the CPU has them, AVX2 / FMA / F16C (read from /proc/cpuinfo, never
-march=native, so a cache shared by two machines cannot hold a binary one of them cannot run). No compiler, an
unreadable source, or a failed build: available() is False (with one warning naming the reason) and the dispatch
runs the vectorized torch path instead.

Per (row b, KV head h): the G = Hq / Hkv query heads times the row's Lq queries are M query vectors (scaled by
sm_scale). For each prefix block: keys decoded to kT[D][bs] (tokens in a format-dependent order; the prefix
is fully visible, so token order within a block does not matter as long as keys and values agree), values to
vb[bs][D] (for KIVI in a channel order that makes the unpacking contiguous; the accumulator is put back in
channel order before the tail), scores for 16 tokens at a time in registers, one online-softmax update per
block (exp by a degree-6 polynomial: relative error ~1e-7). Then the tail blocks (float16 / bfloat16 /
float32 in vLLM's CPU layout) the same way, query i of Lq seeing tail entries j <= tail_len - Lq + i.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

FORMATS = {"kivi": 0, "int8": 1, "fp8": 2}
TAIL_DTYPES = {torch.float16: 0, torch.bfloat16: 1, torch.float32: 2}

SOURCE_PATH = Path(__file__).with_name("_packed_cpu.cpp")  # installed as package data (pyproject.toml)

_LOCK = threading.Lock()


def _cpu_flags() -> list[str]:
    if platform.machine() not in ("x86_64", "AMD64"):
        return []
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split("flags", 2)[1].split("\n", 1)[0].split())
    except (OSError, IndexError):
        return []
    return ["-mavx2", "-mfma", "-mf16c"] if {"avx2", "fma", "f16c"} <= flags else []


def _cache_dir() -> Path:
    root = os.environ.get("VERICACHE_KERNELS_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vericache_kernels"
    )
    return Path(root)


def build_flags() -> list[str]:
    return ["-O3", "-fno-math-errno", "-fPIC", "-shared", "-std=c++17", "-pthread", *_cpu_flags()]


@functools.lru_cache(maxsize=1)
def _library():
    """The compiled kernel (built once per source + flags), or the reason it is not there (a str)."""
    cxx = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
    if cxx is None:
        return "no C++ compiler (g++ / c++ / clang++) on PATH"
    try:
        source = SOURCE_PATH.read_text(encoding="utf-8")
    except OSError as e:
        return f"cannot read the kernel's source: {e}"
    flags = build_flags()
    key = hashlib.sha256((source + " ".join(flags) + cxx).encode()).hexdigest()[:16]
    lib = _cache_dir() / f"packed_attention-{key}.so"
    if not lib.is_file():
        try:
            lib.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
                src = Path(tmp) / "packed_attention.cpp"
                src.write_text(source, encoding="utf-8")
                so = Path(tmp) / lib.name
                p = subprocess.run([cxx, *flags, str(src), "-o", str(so)], capture_output=True, text=True, timeout=300)
                if p.returncode != 0:
                    return f"{cxx} failed: {p.stderr.strip()[-500:]}"
                os.replace(so, lib)  # atomic: another process building the same key gets a whole file
        except (OSError, subprocess.SubprocessError) as e:
            return f"build failed: {e}"
    try:
        dll = ctypes.CDLL(str(lib))
    except OSError as e:
        return f"cannot load {lib}: {e}"
    fn = dll.vc_packed_attention
    fn.restype = ctypes.c_int
    i, p = ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [
        p,
        p,
        p,
        i,
        i,
        i,
        i,
        i,
        i,
        i,
        i,
        i,
        i,
        p,
        p,
        p,
        p,
        p,
        p,
        p,
        p,
        i,
        p,
        p,
        i,
        p,
        p,
        i,
        i,
        ctypes.c_float,
        i,
    ]
    return fn


def available() -> bool:
    """True when the kernel is built (building it now if needed); a failed build warns once."""
    with _LOCK:
        lib = _library()
    if isinstance(lib, str):
        _warn_once(lib)
        return False
    return True


@functools.lru_cache(maxsize=1)
def _warn_once(reason: str) -> None:
    warnings.warn(
        f"the fused CPU packed-attention kernel is unavailable ({reason}): using the torch path", stacklevel=3
    )


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def attention(
    q: torch.Tensor,
    query_start_loc: torch.Tensor,
    fmt: str,
    k_bits: int,
    v_bits: int,
    k_group: int,
    v_group: int,
    block_size: int,
    cache: dict,
    prefix_lens: torch.Tensor,
    prefix_table: torch.Tensor,
    tail_k: torch.Tensor,
    tail_v: torch.Tensor,
    tail_lens: torch.Tensor,
    tail_table: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """q [N, Hq, D] float32 contiguous; every tensor contiguous on the CPU (paged_packed.py checks). -> [N, Hq, D]."""
    fn = _library()
    n, hq, d = q.shape
    hkv = tail_k.shape[1]
    out = torch.empty_like(q)
    idx = [x.to(torch.int32).contiguous() for x in (query_start_loc, prefix_lens, prefix_table, tail_lens, tail_table)]
    qsl, plen, ptab, tlen, ttab = idx
    fn(
        _ptr(q),
        _ptr(out),
        _ptr(qsl),
        prefix_lens.shape[0],
        hq,
        hkv,
        d,
        FORMATS[fmt],
        k_bits,
        v_bits,
        k_group,
        v_group,
        block_size,
        _ptr(cache["k"]),
        _ptr(cache["k_scale"]),
        _ptr(cache.get("k_mn")),
        _ptr(cache["v"]),
        _ptr(cache["v_scale"]),
        _ptr(cache.get("v_mn")),
        _ptr(plen),
        _ptr(ptab),
        ptab.shape[1] if ptab.dim() == 2 else 0,
        _ptr(tail_k),
        _ptr(tail_v),
        TAIL_DTYPES[tail_k.dtype],
        _ptr(tlen),
        _ptr(ttab),
        ttab.shape[1] if ttab.dim() == 2 else 0,
        tail_v.shape[2],
        float(sm_scale),
        max(1, torch.get_num_threads()),
    )
    return out

"""What the attention kernels reach on this machine, for the capacity model (engine/capacity.py).

On a GPU, decode attention is memory-bound: the roofline's bytes cover it. On a CPU its arithmetic is the cost:
a verification's x + 1 queries over a whole prompt of float KV, and a draft query's dequantization of packed codes
(KIVI 4-bit: 27 ms a row-step over 5.2k tokens here, where a full-KV row's float32 step reads the same prompt in
39 ms). A capacity model without these predicted 3.85x for kivi4 on the 2-core CPU where the run measured 0.78x,
so the planner never fell back. attention_rates times the kernels the serving engine calls, on random KV of the
model's shapes, and turns them into FLOP/s equivalents (4 Hq D FLOPs per query-key pair and layer).

    dense, draft = attention_rates(engine)          # engine: a ServingEngine (its compressor and pools' layout)
    hw = Hardware(..., attn_flops=dense, draft_attn_flops=draft)
"""

from __future__ import annotations

import time

import torch

import vericache_kernels.paged as PA
import vericache_kernels.paged_packed as PP


def _timed(fn, repeat: int, device: torch.device) -> float:
    """Best of `repeat` calls, seconds (the first call warms up: plans, a kernel build)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t)
    return best


@torch.inference_mode()
def attention_rates(
    engine, context: int = 4096, verify_queries: int = 16, rows: int = 4, repeat: int = 3
) -> tuple[float, float]:
    """(dense, draft) FLOP/s equivalents of one layer's attention as the serving engine runs it:
    dense: one verification's `verify_queries` queries over `context` entries of the full pool's dtype (paged);
    draft: `rows` rows of one query each over the compressed prompt as the draft pool holds it: packed codes and
    scales (KIVI / int8 / fp8, engine.packed) or the kept / decoded entries in the draft dtype."""
    if not (context >= 1 and verify_queries >= 1 and rows >= 1 and repeat >= 1):
        raise ValueError(
            f"need context, verify_queries, rows, repeat >= 1; got {context}, {verify_queries}, {rows}, {repeat}"
        )
    mc, cfg, dev = engine.model.cfg, engine.cfg, engine.model.device
    hq, hkv, d, bs = mc.num_heads, mc.num_kv_heads, mc.head_dim, cfg.block_size
    pair = 4 * hq * d  # FLOPs of one query against one key, one layer
    full_dtype = engine.model.dtype
    fmt = engine.packed or PP.PackedFormat("int8")  # only the tail is used where nothing is packed

    def dense_case(lens: list[int], queries: list[int], dtype: torch.dtype):
        q, qsl, _, _, _, _, tk, tv, tlen, ttab = PP.random_packed_case(
            fmt, [0] * len(lens), lens, queries, hq, hkv, d, bs, tail_dtype=dtype, seed=0
        )
        kv_dtype = str(dtype).removeprefix("torch.")
        args = (q.to(dtype).to(dev), tk.to(dev), tv.to(dev), qsl.to(dev), tlen.to(dev), ttab.to(dev), kv_dtype)
        return lambda: PA.paged_attention(*args, backend=cfg.backend)

    verify = dense_case([context], [verify_queries], full_dtype)
    dense = pair * verify_queries * context / _timed(verify, repeat, dev)
    keys = engine.compressor.keep_count(context) if hasattr(engine.compressor, "keep_count") else context
    if engine.packed is not None:
        q, qsl, f, cache, plen, ptab, tk, tv, tlen, ttab = PP.random_packed_case(
            engine.packed, [keys] * rows, [1] * rows, [1] * rows, hq, hkv, d, bs, torch.float16, seed=1
        )
        cache = {k: v.to(dev) for k, v in cache.items()}
        rest = [x.to(dev) for x in (q, qsl)], [x.to(dev) for x in (plen, ptab, tk, tv, tlen, ttab)]
        draft = lambda: PP.packed_paged_attention(*rest[0], f, cache, *rest[1], backend=cfg.backend)  # noqa: E731
    else:
        draft = dense_case([keys] * rows, [1] * rows, getattr(torch, cfg.draft_dtype))
    return dense, pair * rows * keys / _timed(draft, repeat, dev)


@torch.inference_mode()
def prefill_seconds(engine, context: int = 4096, repeat: int = 2) -> float:
    """What a VeriCache prefill adds to the prompt's forward, per request: every layer's compression into the draft
    pool's form (PromptPlacer.draft_side; packed blocks re-laid) and the copy of its full KV to the host tier, on
    random KV of the model's shapes. 0 for compressors that run the model on the prompt (kvpress presses): their
    cost is a forward, not measured here."""
    from .host_tier import to_host_blocks

    if getattr(engine.placer, "press", False) or engine.compressor is None:
        return 0.0
    mc, dev, bs = engine.model.cfg, engine.model.device, engine.cfg.block_size
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(mc.num_kv_heads, context, mc.head_dim, generator=g).to(dev, engine.model.dtype) for _ in "kv")
    obs = torch.randn(mc.num_heads, engine.cfg.obs_window, mc.head_dim, generator=g).to(dev, engine.model.dtype)
    ids = torch.randint(0, mc.vocab_size, (context,), generator=g).tolist()
    stored = context // bs * bs

    def one_layer():
        side, _ = engine.placer.draft_side(ids, 0, k, v, obs if engine.compressor.needs_queries else None)
        if side[0] == "packed" and side[2]:
            PP.to_blocks(engine.packed, {n: x for n, x in side[1].items() if not n.endswith("_tail")}, side[2], bs)
        to_host_blocks(k, v, stored, bs, engine.model.dtype, False)

    return mc.num_layers * _timed(one_layer, repeat, dev)

"""Capacity model of long-context serving (the paper's Pipeline 1), for GPUs: what an HBM budget admits, and the
host link. The model itself is vericache_connector/engine/capacity.py (the serving engine asks it whether
offloading pays before a VeriCache run); this file holds the figures it is applied to (GPUs, models, the
paper's measurements) and the tables cost_model.py --serving prints.

    full       B_f = floor(H / (T kv));  step_f = pass(W + B_f T kv, B_f);  thr_f = B_f / step_f
    VeriCache  B_v = floor((H - S) / (c T kv));  step_v = pass(W + B_v c T kv + (B_v / x) T kv, ...)
               thr_v = min(B_v / (x step_v), L / (r T kv)) * E(x)

GPU link rates are EFFECTIVE host-to-device rates of pinned copies: PCIe 5 x16 64 GB/s nominal, ~52 GB/s
reached (0.8); PCIe 4 x16 32 -> ~26; GH200's NVLink-C2C 450 GB/s per direction -> ~0.9 of it. Device figures
are the vendors' data-sheet values (dense bf16 FLOP/s, memory bandwidth and capacity).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass

from benchmarks.cost_model import Hardware, Model
from benchmarks.kit import paths
from benchmarks.kit.report import markdown

paths.setup()
from vericache_connector.engine import capacity as C  # noqa: E402

fit_alpha = C.fit_alpha
PCIE_EFF, C2C_EFF = 0.8, 0.9

# (memory bandwidth B/s, dense bf16 FLOP/s, memory bytes, effective host link B/s) per device
GPUS = {
    "H100 NVL": C.Hardware("H100 NVL (PCIe 5)", 3.9e12, 835e12, 94e9, 64e9 * PCIE_EFF),
    "H100": C.Hardware("H100 SXM 80GB (PCIe 5)", 3.35e12, 989e12, 80e9, 64e9 * PCIE_EFF),
    "H200": C.Hardware("H200 (PCIe 5)", 4.8e12, 989e12, 141e9, 64e9 * PCIE_EFF),
    "GH200": C.Hardware("GH200 144GB (NVLink-C2C)", 4.9e12, 989e12, 144e9, 450e9 * C2C_EFF),
    "L40S": C.Hardware("L40S (PCIe 4)", 0.864e12, 362e12, 48e9, 32e9 * PCIE_EFF),
    "RTX PRO 6000": C.Hardware("RTX PRO 6000 Blackwell (PCIe 5)", 1.79e12, 500e12, 96e9, 64e9 * PCIE_EFF),
}
# the paper's long-context serving figures (issue 27): Llama-3.1-70B on 2 x H100 NVL (TP 2), 32k-token contexts
PAPER = {
    "hardware": "H100 NVL",
    "devices": 2,
    "model": "llama-70b",
    "context": 32768,
    "full_tokens_per_s": 102.0,
    "alpha": 0.98,  # 23 of 30 drafts accepted per verification
    "sweep": {0.74: 1.61, 0.2: 2.71},  # compressed-KV budget (of the full KV) -> VeriCache / full KV
}
MODELS = {
    "llama-70b": Model("Llama-3.1-70B", 70.6e9, 80, 8, 128),
    "llama3-8b": Model("Llama-3-8B", 8.03e9, 32, 8, 128),
}


def tokens_per_verify(alpha: float, x: int) -> float:
    return C.expected_tokens(alpha, x)


@dataclass
class ServingPrediction:
    model: str
    hardware: str
    link_gbps: float
    context: int
    budget_gib: float
    compression: float
    alpha: float
    full_rows: int
    full_step_ms: float
    full_tokens_per_s: float
    vc_rows: int
    vc_horizon: int
    vc_step_ms: float
    vc_tokens_per_s: float
    link_bound: bool
    speedup: float
    compressor: str = ""
    reload_fraction: float = 1.0


def predict(
    hw: C.Hardware,
    m: Model,
    context: int,
    budget_bytes: float,
    compression: float,
    alpha: float,
    k_max: int = 64,
    max_rows: int = 256,
    reload_fraction: float = 1.0,
    compressor: str = "",
) -> ServingPrediction:
    wl = C.Workload(m.weight_bytes, m.params, m.kv_bytes_per_token, m.layers, context, budget_bytes, max_rows, k_max)
    p = C.predict(hw, wl, compression, alpha, reload_fraction)
    return ServingPrediction(
        m.name,
        hw.name + (f" x{hw.devices}" if hw.devices > 1 else ""),
        hw.link_bytes_per_s * hw.devices / 1e9,
        context,
        budget_bytes / 2**30,
        compression,
        alpha,
        p.full_rows,
        p.full_step_s * 1e3,
        p.full_tokens_per_s,
        p.vc_rows,
        p.vc_horizon,
        p.vc_step_s * 1e3,
        p.vc_tokens_per_s,
        p.link_bound,
        p.speedup,
        compressor,
        reload_fraction,
    )


def predict_serving(
    hw: Hardware,
    m: Model,
    link_bytes_per_s: float,
    context: int,
    budget_bytes: float,
    compression: float,
    alpha: float,
    k_max: int = 64,
    max_rows: int = 256,
) -> ServingPrediction:
    """The model on cost_model.py's Hardware / Model (tensor parallel: m.tp devices, link_bytes_per_s in all)."""
    dev = C.Hardware(hw.name, hw.hbm_bytes_per_s, hw.flops, hw.hbm_bytes, link_bytes_per_s / m.tp, m.tp)
    return predict(dev, m, context, budget_bytes, compression, alpha, k_max, max_rows)


def resident_fraction(spec: str, head_dim: int = 128, kv_elem_bytes: int = 2) -> tuple[float, float]:
    """(c, r) of a compressor as the serving engine holds it against a KV of kv_elem_bytes per element: c =
    resident bytes / full bytes (quantizers: their packed codes and scales, kernels/paged_packed.py; token
    dropping: the kept fraction), r = the fraction of the prompt a verification reloads (token dropping with a
    complement reload: the dropped fraction; everything else: 1)."""
    from vericache_connector.compressors import get_compressor
    from vericache_kernels.paged_packed import PackedFormat

    c = get_compressor(spec)
    meta = {"compressor": c.name, **{k: getattr(c, k, None) for k in ("bits", "group", "value_group")}}
    fmt = PackedFormat.from_meta(meta)
    full_block = 2 * head_dim * 128 * kv_elem_bytes  # one head, one layer, 128 tokens
    if fmt is not None:
        return fmt.block_bytes(1, head_dim, 128) / full_block, 1.0
    if hasattr(c, "keep_count"):
        keep = c.keep_count(32768) / 32768
        return keep, 1.0 - keep
    m = re.search(r"k(\d)v(\d)", spec) or re.search(r"(\d)$", spec)
    bits = sum(map(int, m.groups())) / len(m.groups()) if m else 8 * kv_elem_bytes
    return min(1.0, bits / (8 * kv_elem_bytes) * 1.1), 1.0  # other quantizers: their bits, ~10% for scales


def serving_table(preds: list[ServingPrediction]) -> str:
    header = "model | GPU | link GB/s | ctx | KV budget GiB | compressor | c | r | a | full rows | full tok/s | VC rows"
    header += " | x | VC tok/s | link-bound | **speedup**"
    rows = [
        [p.model, p.hardware, f"{p.link_gbps:g}", p.context, f"{p.budget_gib:.1f}", p.compressor or "-"]
        + [f"{p.compression:.3f}", f"{p.reload_fraction:.2f}", f"{p.alpha:.3f}", p.full_rows]
        + [f"{p.full_tokens_per_s:.0f}", p.vc_rows, p.vc_horizon, f"{p.vc_tokens_per_s:.0f}"]
        + ["yes" if p.link_bound else "no", f"**{p.speedup:.2f}x**"]
        for p in preds
    ]
    return markdown(header.split(" | "), "llrrrlrrrrrrrrlr", rows)


def budget_of(hw: C.Hardware, m: Model, usable: float = 0.9) -> float:
    """KV bytes left on the devices after the weights (usable: the share of memory a server gives KV + weights)."""
    return usable * hw.mem_bytes * hw.devices - m.weight_bytes


def paper_rows() -> tuple[list[dict], list[ServingPrediction]]:
    """The paper's figures next to the model's prediction for them."""
    hw = GPUS[PAPER["hardware"]]
    hw = C.Hardware(hw.name, hw.mem_bytes_per_s, hw.flops, hw.mem_bytes, hw.link_bytes_per_s, PAPER["devices"])
    m = MODELS[PAPER["model"]]
    budget, rows, preds = budget_of(hw, m), [], []
    for c, speedup in PAPER["sweep"].items():
        p = predict(hw, m, PAPER["context"], budget, c, PAPER["alpha"], compressor=f"budget {c:g}")
        preds.append(p)
        rows.append(
            {
                "budget": c,
                "paper_full_tokens_per_s": PAPER["full_tokens_per_s"],
                "predicted_full_tokens_per_s": p.full_tokens_per_s,
                "full_error": p.full_tokens_per_s / PAPER["full_tokens_per_s"] - 1,
                "paper_speedup": speedup,
                "predicted_speedup": p.speedup,
                "speedup_error": p.speedup / speedup - 1,
            }
        )
    return rows, preds


def as_dict(p: ServingPrediction) -> dict:
    d = asdict(p)
    d["speedup"] = p.speedup if math.isfinite(p.speedup) else None
    return d

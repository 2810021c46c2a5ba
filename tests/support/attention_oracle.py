"""An independent attention oracle shared by the kernel tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def oracle(q, k, v, kt, vt):
    """float64 SDPA over cat(prefix, tail) with repeated KV heads and an explicit mask
    (prefix always visible; query i, the (Lt-Lq+i)-th tail token, sees tail j <= Lt - Lq + i)."""
    hq, lq = q.shape[-3], q.shape[-2]
    kk, vv = torch.cat([k, kt], -2).double(), torch.cat([v, vt], -2).double()
    rep = hq // k.shape[-3]
    kk, vv = kk.repeat_interleave(rep, -3), vv.repeat_interleave(rep, -3)
    t, lt = k.shape[-2], kt.shape[-2]
    mask = torch.ones(lq, t + lt, dtype=torch.bool)
    for i in range(lq):
        for j in range(lt):
            mask[i, t + j] = j <= lt - lq + i
    return F.scaled_dot_product_attention(q.double(), kk, vv, attn_mask=mask)

"""Draft weights: the weights the DRAFT forward runs (the verify pass always runs the model's own).

A decode step reads every weight once (~540 MB in float32 for SmolLM2-135M, more than an 8k-token KV),
so on a compressed KV the weights dominate the draft step. Drafts only steer what the verify pass
checks, so they may come from cheaper weights without touching the output:

  "model"     the model itself
  "bfloat16"  a bfloat16 copy
  "int8"      gpt-fast's weight-only int8: every linear layer (lm_head included) as int8 codes with one
              scale per output channel, W[o, i] ~= scale[o] * code[o, i], scale[o] = max_i |W[o, i]| / 127,
              so x @ W^T = (x @ code^T) * scale; activations in bfloat16. On the CPU the product is
              torch._weight_int8pack_mm (dequantizes in registers: a quarter of the float32 bytes;
              it needs in_features % 32 == 0, other shapes run the same math in float).

Both copies use bfloat16 activations; the draft cache then holds bfloat16 entries where it keeps the
model's dtype. VeriCache's output is unchanged (verify on the full model + full KV); only the number
of drafts accepted per verification can move.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

Tensor = torch.Tensor
WEIGHTS = ("model", "bfloat16", "int8")


class Int8Linear(nn.Module):
    """A linear layer with weight-only int8 codes and per-output-channel scales (no float copy kept)."""

    def __init__(self, linear: nn.Linear, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        self.register_buffer("code", torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8))
        self.register_buffer("scale", scale.to(dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().to(dtype))

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(self.scale.dtype)
        if x2.device.type == "cpu" and shape[-1] % 32 == 0:  # the CPU op needs in_features % 32 == 0
            y = torch._weight_int8pack_mm(x2.contiguous(), self.code, self.scale)
        else:  # reference: the same math in float
            y = (x2.float() @ self.code.float().t() * self.scale.float()).to(self.scale.dtype)
        y = y.view(*shape[:-1], -1)
        return y if self.bias is None else y + self.bias


def _swap_linears(module: nn.Module, dtype: torch.dtype) -> None:
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, Int8Linear(child, dtype))
        else:
            _swap_linears(child, dtype)


def make_draft_model(model, weights: str = "model"):
    """The model the draft steps run: `model` itself for "model", else a converted copy (see above)."""
    if weights not in WEIGHTS:
        raise ValueError(f"draft weights must be one of {WEIGHTS}, got {weights!r}")
    if weights == "model":
        return model
    dtype = torch.bfloat16
    draft = copy.deepcopy(model)
    if weights == "int8":
        _swap_linears(draft, dtype)  # quantize from the float32 originals, then convert the rest
    draft.to(dtype)
    draft.inv_freq = model.inv_freq  # rotary frequencies stay float32 (positions up to 8k)
    return draft.eval()

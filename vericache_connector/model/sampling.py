"""Acceptance rules of speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

Greedy: draft token d_i is accepted while it equals argmax of the full-KV logits at its position; the
first mismatch is replaced by that argmax (the "bonus"), so the output is exactly full-KV greedy.

Sampling at temperature T: with target p_i = softmax(z_full_i / T) and draft q_i = softmax(z_draft_i / T),
accept d_i with probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample from the residual
norm(max(p_i - q_i, 0)); if all k are accepted, sample a bonus from p_{k+1}. Every emitted token is then
distributed exactly as under p (the full-KV model), whatever q is.
"""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def probs(logits: Tensor, temperature: float) -> Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


def accept_greedy(draft: Tensor, target_logits: Tensor) -> tuple[Tensor, Tensor]:
    """draft [B, k], target_logits [B, k+1, V] -> (n accepted [B], bonus token [B])."""
    target = target_logits.argmax(-1)  # [B, k+1]
    match = (draft == target[:, :-1]).long()
    n = match.cumprod(-1).sum(-1)  # leading matches
    bonus = target.gather(1, n[:, None])[:, 0]
    return n, bonus


def accept_sampling(draft: Tensor, q: Tensor, p: Tensor, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """draft [B, k], q [B, k, V] draft probs, p [B, k+1, V] target probs -> (n [B], bonus [B])."""
    b, k = draft.shape
    p_d = p[:, :k].gather(-1, draft[..., None])[..., 0]  # p_i(d_i)
    q_d = q.gather(-1, draft[..., None])[..., 0]  # q_i(d_i)
    u = torch.rand(b, k, generator=generator, device=draft.device)
    accepted = (u * q_d < p_d).long()  # u < p/q without dividing by 0
    n = accepted.cumprod(-1).sum(-1)
    rows = torch.arange(b, device=draft.device)
    p_n = p[rows, n]  # [B, V]
    q_n = torch.cat([q, torch.zeros_like(q[:, :1])], 1)[rows, n]  # q_{k+1} := 0 -> residual = p
    residual = (p_n - q_n).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_n)  # p == q: any sample of p
    bonus = torch.multinomial(residual, 1, generator=generator)[:, 0]
    return n, bonus


def sample(logits: Tensor, temperature: float, generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
    """logits [B, V] -> (token [B], probs [B, V] or None when greedy)."""
    if temperature <= 0:
        return logits.argmax(-1), None
    pr = probs(logits, temperature)
    return torch.multinomial(pr, 1, generator=generator)[:, 0], pr

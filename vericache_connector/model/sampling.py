"""The lossless rule, in one place: which drafts the full KV accepts (`verify`), which tokens a request
emits (`emit`), and the settings every decode loop shares (`DecodeSettings`).

Every decode loop calls these: VeriCacheEngine's speculative loop (engine/speculative.py), the serving
engine's verify step (engine/executor.py), the remote verifier (remote/verifier.py, remote/openai_verifier.py)
and the remote drafter (remote/drafter.py). vLLM's proposer is verified by vLLM's own rejection sampler.

verify (Leviathan et al. 2023; Chen et al. 2023), drafts d_1..d_k and the full-KV logits z_0..z_k at the
positions before each draft and after the last one:
  greedy       d_i is accepted while it equals argmax z_{i-1}; the first mismatch is replaced by that argmax
               (the correction), or, all k accepted, argmax z_k follows (the bonus). The output is exactly
               full-KV greedy.
  temperature  with p_i = softmax(z_{i-1} / T) and the draft's q_i = softmax(z_draft / T), accept d_i with
               probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection sample the residual
               norm(max(p_i - q_i, 0)); all accepted: sample the bonus from p_{k+1}. Every emitted token is
               then distributed exactly as under p (the full-KV model), whatever q is.
Either way one forward over the full KV verifies all k drafts and yields one more token: n + 1 tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Tensor = torch.Tensor


@dataclass(kw_only=True)
class DecodeSettings:
    """What every decode loop shares: the draft horizon's bounds, the sampling temperature and whether EOS
    ends a request. DecodeConfig (engine/speculative.py, one request or a static batch) and ServingConfig
    (engine/config.py, continuous batching) extend it with their own knobs and defaults."""

    k_min: int = 2  # fewest drafts per verification
    k_max: int = 32  # most drafts per verification
    temperature: float = 0.0  # 0 = greedy
    stop_at_eos: bool = True  # an EOS token ends the request (it is emitted)

    def __post_init__(self):
        for name in ("k_min", "k_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
        if not 1 <= self.k_min <= self.k_max:
            raise ValueError(f"need 1 <= k_min <= k_max, got k_min={self.k_min}, k_max={self.k_max}")
        t = self.temperature
        if isinstance(t, bool) or not (isinstance(t, (int, float)) and math.isfinite(t) and t >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {t!r}")


def probs(logits: Tensor, temperature: float) -> Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample(logits: Tensor, temperature: float, generator: torch.Generator | None) -> tuple[Tensor, Tensor | None]:
    """One token per row from logits [B, V] -> (token [B], its distribution q [B, V], or None when greedy).
    What a draft step and a plain decoding step draw; the q of a draft goes to `verify`."""
    if temperature <= 0:
        return logits.argmax(-1), None
    pr = probs(logits, temperature)
    return torch.multinomial(pr, 1, generator=generator)[:, 0], pr


def verify(
    drafts: Tensor,
    target: Tensor,
    temperature: float = 0.0,
    q: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor]:
    """THE accept rule. drafts [B, k] (k may be 0); target: the full-KV logits [B, k + 1, V] at the
    positions before d_1 .. after d_k, or, greedy only, their argmax tokens [B, k + 1] (a server that answers
    its top token per position, e.g. vLLM's prompt_logprobs); q [B, k, V]: the drafts' probabilities
    (temperature > 0). -> (n [B]: leading drafts accepted, token [B]: the correction or the bonus after them)."""
    b, k = drafts.shape
    if temperature <= 0:
        best = target if target.dim() == 2 else target.argmax(-1)  # [B, k + 1]
        n = (drafts == best[:, :k]).long().cumprod(-1).sum(-1)  # leading matches
        return n, best.gather(1, n[:, None])[:, 0]
    if target.dim() != 3:
        raise ValueError(f"sampling needs the target logits [B, k+1, V], got shape {tuple(target.shape)}")
    p = probs(target, temperature)  # [B, k + 1, V]
    if q is None:
        if k:
            raise ValueError(f"sampling {k} drafts needs their probabilities q")
        q = p.new_zeros(b, 0, p.shape[-1])
    p_d = p[:, :k].gather(-1, drafts[..., None])[..., 0]  # p_i(d_i)
    q_d = q.gather(-1, drafts[..., None])[..., 0]  # q_i(d_i)
    u = torch.rand(b, k, generator=generator, device=drafts.device)
    n = (u * q_d < p_d).long().cumprod(-1).sum(-1)  # u < p/q without dividing by 0
    rows = torch.arange(b, device=drafts.device)
    p_n = p[rows, n]  # [B, V]
    q_n = torch.cat([q, q.new_zeros(b, 1, q.shape[-1])], 1)[rows, n]  # q_{k+1} := 0 -> the residual is p
    residual = (p_n - q_n).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_n)  # p == q: any sample of p
    return n, torch.multinomial(residual, 1, generator=generator)[:, 0]


def emit(out: list[int], tokens, max_new_tokens: int, eos=(), stop_at_eos: bool = True) -> bool:
    """THE emit rule: append `tokens` to a request's output up to its budget of max_new_tokens and through
    its first EOS (when stop_at_eos); what lies past either is dropped. True when the request is done."""
    for t in map(int, tokens):
        out.append(t)
        if len(out) >= max_new_tokens or (stop_at_eos and t in eos):
            return True
    return False


def top_token(entry: dict) -> int:
    """A server's greedy token at one position, from its prompt_logprobs entry {token_id: {logprob, rank, ...}}:
    the rank-1 token (ties: the lowest id, as torch.argmax picks). What `verify` is handed as the argmax of
    the full KV when the full KV lives in a vLLM server (remote/openai_verifier.py, router/upstream.py)."""
    top = [int(t) for t, v in entry.items() if v.get("rank") == 1]
    if not top:
        raise ValueError("a prompt_logprobs entry without a rank-1 token")
    return min(top)

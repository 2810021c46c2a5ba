"""A request of a serving trace and its state while the engine serves it (nano-vllm's Sequence).

A Sequence moves through phases; a VeriCache row cycles DRAFTING -> (RELOADING) -> VERIFYING -> DRAFTING:

  WAITING     arrived, not admitted (its blocks do not fit the device budget yet)
  PREFILL     admitted; the next step computes its prompt
  DECODING    full KV / lossy: one token per step
  DRAFTING    VeriCache: one draft token per step on the compressed KV
  RELOADING   VeriCache: drafted its horizon; its full prompt KV is coming over the host link (it keeps
              drafting meanwhile, up to k_max)
  VERIFYING   VeriCache: in this step's verify forward
  FINISHED    max_new_tokens emitted or EOS

Token bookkeeping (VeriCache, as in speculative.py): `pending` is the newest emitted token, whose KV is
in no cache yet; the full KV holds prompt + emitted-but-pending (its length is also pending's position);
the draft cache holds the compressed prompt + the same emitted tokens (exact KV) + this round's drafts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch


@dataclass
class Request:
    """One entry of a serving trace."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_s: float = 0.0  # seconds after the trace starts
    seed: int = 0  # sampling seed (temperature > 0)

    def __post_init__(self):
        if not self.prompt_ids:
            raise ValueError(f"request {self.request_id!r}: empty prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"request {self.request_id!r}: max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.arrival_s >= 0:
            raise ValueError(f"request {self.request_id!r}: arrival_s must be >= 0, got {self.arrival_s}")


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODING = "decoding"
    DRAFTING = "drafting"
    RELOADING = "reloading"
    VERIFYING = "verifying"
    FINISHED = "finished"


@dataclass
class Sequence:
    request: Request
    phase: Phase = Phase.WAITING
    output: list[int] = field(default_factory=list)
    pending: int = -1  # newest emitted token (its KV is in no cache yet)
    full_len: int = 0  # entries of the full KV (prompt + emitted tokens but pending)
    draft_len: int = 0  # entries of the draft cache (compressed prompt + emitted + drafts)
    drafts: list[int] = field(default_factory=list)
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # q_i per draft (temperature > 0)
    horizon: int = 0  # drafts wanted before this round's verification
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verification
    alpha: float | None = None  # estimated per-draft acceptance probability (VeriCache)
    blocks: dict[str, list[int]] = field(default_factory=dict)  # pool name -> block ids (resident)
    staging: list[int] = field(default_factory=list)  # full-pool blocks holding the reloaded prompt
    reload: object | None = None  # host_tier.Reload while the prompt's full KV is coming in
    verify_step: int | None = None  # planned step of the next verification
    generator: torch.Generator | None = None
    admitted_s: float | None = None
    first_token_s: float | None = None
    finished_s: float | None = None
    stored_prompt: int = 0  # prompt tokens held in the host tier (whole blocks)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_len(self) -> int:
        return len(self.request.prompt_ids)

    @property
    def remaining(self) -> int:
        return self.request.max_new_tokens - len(self.output)

    def emit(self, tokens: list[int], eos: tuple[int, ...], stop_at_eos: bool, now_s: float) -> bool:
        """Append tokens up to the budget / first EOS; True (and FINISHED) when the sequence is done."""
        for t in tokens:
            self.output.append(int(t))
            if self.first_token_s is None:
                self.first_token_s = now_s
            if len(self.output) >= self.request.max_new_tokens or (stop_at_eos and t in eos):
                self.phase, self.finished_s = Phase.FINISHED, now_s
                return True
        return False

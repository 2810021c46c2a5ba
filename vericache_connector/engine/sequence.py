"""A request of a serving trace and its state while the engine serves it (nano-vllm's Sequence).

A Sequence moves through phases; a VeriCache row cycles DRAFTING -> (RELOADING) -> VERIFYING -> DRAFTING:

  WAITING     arrived, not admitted (its blocks do not fit the device budget yet)
  PREFILL     admitted; the next step computes its prompt
  DECODING    full KV / lossy: one token per step
  DRAFTING    VeriCache: one draft token per step on the compressed KV
  RELOADING   VeriCache: drafted its horizon; its full prompt KV is coming over the host link (it keeps
              drafting meanwhile, up to k_max)
  VERIFYING   VeriCache: in this step's verify forward
  PAUSED      VeriCache, losing to full KV: its compressed KV freed to make room for a row moving to full KV; it
              resumes on full KV itself (its prompt reloaded from the host tier; moves.py)
  FINISHED    max_new_tokens emitted or EOS

Token bookkeeping (VeriCache, as in speculative.py): `pending` is the newest emitted token, whose KV is
in no cache yet; the full KV holds prompt + emitted-but-pending (its length is also pending's position);
the draft cache holds the compressed prompt + the same emitted tokens (exact KV) + this round's drafts. A
quantized prompt is split: its codes in the packed pool (packed_len entries), the rest (KIVI's full-precision
residual) at the start of the draft pool's view, so draft_len counts the draft pool's entries only.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

import torch

from ..model.sampling import emit
from .host_tier import HostEntry


@dataclass
class Request:
    """One entry of a serving trace."""

    request_id: str
    prompt_ids: list[int]
    max_new_tokens: int
    arrival_s: float = 0.0  # seconds after the trace starts
    seed: int = 0  # sampling seed (temperature > 0)

    def __post_init__(self):
        """Every field checked before the engine allocates anything for the request (ids against the vocabulary
        and the context: ServingEngine.run, which knows the model)."""
        rid = self.request_id
        if not isinstance(rid, str) or not rid:
            raise ValueError(f"request_id must be a non-empty string, got {rid!r}")
        if not isinstance(self.prompt_ids, list) or not self.prompt_ids:
            raise ValueError(f"request {rid!r}: prompt_ids must be a non-empty list of token ids")
        bad = next((t for t in self.prompt_ids if not _is_int(t) or t < 0), None)
        if bad is not None:
            raise ValueError(f"request {rid!r}: prompt_ids holds {bad!r}, not a token id (an integer >= 0)")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"request {rid!r}: max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        a = self.arrival_s
        if isinstance(a, bool) or not (isinstance(a, (int, float)) and math.isfinite(a) and a >= 0):
            raise ValueError(f"request {rid!r}: arrival_s must be a finite number >= 0, got {a!r}")
        if not _is_int(self.seed):
            raise ValueError(f"request {rid!r}: seed must be an integer, got {self.seed!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODING = "decoding"
    DRAFTING = "drafting"
    RELOADING = "reloading"
    VERIFYING = "verifying"
    PAUSED = "paused"
    FINISHED = "finished"


@dataclass
class Sequence:
    request: Request
    phase: Phase = Phase.WAITING
    output: list[int] = field(default_factory=list)
    pending: int = -1  # newest emitted token (its KV is in no cache yet)
    full_len: int = 0  # entries of the full KV (prompt + emitted tokens but pending)
    draft_len: int = 0  # entries of the draft pool's view (compressed prompt or its float part + emitted + drafts)
    packed_len: int = 0  # entries of the compressed prompt held packed (the packed pool; quantizers)
    drafts: list[int] = field(default_factory=list)
    draft_probs: list[torch.Tensor] = field(default_factory=list)  # q_i per draft (temperature > 0)
    horizon: int = 0  # drafts wanted before this round's verification
    accepted: list[int] = field(default_factory=list)  # drafts accepted per verification
    drafted: list[int] = field(default_factory=list)  # drafts verified per verification
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
    host: HostEntry | None = None  # VeriCache: those blocks' full KV in host memory
    staging_ring: int = 0  # layers of the staging blocks live at once
    ngram: object | None = None  # draft.ngram.NgramIndex over prompt + output (ServingConfig.ngram)
    proposal: list[int] = field(default_factory=list)  # n-gram tokens the next draft step feeds
    ngram_drafted: int = 0  # drafts that came from the n-gram source
    full_kv: bool = False  # decoding on its whole full KV: admitted so, or switched there (moves.py)
    switched_s: float | None = None  # when a VeriCache row went on on its full KV
    switched_by: str | None = None  # "tail" (the trace's tail) or "guard" (moves.py)
    moving: bool = False  # moves.py picked it: its next verification keeps its full KV
    arrival_s: float = -1.0  # when it arrived, engine clock (the request's arrival_s, or when it was added)

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
        """The emit rule (model/sampling.emit) with timestamps; True (and FINISHED) when the sequence is done."""
        done = emit(self.output, tokens, self.request.max_new_tokens, eos, stop_at_eos)
        if self.output and self.first_token_s is None:
            self.first_token_s = now_s
        if done:
            self.phase, self.finished_s = Phase.FINISHED, now_s
        return done

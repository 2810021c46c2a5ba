"""The drafter's side of a disaggregated hit: draft on the compressed copy, have the verifier check the
drafts on the full KV it loaded next to the store, and keep drafting while each call is in flight.

The request's sequence is S = prompt + emitted + spec: `emitted` are verified tokens, `spec` the drafts
beyond them (spec[0] is the drafter's own guess of the next token). The draft cache holds the KV of
S[:cached] (the compressed stored prefix counts as its `stored` tokens); a draft step feeds S[cached:]
(one token in steady state) and appends its argmax (or a sample of q) to spec.

A call sends d = spec[:x] after prompt + emitted; while it is in flight the drafter drafts on, assuming
all x are accepted. The answer (n, t) makes emitted += d[:n] + [t]. If n == x and the next draft spec[x]
equals t, everything drafted ahead stays valid and goes out with the next call at once; otherwise spec
is dropped and the draft cache rolled back to prompt + emitted (only `lengths` moves). So one round costs
    cycle = max(x * T_draft_step, RTT + T_verify(x))
instead of x * T_draft_step + RTT + T_verify(x), and the full KV never crosses the drafter's slow link.

When does a call go out, and with how many drafts? model/draft_rule.py's DraftRule, the router's too. Our
verifier keeps the request's full KV resident, so a call costs it one short forward (batched with other
drafters' calls): a call goes out as soon as the previous answer is in and k_min drafts are ready, with all of
them (up to k_cap), so little is drafted in vain (measured: 1.17-1.38 draft steps per emitted token with calls
of 16, about 1.0 this way). A vLLM verifier (openai_verifier.py) prefills the whole sequence per call: it gets
calls of draft_k. The drafter drafts on until the budget, k_cap or an EOS stops it (can_draft).
The first call (no drafts) goes out before the compressed copy is even fetched: the verifier loads the
full copy over its fast link meanwhile and answers the first token.

Any verifier fault (down, slow, refused, garbage) raises VerifierFault with the tokens verified so far;
RemotePrefixCache then fetches the full copy itself and finishes the request locally.
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass, field

import torch

from ..engine.speculative import DecodeConfig, SpecStats
from ..model.draft_rule import DraftRule
from ..model.sampling import emit, probs
from . import rpc
from .client import VerifierClient

logger = logging.getLogger("vericache.remote")


class VerifierFault(Exception):
    def __init__(self, emitted: list[int], cause: BaseException):
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.emitted, self.cause = emitted, cause


@dataclass
class Verified:
    tokens: list[int]
    stats: SpecStats
    first_draft_t: float | None = None
    first_token_t: float | None = None
    calls: int = 0
    drafted: int = 0  # draft steps run (tokens drafted, including those thrown away)
    batched: list[int] = field(default_factory=list)  # rows of the verifier forward behind each answer


class VerifiedDecode:
    """One request's pipeline. open() sends the first call; run() drafts and verifies to the end."""

    def __init__(
        self, client: VerifierClient, model_name: str, prompt: list[int], stored: int, decode: DecodeConfig, model_cfg
    ):
        self.client, self.model_name, self.prompt, self.stored = client, model_name, list(prompt), stored
        self.decode, self.vocab, self.eos = decode, model_cfg.vocab_size, model_cfg.eos_token_ids
        self.request = uuid.uuid4().hex[:16]
        self.seq = -1
        self.emitted: list[int] = []
        self.done = False
        self.sent: int | None = None  # drafts in the call in flight

    def _send(self, drafts: list[int], q: bytes = b"", timeout_s: float | None = None) -> None:
        self.seq += 1
        d = self.decode
        self.client.send(
            rpc.Verify(
                self.model_name,
                self.request,
                self.seq,
                self.prompt,
                self.stored,
                list(self.emitted),
                drafts,
                d.max_new_tokens,
                float(d.temperature),
                int(d.seed or 0),
                q,
            ),
            timeout_s,
        )
        self.sent = len(drafts)

    def open(self, timeout_s: float | None = None) -> None:
        """The first call (no drafts): the verifier starts loading the full KV and answers the first token
        (timeout_s: for this call, which waits for that load; None: the client's per-call timeout)."""
        self._send([], b"", timeout_s)

    def abandon(self) -> None:
        self.client.release(self.request)

    @torch.inference_mode()
    def run(self, model, draft) -> Verified:
        try:
            return self._run(model, draft)
        except rpc.VerifierError as e:
            raise VerifierFault(list(self.emitted), e) from e
        finally:
            self.abandon()

    def _run(self, model, draft) -> Verified:
        d, dev = self.decode, model.device
        gen = d.generator()
        prompt, P, stored = self.prompt, len(self.prompt), self.stored
        c0 = draft.lengths.clone()  # the compressed prefix: `stored` tokens
        spec: list[int] = []
        qs: list[torch.Tensor] = []
        cached = stored
        out = Verified([], SpecStats(accepted=[[]]))
        rule = DraftRule.of(d.k_min, d.k_max, d.draft_k, self.client.cheap_calls, most=rpc.MAX_DRAFTS)

        def tail(start: int) -> list[int]:  # S[start:]
            rest = self.emitted + spec
            return (prompt[start:] + rest) if start < P else rest[start - P :]

        def can_draft() -> bool:
            full = len(self.emitted) + len(spec) >= d.max_new_tokens or len(spec) >= rule.k_cap
            return not full and not (d.stop_at_eos and spec and spec[-1] in self.eos)

        while not self.done:
            budget = d.max_new_tokens - len(self.emitted)
            if self.sent is None and rule.ready(spec, budget, can_draft(), self.eos, d.stop_at_eos):
                x = rule.count(spec, budget, self.eos, d.stop_at_eos)
                q = torch.stack(qs[:x]).numpy().astype("<f4").tobytes() if d.temperature > 0 and x else b""
                self._send(spec[:x], q)
            drafting = can_draft()
            if self.sent is not None:
                t_wait = time.perf_counter()
                answer = self.client.poll(0.0 if drafting else 3600.0)
                out.stats.verify_s += time.perf_counter() - t_wait
                if answer is not None:
                    cached = self._take(answer, spec, qs, cached, out)
                    draft.lengths = c0 + (cached - stored)
                    continue
            if drafting:
                t_draft = time.perf_counter()
                feed = tail(cached)
                pos = torch.arange(cached, cached + len(feed), device=dev)[None]
                logits, _ = model(torch.tensor([feed], device=dev), pos, draft, last_only=True)
                if d.temperature > 0:
                    q = probs(logits[0, -1], d.temperature)
                    tok = int(torch.multinomial(q, 1, generator=gen)[0])
                    qs.append(q.cpu())
                else:
                    tok = int(logits[0, -1].argmax())
                cached += len(feed)
                spec.append(tok)
                out.drafted += 1
                out.first_draft_t = out.first_draft_t or time.perf_counter()
                out.stats.draft_s += time.perf_counter() - t_draft
        out.tokens = list(self.emitted)
        return out

    def _take(self, answer, spec: list[int], qs: list, cached: int, out: Verified) -> int:
        """Apply a verdict; returns the draft cache's new `cached` (the common prefix of old and new S)."""
        if not isinstance(answer, rpc.Verdict):
            raise rpc.BadAnswer(f"expected a verdict, got {type(answer).__name__}")
        x, n, t = self.sent, answer.accepted, answer.token
        if not (0 <= n <= x and 0 <= t < self.vocab):
            raise rpc.BadAnswer(
                f"verdict accepted={n} token={t} does not fit a call of {x} drafts (vocab {self.vocab})"
            )
        self.sent = None
        out.calls += 1
        out.batched.append(answer.batch)
        out.stats.accepted[0].append(n)
        out.stats.draft_lengths.append(x)
        base = len(self.prompt) + len(self.emitted)
        keep_ahead = n == x and len(spec) > x and spec[x] == t
        common = base + len(spec) if keep_ahead else base + n
        new = spec[:n] + [t]
        del spec[: x + 1 if keep_ahead else len(spec)]
        del qs[: x + 1 if keep_ahead else len(qs)]
        self.done = emit(self.emitted, new, self.decode.max_new_tokens, self.eos, self.decode.stop_at_eos)
        out.first_token_t = out.first_token_t or time.perf_counter()
        return min(cached, common)

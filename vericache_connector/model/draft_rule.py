"""When a drafter sends its drafts for verification, and how many: one rule for every drafter that drafts on
while its verify call is in flight (remote/drafter.py: VerifiedDecode over ZeroMQ; router/decode.py: the
router's loop over a drafter-role vLLM server), beside the accept and emit rules (sampling.py).

A request's sequence is S = prompt + emitted + spec: `emitted` verified, `spec` the drafts beyond them, and
`budget` the tokens it may still emit. Every draft made after a rejected one, before the drafter hears of
the rejection, is thrown away: (drafts waiting for a call + those drafted while it is in flight) per
rejection. So, with no call in flight, a call goes out as soon as

    len(spec) >= min(send_at, budget - 1)   enough drafts are ready (a call always emits one token more)
    or no more drafts are coming            the drafter cannot or will not draft further
    or spec holds an EOS                    nothing past it is ever emitted
    or len(spec) >= k_cap                   as many as a call carries

with all of spec, but at most budget - 1 and k_cap, and through its first EOS. `send_at` is k_min where a
call is cheap for the verifier (it keeps the request's KV: one short forward over the uncached tail, so x
follows the round trip: a slow verifier gets fewer, larger calls, and little is drafted in vain) and draft_k
where each call prefills the whole sequence (a vLLM verifier through prompt logprobs). k_cap is the most a
call carries and the most drafted ahead of the verified tokens: max(k_max, draft_k), under the transport's
own limit where it has one.
"""

from __future__ import annotations

from dataclasses import dataclass


def eos_ahead(spec: list[int], eos, stop_at_eos: bool = True) -> bool:
    """An EOS among the drafts (when EOS ends the request): nothing past it is ever emitted."""
    return stop_at_eos and any(t in eos for t in spec)


@dataclass(frozen=True)
class DraftRule:
    send_at: int  # drafts ready before a call goes out
    k_cap: int  # the most drafts a call carries, and the most drafted ahead of the verified tokens

    def __post_init__(self):
        for name in ("send_at", "k_cap"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")

    @classmethod
    def of(cls, k_min: int, k_max: int, draft_k: int, cheap_calls: bool, most: int | None = None) -> "DraftRule":
        """cheap_calls: the verifier keeps the request's KV (a call is a short forward); most: the transport's
        limit on drafts per call (None: none)."""
        cap = max(k_max, draft_k)
        return cls(k_min if cheap_calls else draft_k, cap if most is None else min(cap, most))

    def ready(self, spec: list[int], budget: int, more_coming: bool, eos=(), stop_at_eos: bool = True) -> bool:
        """Whether a call goes out now (none in flight); more_coming: the drafter drafts on past spec."""
        return (
            len(spec) >= min(self.send_at, budget - 1)
            or not more_coming
            or eos_ahead(spec, eos, stop_at_eos)
            or len(spec) >= self.k_cap
        )

    def count(self, spec: list[int], budget: int, eos=(), stop_at_eos: bool = True) -> int:
        """How many of spec the call carries: all, but at most budget - 1 and k_cap, and through the first EOS."""
        x = min(len(spec), budget - 1, self.k_cap)
        if stop_at_eos:
            x = min(x, next((i + 1 for i, t in enumerate(spec) if t in eos), x))
        return max(0, x)

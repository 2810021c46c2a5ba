"""How many requests a verifier decodes by itself at a time (the router's path "direct"), sized from what the
router measures.

A request decoded on a verifier directly (its greedy output is the answer, its full copy loads beside the
store) competes for the verifier's compute with the verify calls of the drafted requests. Which is faster
depends on the cores: where the drafters are the bottleneck and the verifier idles, direct requests are faster
(measured on the 2-core machine: 75-123 ms a token direct against 221-350 ms drafted at concurrency 4-8); where
the verifier serves many far nodes, drafting is. So the number of direct slots moves with what the finished
requests measured, each as its tokens over its seconds (first token included: both count in throughput):

    a direct request finishes about as fast as the drafted ones go (EMA) or faster -> one more slot (up to
                                                                                       `most`)
    the direct requests' rate (EMA) falls below the drafted ones'                  -> one slot fewer (down to 1)

Before any drafted request has finished, the first direct request's rate stands in for the drafted ones'
(a verifier that slows under its direct requests hands some back, whose drafted rate is then measured).
`most` == the initial count turns the sizing off (a fixed number, as `--verifier-decode-slots` alone);
an initial count of 0 keeps the path off.
"""

from __future__ import annotations

EMA = 0.3  # weight of the newest request in a path's rate
MARGIN = 0.05  # the direct rate must fall this far below the drafted one before a slot goes


class DirectSlots:
    def __init__(self, initial: int, most: int):
        if most < initial:
            raise ValueError(f"the most direct slots ({most}) must be >= the initial count ({initial})")
        self.limit, self.most = initial, most
        self.adapt = 0 < initial < most
        self.rate: dict[str, float | None] = {"direct": None, "verified": None}  # a request's tokens / s (EMA)
        self.first_direct: float | None = None

    def observe(self, path: str, tokens: int, seconds: float) -> None:
        """A request finished on `path` ("direct" or "verified"; others are not counted): its tokens and
        seconds from its arrival at the router to its last token."""
        if path not in self.rate or tokens < 1 or seconds <= 0:
            return
        r = tokens / seconds
        old = self.rate[path]
        self.rate[path] = r if old is None else (1 - EMA) * old + EMA * r
        if not self.adapt:
            return
        direct, drafted = self.rate["direct"], self.rate["verified"]
        if path == "direct":
            self.first_direct = self.first_direct or r
        # what the direct requests must keep up with: the drafted ones, else (none measured yet) the first
        # direct request's own rate, so that a verifier slowing under its direct requests hands some back to
        # the drafters, whose rate is then measured
        ref = drafted if drafted is not None else self.first_direct
        if ref is None:
            return
        if path == "direct" and r >= ref * (1 - MARGIN):
            self.limit = min(self.most, self.limit + 1)
        elif direct is not None and direct < ref * (1 - MARGIN):
            self.limit = max(1, self.limit - 1)

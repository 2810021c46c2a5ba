"""A model-free draft source: where the newest tokens repeat earlier text of the prompt or of the output (code,
tool calls, quotes, JSON keys), propose what followed them there (prompt lookup / suffix matching, as vLLM's
n-gram proposer does). The serving engine composes it with the compressed-KV drafts: a row's next draft step
feeds the proposed tokens with its last draft and the model drafts on after them (engine/scheduler.py); every
draft, proposed or modelled, is verified on the full KV by the same rule (model/sampling.verify).

NgramIndex keeps, for every n in [n_min, n_max], the latest position each n-gram of the committed context
(prompt + emitted tokens) ended at; propose() looks up the newest n_max .. n_min tokens of the context plus
the round's drafts (longest match first) and copies what followed the latest earlier occurrence. The index
only grows with committed tokens: rejected drafts never enter it.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, tokens: list[int], n_min: int = 3, n_max: int = 6):
        if not (isinstance(n_min, int) and isinstance(n_max, int) and 1 <= n_min <= n_max):
            raise ValueError(f"n-gram sizes must satisfy 1 <= n_min <= n_max, got {n_min}, {n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.last: dict[tuple[int, ...], int] = {}  # n-gram -> where what followed it starts (latest occurrence)
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        """Commit tokens (the prompt, then emitted tokens)."""
        c = self.tokens
        for t in tokens:
            end = len(c)  # the n-grams ending just before this token are followed by it
            for n in range(self.n_min, min(self.n_max, end) + 1):
                self.last[tuple(c[end - n : end])] = end
            c.append(t)

    def propose(self, drafts: list[int], k: int) -> list[int]:
        """Up to k tokens continuing the committed context + drafts, or [] when its newest tokens repeat nothing."""
        if k <= 0:
            return []
        tail = (self.tokens[-self.n_max :] + list(drafts))[-self.n_max :]
        for n in range(min(self.n_max, len(tail)), self.n_min - 1, -1):
            at = self.last.get(tuple(tail[-n:]))
            if at is not None:
                return self.tokens[at : at + k]
        return []

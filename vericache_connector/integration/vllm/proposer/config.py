"""What the proposer offers, from the server's environment (vLLM builds a custom proposer from its own config only).

VERICACHE_DRAFTS      which drafts the proposer offers, a comma list of
                        predraft    drafts made on the store's compressed copy while the full copy loads
                        compressed  compressed-KV drafts after the load: on a view of the request's own KV
                                    (view.py) where vLLM's runner allows it, else on the store copy's draft cache
                        ngram       prompt-lookup matches (ngram.py)
                      default: all three; "ngram" alone is the same proposer with the compressed copy never
                      used (the connector then fetches no compressed copy for it: a fair n-gram baseline)
VERICACHE_DRAFT_VIEW  the view self-drafts attend to (view.ViewPolicy: "sink=1,selected=4,recent=1,max_share=0.25",
                      or "off"); a row drafts on its view only where it holds at most max_share of its blocks
VERICACHE_DRAFT_WEIGHTS  "model" (vLLM's own modules) or "bfloat16" (proposer.draft_weights)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Mapping

from .view import ViewPolicy

SOURCES = ("predraft", "compressed", "ngram")
DRAFTS_ENV = "VERICACHE_DRAFTS"


@dataclass(frozen=True)
class ProposerConfig:
    sources: frozenset[str] = frozenset(SOURCES)
    view: ViewPolicy | None = ViewPolicy()

    @property
    def uses_compressed_copy(self) -> bool:
        """Whether any draft the proposer offers comes from a compressed copy or view (else n-gram only)."""
        return bool(self.sources & {"predraft", "compressed"})

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ProposerConfig:
        """ValueError naming a bad value."""
        env = os.environ if env is None else env
        text = env.get(DRAFTS_ENV, "").strip()
        sources = {s.strip() for s in text.split(",") if s.strip()} if text else set(SOURCES)
        unknown = sorted(sources - set(SOURCES))
        if unknown or not sources:
            raise ValueError(f"{DRAFTS_ENV} must name some of {list(SOURCES)}, got {text!r}")
        return cls(frozenset(sources), ViewPolicy.from_env(env))

"""The proposer's side of the handoff's pacing (handoff.Pacing): what the connector's worker asks before and
during a load, answered by the proposer's DraftPacer (pacing.py) for the drafts the proposer offers."""

from __future__ import annotations

from .config import ProposerConfig
from .draft_caches import DraftCaches
from .pacing import DraftPacer, new_estimate


class ProposerPacing:
    """The handoff's pacing object (handoff.Pacing) while a proposer is attached: what the connector's worker
    asks before and during a load, answered by the proposer's DraftPacer for the drafts the proposer offers
    (ProposerConfig.sources): pre-drafts on a copy that is still loading, compressed-KV drafts on a store copy's
    draft cache after the load (not where the proposer self-drafts on views of vLLM's own KV: those need no
    copy). Where it offers neither (n-gram only, or no draft model) it asks for no compressed copy at all."""

    def __init__(self, pacer: DraftPacer, caches: DraftCaches, config: ProposerConfig | None = None):
        self.pacer, self.caches = pacer, caches
        self.sources = frozenset(("predraft", "compressed")) if config is None else config.sources
        self.batch = 0  # running requests at the last propose (the proposer's)

    @property
    def drafting(self) -> bool:
        """The proposer has a draft model (vLLM's model was handed over: load_model)."""
        return self.caches.draft is not None

    @property
    def predrafts(self) -> bool:
        return self.drafting and "predraft" in self.sources

    @property
    def copies_after_load(self) -> bool:
        """Compressed-KV drafts after the load come from a store copy's draft cache (not from views)."""
        return self.drafting and "compressed" in self.sources and not self.caches.view_drafting

    @property
    def attached(self) -> bool:
        """The connector brings this proposer compressed copies (split16 loads the upper halves first)."""
        return self.predrafts or self.copies_after_load

    @property
    def wants_copies(self) -> bool:
        return self.attached

    def worth_predraft(self, compressed_s: float | None, max_new: int | None) -> bool:
        """The connector asks before it fetches a compressed copy for a pre-draft (DraftPacer.worth_predraft)."""
        return self.predrafts and self.pacer.worth_predraft(compressed_s, max_new)

    def predraft_value(self) -> float | None:
        """Decode seconds pre-drafts saved per second of pre-drafting (what a second of load is worth to the
        connector's load-or-recompute decision); None until measured."""
        return None if not self.predrafts else self.pacer.predraft_value()

    def drafts_could_pay(self, batch: int | None = None) -> bool:
        """Could a compressed-KV draft made after the load pay at this batch size (default: the batch of the
        last step)? The pacer's horizon at the prior acceptance. A draft cache (the compressed prefix decoded,
        tens of MB, on the cores vLLM's steps need) is built, and a compressed copy fetched for a recomputed
        prefix (the connector asks), only then; pre-drafts during a load do not ask (they use idle time)."""
        batch = self.batch if batch is None else batch
        return self.copies_after_load and self.pacer.horizon(new_estimate(), self.pacer.k_max, max(1, batch)) > 0

    def worth_predraft_during(self, seconds: float) -> bool:
        """split16's load asks, once the upper halves are in: is the rest's transfer long enough to draft in?"""
        return self.predrafts and self.pacer.worth_predraft_during(seconds)

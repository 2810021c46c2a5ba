"""What the connector's scheduler side tells its worker side each step (vLLM ships it to the workers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata, KVConnectorWorkerMetadata


@dataclass
class LoadSpec:
    req_id: str
    prefix: list[int]  # the stored tokens to load (chunk-aligned)
    block_ids: list[int]  # the request's blocks, from token 0
    start: int  # tokens already computed locally (vLLM's prefix cache): load from here
    prompt: list[int]  # the whole prompt (for the proposer's pre-draft)
    max_tokens: int | None = None  # the request's budget of new tokens (what a pre-draft can save at most)


@dataclass
class SaveSpec:
    req_id: str
    prefix: list[int]
    block_ids: list[int]
    overwrite: bool = False  # a load of this prefix failed: rewrite the full copy


@dataclass
class VeriCacheMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    idle: bool = False  # vLLM runs no forward this step (every request it holds waits for its KV)
    seeded: list[tuple[int, int]] = field(default_factory=list)  # new seeded sampled requests (handoff.row_key)
    # prefixes computed here instead of loaded, whose compressed copy the proposer drafts on: fetch it only
    drafts_only: list[LoadSpec] = field(default_factory=list)


@dataclass
class VeriCacheWorkerMeta(KVConnectorWorkerMetadata):
    """What the worker side tells the scheduler side each step: its loads' progress on the link."""

    link_tokens: float = 0.0  # bytes received, in full-copy tokens
    busy_s: float = 0.0  # seconds at least one load was in flight
    predraft_value: float | None = None  # the proposer's decode seconds saved per second of pre-drafting
    forward_s: float | None = None  # vLLM's forward this step (metadata bound -> worker meta asked)

    def aggregate(self, other: "VeriCacheWorkerMeta") -> "VeriCacheWorkerMeta":
        """vLLM merges every worker's (tensor / pipeline parallel): each loads the same tokens (its own heads'
        or layers' share of them) at the same time, so the link brought the most any worker counted, not the
        sum (which would read a TP=N link as N times as fast)."""
        values = [v for v in (self.predraft_value, other.predraft_value) if v is not None]
        forwards = [v for v in (self.forward_s, other.forward_s) if v is not None]
        return VeriCacheWorkerMeta(
            max(self.link_tokens, other.link_tokens),
            max(self.busy_s, other.busy_s),
            min(values) if values else None,
            max(forwards) if forwards else None,
        )

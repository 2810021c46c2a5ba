"""What the connector's scheduler side tells its worker side each step (vLLM ships it to the workers)."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


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

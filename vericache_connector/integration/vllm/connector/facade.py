"""VeriCacheConnector: vLLM KV connector (KVConnectorBase_V1) for a dual-copy remote prefix store.

    python -m vllm.entrypoints.openai.api_server --model MODEL --kv-transfer-config '{
        "kv_connector": "VeriCacheConnector", "kv_connector_module_path": "vericache_connector.vllm_connector",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "redis://127.0.0.1:6379/0", "compressor": "kivi4"}}'

Built as vLLM's own connectors are (OffloadingConnector): this class is a thin facade; vLLM creates it
once per role, config.py's connector_spec resolves vLLM's config into the ConnectorSpec (settings, compressor,
model name, role) the half for that role is built from, and every call is forwarded to that half:
  scheduler.py  VeriCacheConnectorScheduler: which prompts to load, when a prompt's chunks are saved;
  load_plan.py  whether a stored prefix is loaded or recomputed (the link's and the prefill's measured rates);
  worker.py     VeriCacheConnectorWorker: vLLM's worker-side calls, and the saves out of vLLM's blocks;
  loads.py      its load strategies, one chosen per server from the spec (the full copy streamed, with the
                compressed copy for the proposer; the drafter role's compressed copy alone), and the
                compressed copies of computed prefixes; split_load.py: split16's halves;
  metadata.py   what the scheduler half tells the worker half each step, and back;
  paged_layout.py  vLLM's paged KV blocks as per-token views; stats.py: the vericache_* metrics;
  ../handoff.py DraftHandoff: compressed copies for the proposer (../proposer/), created here for the
                worker role when the speculative config names our proposer.
  drafter.py    the drafter role ("role": "drafter"): compressed copies only, never the full copy, no
                saves; its output is drafts for `vericache router`, which alone may call it.
Anything that goes wrong on a load is reported through get_block_ids_with_load_errors and vLLM
recomputes those blocks: a store fault never fails a request, and never changes its output.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole
from vllm.logger import init_logger

from storage_backends import redact_url

from ....store.client import StoreClient
from ..handoff import DraftHandoff
from . import drafter
from .config import connector_spec, model_name_of  # noqa: F401 - model_name_of: re-exported
from .metadata import VeriCacheMetadata
from .scheduler import VeriCacheConnectorScheduler
from .stats import VeriCacheStats, register_name
from .worker import VeriCacheConnectorWorker

logger = init_logger("vllm.vericache")  # under vLLM's logging config, so its lines show in the server log


class VeriCacheConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None, **kwargs: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        self.spec = spec = connector_spec(vllm_config)
        policy = getattr(vllm_config.kv_transfer_config, "kv_load_failure_policy", "recompute")
        if policy != "recompute" and role == KVConnectorRole.SCHEDULER:
            logger.warning(
                "kv_load_failure_policy is %r: a store fault during a load fails the request; set "
                '"kv_load_failure_policy": "recompute" in --kv-transfer-config to recompute instead',
                policy,
            )
        mc = vllm_config.model_config
        self._client = client = StoreClient(spec.cfg, spec.model_name, mc.dtype, f"vericache-{role.name.lower()}")
        self.connector_scheduler: VeriCacheConnectorScheduler | None = None
        self.connector_worker: VeriCacheConnectorWorker | None = None
        self.draft_handoff: DraftHandoff | None = None
        if role == KVConnectorRole.SCHEDULER:
            scheduler_cls = drafter.DrafterScheduler if spec.drafter else VeriCacheConnectorScheduler
            self.connector_scheduler = scheduler_cls(spec, client)
        else:  # the worker's load strategy follows the spec (the drafter role's: the compressed copy alone)
            self.draft_handoff = DraftHandoff() if spec.runs_proposer else None
            heads, head_dim = mc.get_num_kv_heads(vllm_config.parallel_config), mc.get_head_size()
            self.connector_worker = VeriCacheConnectorWorker(spec, heads, head_dim, client, self.draft_handoff)
        logger.info(
            "VeriCacheConnector (%s): store %s, compressor %s, chunk %d%s",
            role.name,
            redact_url(spec.cfg.url),
            spec.cfg.compressor,
            spec.cfg.chunk_size,
            "; DRAFTER role: loads compressed copies only (never the full copy), saves nothing; this server's "
            "output is DRAFTS, never answers: only vericache router may call it"
            if spec.drafter
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

    def update_connector_output(self, connector_output) -> None:
        self.scheduler.update_connector_output(connector_output)

    # ---- worker side ----
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.connector_worker is not None:  # vLLM binds it right before the forward: the step's time starts
            self.connector_worker.forward_started()

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

    def build_connector_worker_meta(self):
        return self.worker.worker_meta()

    def shutdown(self):
        self._client.close()

    # ---- metrics (stats.py): both halves' counts reach vLLM's /metrics as vericache_* series ----
    def get_kv_connector_stats(self) -> VeriCacheStats | None:
        if self.connector_scheduler is not None:
            return self.connector_scheduler.stats.take()
        return self.worker.take_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> VeriCacheStats:
        return VeriCacheStats(data=data if data is not None else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        from .stats import VeriCachePromMetrics

        return VeriCachePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)


register_name(VeriCacheConnector)  # MultiConnector rebuilds our stats by class name (stats.register_name)

"""ServingConfig: the serving engine's settings (continuous batching under a device KV budget)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..model.sampling import DecodeSettings

POLICIES = ("full", "lossy", "vericache")
DRAFT_LAYOUTS = ("auto", "packed", "decoded")
RELOADS = ("auto", "full", "complement")


@dataclass(kw_only=True)
class ServingConfig(DecodeSettings):
    """Continuous batching under a device KV budget. k_min / k_max bound the draft horizon chosen per row and
    round, temperature and stop_at_eos as in DecodeSettings (the serving defaults: k in [4, 64], EOS ignored,
    so every request emits max_new_tokens and traces are comparable across policies)."""

    policy: str = "vericache"
    budget_bytes: int | None = None  # device KV budget (None: unlimited)
    compressor: str = "snapkv-4x"  # the compressed KV (lossy, vericache)
    draft_dtype: str = "float16"  # the draft pool's storage (decoded prompts, KIVI's residual, emitted tokens)
    # where a quantizer's prompt lives: "packed" (its codes and scales in a packed pool, attended without
    # decoding; the budget counts packed bytes), "decoded" (decoded into the draft pool), "auto" (packed for
    # the formats vericache_kernels.paged_packed reads: KIVI 2/4/8-bit, int8, fp8; decoded otherwise)
    draft_layout: str = "auto"
    # what a verification reloads: "full" (the prompt's stored part), "complement" (token dropping whose kept
    # positions are held exactly, draft_dtype = the model's dtype: only the dropped ones; engine/prompt_kv.py),
    # "auto" (complement where it applies, else full)
    reload: str = "auto"
    link_bytes_per_s: float | None = None  # host link (None: as fast as memory copies go)
    block_size: int = 128
    max_rows: int = 64
    horizon: int | None = None  # a fixed draft horizon; None: chosen per row and round
    k_min: int = 4
    k_max: int = 64
    stop_at_eos: bool = False
    alpha_prior: float = 0.8  # per-draft acceptance before a row has verified (measured curve)
    # the per-row acceptances seen before (e.g. an earlier run's rows), the capacity model's distribution until the
    # engine has seen rows of its own (empty: alpha_prior for every row)
    alpha_rows: tuple[float, ...] = ()
    verify_cost: float = 1.0  # a verification's cost in draft steps (horizon choice)
    staging_layers: int | None = None  # the staging ring's layers; None: as many as keep the forward from waiting
    lookahead: int = 512  # W: steps the reservation rings plan ahead
    obs_window: int = 32
    # a model-free draft source beside the compressed KV (vericache_connector/draft/ngram.py): where the newest
    # >= ngram_match tokens repeat earlier text, a draft step also feeds up to `ngram` tokens that followed it
    ngram: int = 0
    ngram_match: int = 3
    # at the trace's tail (nothing waiting or still to arrive), a VeriCache row whose whole full KV now fits the
    # budget keeps the prompt its verification just reloaded and decodes on full KV from then on (lowest
    # acceptance first): no more reloads or drafts for it (moves.py)
    tail_full: bool = True
    backend: str = "auto"  # kernels backend (auto | ref)
    # the capacity model (engine/capacity.py): given the hardware's figures, a VeriCache trace is served with full
    # KV where the model predicts VeriCache / full KV <= 1 + fallback_margin (alpha_prior: the measured
    # per-draft acceptance of the compressor)
    hardware: object | None = None
    fallback_margin: float = 0.1  # the model's error on the 2-core CPU is about this (docs/serving.md)
    planner: bool = True  # the capacity model's decision above (needs hardware)
    # the guard (engine/guard.py): while VeriCache rows run, their measured tokens/s against full KV's (the capacity
    # model's full-KV rate with hardware, else what steps on full KV measured); where VeriCache is slower by more
    # than guard_margin of it, rows move to full KV in flight, lowest acceptance first (moves.py)
    guard: bool = True
    guard_margin: float = 0.0
    prefill_s: float = 0.0  # what a VeriCache prefill adds per request on this hardware (engine/calibrate.py)

    def __post_init__(self):
        super().__post_init__()
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.draft_layout not in DRAFT_LAYOUTS:
            raise ValueError(f"draft_layout must be one of {DRAFT_LAYOUTS}, got {self.draft_layout!r}")
        if self.reload not in RELOADS:
            raise ValueError(f"reload must be one of {RELOADS}, got {self.reload!r}")
        if self.budget_bytes is not None and not (_is_int(self.budget_bytes) and self.budget_bytes > 0):
            raise ValueError(f"budget_bytes must be a positive integer or None, got {self.budget_bytes!r}")
        if not (_is_int(self.ngram) and self.ngram >= 0) or not (_is_int(self.ngram_match) and self.ngram_match >= 1):
            raise ValueError(f"ngram must be >= 0 and ngram_match >= 1, got {self.ngram!r}, {self.ngram_match!r}")
        for name in ("block_size", "max_rows", "lookahead"):
            if not (_is_int(getattr(self, name)) and getattr(self, name) >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {getattr(self, name)!r}")
        if not (_is_int(self.obs_window) and self.obs_window >= 0):
            raise ValueError(f"obs_window must be an integer >= 0, got {self.obs_window!r}")
        if self.horizon is not None and not (_is_int(self.horizon) and 1 <= self.horizon <= self.k_max):
            raise ValueError(f"horizon must be in [1, k_max={self.k_max}], got {self.horizon!r}")
        if not 0 < self.alpha_prior < 1:
            raise ValueError(f"alpha_prior must be in (0, 1), got {self.alpha_prior}")
        bad = next((a for a in self.alpha_rows if isinstance(a, bool) or not 0 <= a <= 1), None)
        if bad is not None:
            raise ValueError(f"alpha_rows must hold acceptances in [0, 1], got {bad!r}")
        if not (math.isfinite(self.verify_cost) and self.verify_cost >= 0):
            raise ValueError(f"verify_cost must be a finite number >= 0, got {self.verify_cost!r}")
        if self.staging_layers is not None and not (_is_int(self.staging_layers) and self.staging_layers >= 1):
            raise ValueError(f"staging_layers must be >= 1 or None, got {self.staging_layers!r}")
        if self.hardware is not None and not all(
            hasattr(self.hardware, f) for f in ("mem_bytes_per_s", "flops", "link_bytes_per_s", "devices")
        ):
            raise ValueError(f"hardware must be an engine.capacity.Hardware, got {self.hardware!r}")
        if not (math.isfinite(self.guard_margin) and 0 <= self.guard_margin < 1):
            raise ValueError(f"guard_margin must be in [0, 1), got {self.guard_margin!r}")
        if not (math.isfinite(self.fallback_margin) and self.fallback_margin > -1):
            raise ValueError(f"fallback_margin must be a finite number > -1, got {self.fallback_margin!r}")
        if not (math.isfinite(self.prefill_s) and self.prefill_s >= 0):
            raise ValueError(f"prefill_s must be a finite number >= 0, got {self.prefill_s!r}")
        rate = self.link_bytes_per_s
        if rate is not None and not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
            raise ValueError(f"link_bytes_per_s must be a finite number > 0 or None, got {rate!r}")


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)

"""The main job: a small long-context serving trace under a device KV budget, served three ways side by side.

full KV (what a server does today: only as many requests as their full KV fits) | lossy compressed KV only
(fast, inexact) | VeriCache (compressed KV resident, full KV in a host tier reloaded for each verification).
Reports each policy's throughput, latency, rows it held at once, and whether every request's output is
identical to that request's own single-request full-KV greedy output.

On the CPU the device budget is a byte cap on the resident caches and the host link an emulated rate: a proxy
of the GPU memory hierarchy; the compute is real.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from tqdm.auto import tqdm

from ..data import load_prompts
from ..engine.config import POLICIES, ServingConfig
from ..engine.llm_engine import Prefill, VeriCacheEngine
from ..engine.sequence import Request
from ..engine.serving import ServingEngine
from ..engine.speculative import DecodeConfig


@dataclass
class PolicyRow:
    policy: str
    tokens_per_s: float
    mean_latency_s: float
    max_rows: int
    identical: int
    requests: int
    mean_accepted: float
    link_utilization: float
    peak_resident_mib: float


@dataclass
class ServingDemoReport:
    model: str
    requests: int
    prompt_tokens: list[int]
    new_tokens: int
    compressor: str
    budget_fraction: float
    budget_mib: float
    link_gbps: float
    prefill_s: float
    rows: list[PolicyRow] = field(default_factory=list)

    @property
    def identical(self) -> bool:
        return all(r.identical == r.requests for r in self.rows if r.policy != "lossy")

    def row(self, policy: str) -> PolicyRow | None:
        return next((r for r in self.rows if r.policy == policy), None)

    def text(self) -> str:
        full = self.row("full")
        lines = [
            f"model {self.model}; {self.requests} requests of {min(self.prompt_tokens)}-{max(self.prompt_tokens)} prompt "
            f"tokens, {self.new_tokens} new tokens each; device KV budget {self.budget_mib:.0f} MiB "
            f"({self.budget_fraction:g} of the full-KV demand); compressor {self.compressor}",
            f"CPU proxy: the budget is a byte cap on resident caches, the host link emulated at {self.link_gbps:g} GB/s; "
            f"compute real; prompts prefilled once ({self.prefill_s:.1f} s), replayed for each policy",
            "",
            f"{'policy':<10} {'tok/s':>7} {'x full':>7} {'mean latency s':>15} {'rows at once':>13} "
            f"{'accepted/verify':>16}  identical to full KV",
        ]
        for r in self.rows:
            ratio = f"{r.tokens_per_s / full.tokens_per_s:.2f}" if full else "-"
            acc = f"{r.mean_accepted:.2f}" if r.policy == "vericache" else "-"
            ident = "yes" if r.identical == r.requests else ("no" if r.policy == "lossy" else "NO")
            lines.append(
                f"{r.policy:<10} {r.tokens_per_s:7.2f} {ratio:>7} {r.mean_latency_s:15.1f} {r.max_rows:13d} "
                f"{acc:>16}  {ident} {r.identical}/{r.requests}"
            )
        lines += ["", f"VeriCache output identical to full KV: {'yes' if self.identical else 'NO'}"]
        return "\n".join(lines)

    def as_dict(self) -> dict:
        return {**asdict(self), "identical": self.identical}


def demo_prompts(engine: VeriCacheEngine, n: int, tokens: int) -> list[list[int]]:
    """n real prompts of `tokens` tokens: slices of the bundled texts laid end to end."""
    stream = [t for text in load_prompts().values() for t in engine.encode(text)]
    step = max(1, (len(stream) - tokens) // max(1, n - 1)) if len(stream) > tokens else 0
    return [(stream + stream)[i * step : i * step + tokens] for i in range(n)]


def run_serving_demo(
    engine: VeriCacheEngine,
    requests: int = 4,
    prompt_tokens: int = 3000,
    new_tokens: int = 48,
    budget_fraction: float = 0.3,
    compressor: str = "snapkv-4x",
    link_gbps: float = 1.0,
    k_max: int = 32,
    model_name: str = "smollm2-135m-instruct",
) -> ServingDemoReport:
    import time

    if requests < 2:
        raise ValueError(f"the serving demo needs >= 2 requests, got {requests}")
    if not 0 < budget_fraction <= 1:
        raise ValueError(f"budget fraction must be in (0, 1], got {budget_fraction}")
    engine.check_length(prompt_tokens, new_tokens)
    model = engine.model
    prompts = demo_prompts(engine, requests, prompt_tokens)
    t = time.perf_counter()
    store = {}
    refs = []
    for p in tqdm(prompts, desc="prefill + full-KV reference", leave=False):
        ServingEngine.precompute_prefills(model, [p], engine.obs_window, store)
        logits, layers = store[(tuple(p), engine.obs_window)]
        from ..compressors import PrefixKV

        pre = Prefill(p, PrefixKV([k for k, _, _ in layers], [v for _, v, _ in layers]), logits)
        refs.append(engine.generate_full([pre], DecodeConfig(max_new_tokens=new_tokens, stop_at_eos=False))[0])
    prefill_s = time.perf_counter() - t
    per_token = model.cfg.kv_bytes_per_token(model.dtype.itemsize)
    demand = sum((len(p) + new_tokens) * per_token for p in prompts)
    budget = int(budget_fraction * demand)
    report = ServingDemoReport(
        model_name,
        requests,
        [len(p) for p in prompts],
        new_tokens,
        compressor,
        budget_fraction,
        budget / 2**20,
        link_gbps,
        prefill_s,
    )
    trace = [Request(f"r{i}", p, new_tokens) for i, p in enumerate(prompts)]
    warm = [Request(f"w{i}", p[:300], 2) for i, p in enumerate(prompts[:2])]
    for policy in POLICIES:
        cfg = ServingConfig(
            policy=policy,
            budget_bytes=budget,
            compressor=compressor,
            k_max=k_max,
            link_bytes_per_s=link_gbps * 1e9,
            obs_window=engine.obs_window,
        )
        ServingEngine(model, ServingConfig(policy=policy, compressor=compressor, k_max=8)).run(warm)
        with tqdm(total=requests * new_tokens, desc=policy, unit="tok", leave=False) as bar:
            rep = ServingEngine(model, cfg, store).run(trace, on_tokens=bar.update)
        outs = rep.outputs()
        same = sum(outs[f"r{i}"] == ref for i, ref in enumerate(refs))
        report.rows.append(
            PolicyRow(
                policy,
                rep.tokens_per_s,
                rep.mean_latency_s,
                rep.max_concurrent,
                same,
                requests,
                rep.mean_accepted,
                rep.link_utilization,
                rep.peak_resident_bytes / 2**20,
            )
        )
    return report

"""What a serving run measured: per request and in total, with the time split that bounds throughput."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from .planner import AcceptanceEstimate


@dataclass
class TimeSplit:
    """Wall seconds of a run by what the engine was doing (they add up to the makespan)."""

    prefill_s: float = 0.0  # prompts' forwards
    decode_step_s: float = 0.0  # full / lossy steps
    draft_step_s: float = 0.0  # VeriCache steps with drafting rows only
    verify_step_s: float = 0.0  # VeriCache steps with at least one verifying row (drafters included)
    link_wait_s: float = 0.0  # waiting for reloads (inside verify steps, or with nothing else to do)
    idle_s: float = 0.0  # nothing admitted to run (waiting for arrivals)
    steps: int = 0
    verify_steps: int = 0

    def add_step(self, kinds: set[str], dt: float, wait: float) -> None:
        self.steps += 1
        self.link_wait_s += wait
        compute = dt - wait
        if "verify" in kinds:
            self.verify_steps += 1
            self.verify_step_s += compute
        elif "draft" in kinds:
            self.draft_step_s += compute
        else:
            self.decode_step_s += compute


@dataclass
class RequestRecord:
    request_id: str
    prompt_tokens: int
    new_tokens: int
    arrival_s: float
    admitted_s: float | None
    first_token_s: float | None
    finished_s: float | None
    accepted: list[int]
    output: list[int] = field(repr=False)
    ngram_drafted: int = 0  # drafts from the n-gram source (ServingConfig.ngram)
    drafted: list[int] = field(default_factory=list)  # drafts verified per verification
    switched_s: float | None = None  # when the VeriCache row went on decoding on its full KV
    switched_by: str | None = None  # "tail" (ServingConfig.tail_full) or "guard" (VeriCache lost: ServingConfig.guard)

    @property
    def latency_s(self) -> float:
        return self.finished_s - self.arrival_s

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s


def acceptance(recs: list[RequestRecord]) -> float | None:
    """The per-draft acceptance of the trace's verified rounds, by the planner's estimator without its prior
    (planner.AcceptanceEstimate). None without a verification."""
    return observed_alpha([n for r in recs for n in r.accepted], [k for r in recs for k in r.drafted])


def observed_alpha(accepted: list[int], drafted: list[int]) -> float | None:
    """Rounds' per-draft acceptance: accepted / (accepted + rounds cut short); None without a round."""
    est = AcceptanceEstimate(prior=0.5, weight=0.0)
    for n, k in zip(accepted, drafted):
        est.update(n, k)
    return est.observed


@dataclass
class ServingReport:
    policy: str
    requests: list[RequestRecord]
    makespan_s: float
    output_tokens: int
    tokens_per_s: float
    decode_tokens_per_s: float  # output tokens / (makespan - prefill time)
    mean_latency_s: float
    p90_latency_s: float
    mean_ttft_s: float
    verifications: int
    mean_accepted: float  # drafts accepted per verification
    alpha: float | None  # per-draft acceptance of the trace's rounds: accepted / (accepted + rounds cut short)
    switched_to_full: int  # VeriCache rows that went on on their full KV (at the trace's tail, or moved by the guard)
    moved_by_guard: int  # of those, the rows the guard moved (VeriCache was losing to full KV)
    max_concurrent: int  # most rows admitted and not finished at once
    link_busy_s: float
    link_utilization: float
    link_max_concurrent: int
    reloaded_bytes: int
    reload_failures: int
    peak_resident_bytes: int
    budget_bytes: int | None
    split: TimeSplit
    served_policy: str = ""  # what served the trace: the policy, or "full" where every row was admitted on full KV
    prediction: dict | None = None  # the capacity model's prediction (ServingConfig.hardware)
    # what a VeriCache step took beyond its roofline on ServingConfig.hardware, per step and per verification
    # (the engine's measurement, which its next predictions use: Hardware.step_overhead_s, verify_overhead_s)
    step_overhead_s: float | None = None
    verify_overhead_s: float | None = None
    prefill_overhead_s: float | None = None  # what a VeriCache prefill adds per row (ServingConfig.prefill_s)

    @classmethod
    def build(
        cls, cfg, seqs, makespan: float, split: TimeSplit, scheduler, link, reload_failures: int
    ) -> "ServingReport":
        """The report of the finished sequences `seqs` (scheduler: the budget's peak and the most rows at once)."""
        blocks = scheduler.blocks
        recs = [
            RequestRecord(
                s.request_id,
                s.prompt_len,
                len(s.output),
                s.arrival_s,
                s.admitted_s,
                s.first_token_s,
                s.finished_s,
                list(s.accepted),
                list(s.output),
                s.ngram_drafted,
                list(s.drafted),
                s.switched_s,
                s.switched_by,
            )
            for s in seqs
        ]
        lat = sorted(r.latency_s for r in recs)
        acc = [n for r in recs for n in r.accepted]
        tokens = sum(r.new_tokens for r in recs)
        busy = link.busy_s if link is not None else 0.0
        return cls(
            policy=cfg.policy,
            requests=recs,
            makespan_s=makespan,
            output_tokens=tokens,
            tokens_per_s=tokens / makespan,
            decode_tokens_per_s=tokens / max(1e-9, makespan - split.prefill_s),
            mean_latency_s=statistics.fmean(lat),
            p90_latency_s=lat[min(len(lat) - 1, int(0.9 * len(lat)))],
            mean_ttft_s=statistics.fmean(r.ttft_s for r in recs),
            verifications=len(acc),
            mean_accepted=statistics.fmean(acc) if acc else 0.0,
            alpha=acceptance(recs),
            switched_to_full=sum(r.switched_s is not None for r in recs),
            moved_by_guard=sum(r.switched_by == "guard" for r in recs),
            max_concurrent=scheduler.peak_rows,
            link_busy_s=busy,
            link_utilization=busy / makespan,
            link_max_concurrent=link.max_active if link is not None else 0,
            reloaded_bytes=link.bytes_moved if link is not None else 0,
            reload_failures=reload_failures,
            peak_resident_bytes=blocks.peak,
            budget_bytes=blocks.budget,
            split=split,
            # a VeriCache engine that admitted every row on full KV (the capacity model predicted a loss) served full KV
            served_policy="full" if all(s.full_kv and s.switched_s is None for s in seqs) else cfg.policy,
        )

    def outputs(self) -> dict[str, list[int]]:
        return {r.request_id: r.output for r in self.requests}

    def summary(self) -> dict:
        d = asdict(self)
        d.pop("requests")
        return d

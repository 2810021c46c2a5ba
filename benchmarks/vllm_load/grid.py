"""The grid of a vllm_bench.py run: the topologies' configurations by label and short name, and the plan of runs
(one fresh server set and one client run each) over rounds, concurrencies and links."""

from __future__ import annotations

from dataclasses import dataclass

from benchmarks.vllm_load.configs import CONFIGURATIONS, Configuration
from benchmarks.vllm_load.router import TOPOLOGY

TOPOLOGIES = {"single": CONFIGURATIONS, "router": TOPOLOGY}
BY_NAME = {c.label: c for t in TOPOLOGIES.values() for c in t} | {c.slug: c for t in TOPOLOGIES.values() for c in t}
REFERENCE = {"single": "plain vLLM", "router": "plain vLLM (N+1 replicas)"}  # what every text is compared with
OURS = {"single": "connector + proposer", "router": "router"}
PLAIN = "plain vLLM"


@dataclass
class Run:
    """One fresh server (set) and one client run."""

    round: int
    concurrency: int
    gbits: float | None  # None: the configuration reads no store (one run per concurrency)
    config: Configuration

    @property
    def name(self) -> str:
        link = "nolink" if self.gbits is None else "beside" if not self.gbits else f"{self.gbits:g}gbit"
        return f"r{self.round}-c{self.concurrency}-{link}-{self.config.slug}"


def plan_runs(args) -> list[Run]:
    """Per round and concurrency: plain vLLM first (the reference of that concurrency), then every link's
    connector configurations."""
    configs = [BY_NAME[c] for c in args.configs]
    runs = []
    for r in range(args.rounds):
        for c in args.concurrency:
            runs += [Run(r, c, None, cfg) for cfg in configs if not cfg.reads_store]
            for g in args.gbits:
                runs += [Run(r, c, g, cfg) for cfg in configs if cfg.reads_store]
    return runs

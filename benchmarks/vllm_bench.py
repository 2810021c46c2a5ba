"""vLLM's own benchmark client against one fresh vLLM server per configuration, a warm store and a cold vLLM cache.

  plain vLLM            no connector: vLLM's prefix cache only (runs once per concurrency: it reads no store)
  connector             VeriCacheConnector: a document's first request loads its stored prefix's full copy
  connector + ngram     the same, with vLLM's own n-gram proposer (prompt lookup 2-4, --ngram-k tokens)
  connector + proposer, n-gram only
                        the same, with CompressedKVProposer never using the compressed copy (VERICACHE_DRAFTS=ngram)
  connector + proposer  the same, with CompressedKVProposer (--spec-k tokens): pre-drafts on the compressed copy,
                        n-gram matches, drafts on a view of each request's own KV

Workload (--workload: a named set of the defaults below, vllm_load/workload.py): --documents bundled prompts cut
to --doc-tokens tokens (decoded back to text), each followed by --questions short questions, shuffled with a
fixed seed (every server gets the same requests in the same order), --new tokens per request, greedy,
ignore_eos. The client is vLLM's benchmark client (the module
vllm.benchmarks.serve, its `custom` dataset: a JSONL file) at --max-concurrency C, every request sent at once.
Prefix caching is on everywhere. A separate connector server (no link limit) writes the store first: each
document's first question, once. Every measured server then starts with vLLM's cache cold and its own
hard-linked copy of that store (warm), behind an EMULATED store link (--gbits: a token bucket on the store's
reads; the compute is real), and answers one short unrelated request before the client starts.

Per row: output tokens/s and its ratio to the best alternative (the best of the other four at that link and
concurrency), mean/p90 TTFT, mean TPOT, mean/p90 E2E, whether every generated text equals plain vLLM's (same
concurrency, request by request), the 1-minute load average when its client started, the connector's loads,
vLLM's drafted/accepted tokens, the proposer's accepted tokens by source (accepted_by_source) and its step
times (target_step_ms by batch, draft_step_ms by rows). Results land in
results/vllm_bench/<stamp>/: results.json (a top-level "summary": one entry per (gbits, concurrency,
configuration); per run the client's figures per request and the connector's load lines), table.md,
command.txt, throughput.png, and logs/ (out of git: the dataset, every server's log, each client's raw JSON and
output). Same-run ratios only; run it on an idle machine.

    python benchmarks/vllm_bench.py --concurrency 1 4 8 --gbits 0.1 0.4
    python benchmarks/vllm_bench.py --workload long      # 6,400-token documents, 256 new tokens, c 1/8/16, --gbits 0 0.1

--topology router (vllm_load/router.py): the same client and summary over N drafter-role servers + a verifier
beside the store + `vericache router`, against N + 1 connector replicas (one beside the store) or N + 1 plain
vLLM replicas behind a prefix-aware proxy, every configuration on the same cores (each row's `cores`; its
`paths`: requests drafted / direct / handed back; `accepted_per_verify_call`) (issue 39's workload:
--documents 4 --doc-tokens 1600 --questions 2 --new 32 --gbits 0.2, kivi4, the link scaled to Llama-3-8B's KV):

    python benchmarks/vllm_bench.py --topology router --drafters 2 --concurrency 1 4 8 --gbits 0.2

The parts (workloads, configurations, client, logs, exactness, summary, table and plot, the sweep): vllm_load/.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/<script>.py): import from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import os

from benchmarks.kit import paths
from benchmarks.vllm_load.configs import OPENMP
from benchmarks.vllm_load.grid import BY_NAME, TOPOLOGIES
from benchmarks.vllm_load.workload import DEFAULT, QUESTIONS, WORKLOADS


def parse_args(argv=None):
    from vericache_connector.router.config import RouterConfig

    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n    python")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--workload",
        default=DEFAULT,
        choices=list(WORKLOADS),
        help="the defaults of the next seven flags: " + "; ".join(f"{w.name}: {w.about}" for w in WORKLOADS.values()),
    )
    p.add_argument("--documents", type=int, help="documents (bundled prompts) of the workload")
    p.add_argument("--doc-tokens", type=int, help="each document cut to this many tokens")
    p.add_argument("--questions", type=int, help=f"questions per document (at most {len(QUESTIONS)})")
    p.add_argument("--new", type=int, help="tokens generated per request (ignore_eos)")
    p.add_argument("--kv-space-gib", type=int, help="every server's KV cache (VLLM_CPU_KVCACHE_SPACE), GiB")
    p.add_argument("--compressor", default="split16", help="the connector's compressed copy (split16: float32 KV)")
    p.add_argument("--concurrency", type=int, nargs="+", help="the client's --max-concurrency")
    p.add_argument("--gbits", type=float, nargs="+", help="EMULATED store link, Gbit/s")
    p.add_argument("--spec-k", type=int, default=32, help="num_speculative_tokens of our proposer")
    p.add_argument("--ngram-k", type=int, default=8, help="num_speculative_tokens of vLLM's n-gram proposer")
    p.add_argument("--topology", default="single", choices=list(TOPOLOGIES), help="one server, or the router's")
    p.add_argument(
        "--drafters",
        type=int,
        default=2,
        help="--topology router: drafter-role servers N (the alternatives: N + 1 replicas)",
    )
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
    spec = WORKLOADS[a.workload]
    for key in ("documents", "doc_tokens", "questions", "new", "kv_space_gib", "concurrency", "gbits"):
        if getattr(a, key) is None:
            setattr(a, key, list(getattr(spec, key)) if key in ("concurrency", "gbits") else getattr(spec, key))
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
    if any(c < 1 for c in a.concurrency) or any(not g >= 0 for g in a.gbits):
        p.error(f"--concurrency must be >= 1 and --gbits >= 0 (0: beside the store), got {a.concurrency} / {a.gbits}")
    a.concurrency = sorted(set(a.concurrency))
    a.gbits = sorted(set(a.gbits))
    return a


def main(argv=None) -> int:
    paths.setup()
    from benchmarks.vllm_load import run

    return run.main(parse_args(argv), argv)


if __name__ == "__main__":
    raise SystemExit(main())

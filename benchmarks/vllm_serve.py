"""vLLM's OpenAI server: plain, with the VeriCache connector, and with connector + proposer, side by side in one run.

Three servers on 127.0.0.1, one after the other, on the same prompts (bundled real texts):
  base        plain vLLM (prefix caching off: every request computes its prompt)
  connector   --kv-transfer-config VeriCacheConnector: cold requests save both copies, warm ones load the full copy
  vericache   connector + CompressedKVProposer (--speculative-config): warm requests draft on the compressed
              copy while the full copy loads, and vLLM verifies every draft
Per request: time to first token (streamed) and end-to-end latency; whether the token ids equal the base
server's (greedy). Ratios: each configuration / the base server, and each configuration / the connector
alone (same phase, cold or warm; base against warm), so that "connector + proposer / connector" is the
proposer's own effect in one number (> 1: the proposer slows requests down). Ratios are same-run ratios:
compare them, not seconds across runs. Results land in results/vllm_serve/<timestamp>/.

    python benchmarks/vllm_serve.py --prompts 3 --tokens 1800 --new 32 --spec-k 8
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path

from tqdm.auto import tqdm

import bench_paths


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n    python")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prompts", type=int, default=3, help="bundled prompts to use (1-5)")
    p.add_argument("--tokens", type=int, default=1800, help="cut each prompt to this many tokens")
    p.add_argument("--new", type=int, default=32, help="tokens generated per request")
    p.add_argument("--spec-k", type=int, default=8, help="drafts per step of the compressed-KV proposer")
    p.add_argument("--compressor", default="kivi4")
    p.add_argument("--gbits", type=float, default=None, help="emulated store read bandwidth, Gbit/s")
    p.add_argument("--model", default=None, help="HF model directory (default: the bundled SmolLM2-135M)")
    p.add_argument("--out", default="results/vllm_serve")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    a = p.parse_args(argv)
    if not 1 <= a.prompts <= 5 or a.tokens < 300 or a.new < 1 or a.spec_k < 1:
        p.error(
            f"bad sizes: --prompts {a.prompts} (1-5), --tokens {a.tokens} (>= 300), --new {a.new}, --spec-k {a.spec_k}"
        )
    return a


def serve(cfg, prompts: dict, new: int, phases: list[str], bar) -> dict:
    from vllm_server import VLLMServer

    out = {}
    with VLLMServer(cfg) as srv:
        srv.complete(list(range(1000, 1064)), 4)  # warm-up: first-request overheads out of the timings
        for phase in phases:
            for name, ids in prompts.items():
                c = srv.complete(ids, new)
                out[(phase, name)] = {"ttft_s": c.ttft_s, "total_s": c.total_s, "tokens": c.token_ids}
                bar.update(1)
        spec = [ln.split("SpecDecoding metrics: ")[1] for ln in srv.log().splitlines() if "SpecDecoding metrics" in ln]
    out["spec_log"] = spec
    return out


def main(argv=None) -> int:
    bench_paths.setup()
    args = parse_args(argv)
    from vericache_connector.data import load_prompts
    from vericache_connector.engine import VeriCacheEngine
    from vericache_connector.model.loader import resolve_model_dir

    from vllm_server import ServerConfig

    model = str(resolve_model_dir(args.model))
    tok = VeriCacheEngine.from_pretrained(model)  # for its tokenizer
    prompts = {n: tok.encode(t)[: args.tokens] for n, t in list(load_prompts().items())[: args.prompts]}
    bw = None if args.gbits is None else args.gbits * 1e9 / 8
    store_dir = tempfile.mkdtemp(prefix="vericache-bench-kv-")
    n = len(prompts)
    with tqdm(total=5 * n, desc="vllm serve", unit="req") as bar:
        base = serve(ServerConfig(model, max_model_len=args.tokens + args.new + 64), prompts, args.new, ["base"], bar)
        runs = {}
        for label, k in (("connector", 0), ("vericache", args.spec_k)):
            cfg = ServerConfig(
                model,
                store=f"local://{store_dir}/{label}",
                compressor=args.compressor,
                spec_k=k,
                max_model_len=args.tokens + args.new + 64,
                bandwidth_bytes_per_s=bw,
            )
            runs[label] = serve(cfg, prompts, args.new, ["cold", "warm"], bar)
    rows = []
    for name in prompts:
        b = base[("base", name)]
        row = {"prompt": name, "tokens": len(prompts[name]), "base_ttft_s": b["ttft_s"], "base_total_s": b["total_s"]}
        for label, r in runs.items():
            for phase in ("cold", "warm"):
                x = r[(phase, name)]
                row[f"{label}_{phase}_ttft_s"], row[f"{label}_{phase}_total_s"] = x["ttft_s"], x["total_s"]
                row[f"{label}_{phase}_identical"] = x["tokens"] == b["tokens"]
            row[f"{label}_warm_ttft_ratio"] = row[f"{label}_warm_ttft_s"] / b["ttft_s"]
            row[f"{label}_warm_total_ratio"] = row[f"{label}_warm_total_s"] / b["total_s"]
        for phase in ("cold", "warm"):  # the proposer's own effect: connector + proposer / connector alone
            for metric in ("ttft", "total"):
                row[f"vericache_{phase}_{metric}_vs_connector"] = (
                    row[f"vericache_{phase}_{metric}_s"] / row[f"connector_{phase}_{metric}_s"]
                )
        rows.append(row)
    configs = summarize(rows)
    spec = acceptance(runs["vericache"]["spec_log"])
    out = Path(args.out) / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    result = {
        "command": shlex.join([sys.executable, *sys.argv]),
        "args": vars(args),
        "rows": rows,
        "configurations": configs,
        "spec_decoding": spec,
        "spec_decoding_log": runs["vericache"]["spec_log"],
    }
    (out / "results.json").write_text(json.dumps(result, indent=1))
    (out / "command.txt").write_text(result["command"] + "\n")
    table = [
        "| configuration | TTFT s | e2e s | TTFT / base | e2e / base | TTFT / connector | e2e / connector |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in configs:
        table.append(
            f"| {c['configuration']} | {c['ttft_s']:.2f} | {c['total_s']:.2f} | {c['ttft_vs_base']:.2f} | "
            f"{c['total_vs_base']:.2f} | {c['ttft_vs_connector']:.2f} | {c['total_vs_connector']:.2f} |"
        )
    table += [
        "",
        f"Means over {len(rows)} prompts; ratios of the mean times, same run. / connector = against the connector "
        "alone in the same phase (cold or warm; base against warm): connector + proposer / connector is the "
        "proposer's own effect.",
    ]
    if spec["drafted"]:
        table.append(
            f"Proposer: vLLM accepted {spec['accepted']} of {spec['drafted']} drafted tokens "
            f"({spec['accepted'] / spec['drafted']:.0%}) over the run (SpecDecoding metrics)."
        )
    table += [
        "",
        "| prompt | tokens | base TTFT / e2e s | connector warm TTFT / e2e s (/ base) | connector + proposer warm "
        "TTFT / e2e s (/ base) | connector + proposer warm / connector warm (TTFT, e2e) | identical (cold, warm) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ident = all(r[f"{lb}_{ph}_identical"] for lb in runs for ph in ("cold", "warm"))
        table.append(
            f"| {r['prompt']} | {r['tokens']} | {r['base_ttft_s']:.2f} / {r['base_total_s']:.2f} | "
            f"{r['connector_warm_ttft_s']:.2f} / {r['connector_warm_total_s']:.2f} "
            f"({r['connector_warm_ttft_ratio']:.2f}, {r['connector_warm_total_ratio']:.2f}) | "
            f"{r['vericache_warm_ttft_s']:.2f} / {r['vericache_warm_total_s']:.2f} "
            f"({r['vericache_warm_ttft_ratio']:.2f}, {r['vericache_warm_total_ratio']:.2f}) | "
            f"{r['vericache_warm_ttft_vs_connector']:.2f}, {r['vericache_warm_total_vs_connector']:.2f} | "
            f"{'yes' if ident else 'NO'} |"
        )
    (out / "table.md").write_text("\n".join(table) + "\n")
    plot(rows, out / "latency.png")
    print(json.dumps(result) if args.json else "\n".join(table) + f"\n\nresults: {out}")
    return 0 if all(r[k] for r in rows for k in r if k.endswith("_identical")) else 1


CONFIGURATIONS = (  # (label, key prefix in a row, the connector's key prefix for the same phase)
    ("base", "base", "connector_warm"),
    ("connector cold", "connector_cold", "connector_cold"),
    ("connector warm", "connector_warm", "connector_warm"),
    ("connector + proposer cold", "vericache_cold", "connector_cold"),
    ("connector + proposer warm", "vericache_warm", "connector_warm"),
)


def summarize(rows: list[dict]) -> list[dict]:
    """Per configuration: mean TTFT and e2e over the prompts, and the ratios of those means against the base
    server and against the connector alone in the same phase."""

    def mean(key: str) -> float:
        return sum(r[key] for r in rows) / len(rows)

    out = []
    for label, key, ref in CONFIGURATIONS:
        c = {"configuration": label, "ttft_s": mean(f"{key}_ttft_s"), "total_s": mean(f"{key}_total_s")}
        for metric in ("ttft", "total"):
            c[f"{metric}_vs_base"] = c[f"{metric}_s"] / mean(f"base_{metric}_s")
            c[f"{metric}_vs_connector"] = c[f"{metric}_s"] / mean(f"{ref}_{metric}_s")
        out.append(c)
    return out


def acceptance(spec_log: list[str]) -> dict:
    """Accepted and drafted tokens summed over vLLM's SpecDecoding metrics lines."""
    total = {"accepted": 0, "drafted": 0}
    for line in spec_log:
        for key in total:
            m = re.search(rf"{key.capitalize()}: (\d+) tokens", line)
            if m:
                total[key] += int(m.group(1))
    return total


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    series = [
        ("base", "base"),
        ("connector cold", "connector_cold"),
        ("connector warm", "connector_warm"),
        ("connector + proposer cold", "vericache_cold"),
        ("connector + proposer warm", "vericache_warm"),
    ]
    width = 0.8 / len(series)
    for ax, metric, title in ((axes[0], "ttft_s", "time to first token (s)"), (axes[1], "total_s", "end to end (s)")):
        for i, (label, key) in enumerate(series):
            ax.bar([j + i * width for j in range(len(rows))], [r[f"{key}_{metric}"] for r in rows], width, label=label)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(rows))], [r["prompt"] for r in rows], fontsize=8)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())

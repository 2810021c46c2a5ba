"""Drafters + verifier vs full-KV fetch vs recompute, side by side in one run, as separate processes.

One `vericache verifier` next to the store (the real Redis on loopback) and N `vericache drafter`
processes (N = 1, 2, 4) with an emulated slow link to the store, all on 127.0.0.1. In every setting
(slow link, N) the drafters serve the same requests three ways, interleaved round by round:
  full-kv    fetch the whole full copy over the slow link, then plain full-KV greedy decoding (the baseline,
             and the reference every other output is compared with, token for token)
  verified   fetch only the compressed copy, draft on it, verified next to the store (the full KV never
             crosses the slow link; remote/drafter.py)
  recompute  prefill the whole prompt at the drafter, then plain decoding (no store)
  local      (optional, --methods) today's single-node hit: compressed copy first, full copy streamed in
Then a request-rate sweep at one setting: Poisson arrivals per drafter, latency (queueing included)
and throughput per method.

Links, emulated on the CPU (say so in every output): the drafters' slow link is a token bucket on their
store reads, `gbit` real Gbit/s scaled to the model's KV bytes as side_by_side.py does (our SmolLM2
float32 KV is 45 KiB/token vs Llama-3-8B's 128 KiB/token, so transfer times equal Llama-3-8B's over the
stated link). The verifier's fast link is the paper's 40 GB/s local store, scaled the same way; loopback
Redis is slower than that, so the verifier reads at Redis's real speed (measured and reported). Compute
is not scaled (CPU steps of SmolLM2-135M): every process on the same shared cores, or with --pin the
verifier on a core of its own and the drafters on the others (separate machines' compute, emulated).

    python benchmarks/disaggregated.py                       # the default grid (~30 min on 2 cores)
    python benchmarks/disaggregated.py --gbits 1 --drafters 2 --rounds 2 --rates

--backend vllm runs the same settings with stock vLLM servers (benchmarks/disaggregated_vllm.py): a verifier
vLLM server with the connector beside the store, per node a drafter-role vLLM server behind `vericache
router` ("verified") and a plain connector server ("full-kv": it fetches the full copy over the slow link;
"recompute": the same server with the connector off for the request); outputs are checked against the
verifier server's own greedy output. Each vLLM server takes about 3 GB: keep --drafters at 1 or 2.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/<script>.py): import from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import concurrent.futures
import math
import os
import random
import secrets
import signal
import time
import uuid

from benchmarks.kit import paths
from benchmarks.kit.load import LoadAverage, describe
from benchmarks.kit.plots import lines, pyplot, save
from benchmarks.kit.report import fmt, mean
from benchmarks.kit.results import Results

KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4  # SmolLM2-135M, float32 (checked against the model below)
METHODS = ("full-kv", "verified", "recompute")


def parse_args(argv=None):
    from vericache_connector.demo.procs import REF_KV_BYTES_PER_TOKEN
    from vericache_connector.store.config import STORE_DEFAULT

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gbits", nargs="+", type=float, default=[0.2, 0.5, 1.0, 2.5, 10.0], help="slow link, Gbit/s")
    p.add_argument("--drafters", nargs="+", type=int, default=[1, 2, 4])
    p.add_argument("--methods", nargs="+", default=list(METHODS), help="of full-kv verified recompute local")
    p.add_argument("--rounds", type=int, default=3, help="requests per drafter per method and setting")
    p.add_argument("--prompts", type=int, default=4, help="bundled prompts used (cut to --prompt-tokens)")
    p.add_argument("--prompt-tokens", type=int, default=1600)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--compressor", default=STORE_DEFAULT, help="the compressed copy the drafters fetch")
    p.add_argument("--draft-k", type=int, default=16, help="the most drafts per verify call (ours sends what is ready)")
    p.add_argument("--draft-weights", default="model", help="the drafters' draft forward: model, bfloat16, int8")
    p.add_argument("--fast-gbyte", type=float, default=40.0, help="the verifier's link, GB/s (paper: 40)")
    p.add_argument("--scale-to", default="llama3-8b", choices=[*REF_KV_BYTES_PER_TOKEN, "none"])
    p.add_argument("--rates", nargs="*", type=float, default=[0.1, 0.2, 0.35], help="req/s per drafter (sweep)")
    p.add_argument("--rate-setting", nargs=2, type=float, default=[1.0, 2], metavar=("GBIT", "DRAFTERS"))
    p.add_argument("--rate-requests", type=int, default=4, help="requests per drafter per rate and method")
    p.add_argument(
        "--pin",
        action="store_true",
        help="verifier on the last core, every drafter on the others (separate machines' compute, emulated)",
    )
    p.add_argument("--backend", default="engine", choices=["engine", "vllm"], help="our engine or vLLM servers")
    p.add_argument(
        "--block-size", type=int, default=None, help="--backend vllm: vLLM's --block-size (default: its own)"
    )
    p.add_argument("--out", default="results/disaggregated")
    return p.parse_args(argv)


class Cluster:
    """The verifier and the drafters as processes on 127.0.0.1 (vericache_connector/demo/procs.py, which the
    shared-prefix demo uses too)."""

    def __init__(self, args, store: str, logs: Path, token: str):
        from vericache_connector.demo.procs import REF_KV_BYTES_PER_TOKEN
        from vericache_connector.remote.auth import write_keys

        self.args, self.store, self.logs, self.token = args, store, logs, token
        self.keys = write_keys(str(logs / "keys"))  # CURVE: the verifier's and the drafters' key pairs
        self.scale = 1.0 if args.scale_to == "none" else KV_BYTES_PER_TOKEN / REF_KV_BYTES_PER_TOKEN[args.scale_to]
        self.verifier = self._start(
            ["verifier", "--port", "0", "--bandwidth-bytes-per-s", str(args.fast_gbyte * 1e9 * self.scale)], "verifier"
        )
        self.drafters: list = []

    def env(self) -> dict[str, str]:
        from vericache_connector.demo import procs

        return procs.node_env(self.store, {"VERICACHE_VERIFIER_TOKEN": self.token, **self.keys})

    def cores(self, name: str) -> list[int] | None:
        from benchmarks.disaggregated_vllm import pin_cores

        return pin_cores(self.args.pin, name)

    def _start(self, argv: list[str], name: str):
        from vericache_connector.demo import procs

        p = procs.Proc(name, argv, str(self.logs / f"{name}.log"), self.env(), self.cores(name))
        try:
            p.wait_ready(600)
        except BaseException:
            p.stop()
            raise
        return p

    def rate(self, gbit: float) -> float:
        return gbit * 1e9 / 8 * self.scale

    def start_drafters(self, n: int, gbit: float) -> None:
        self.stop_drafters()
        argv = [
            "drafter", "--port", "0", "--verifier", self.verifier.url, "--draft-weights", self.args.draft_weights,
            "--compressor", self.args.compressor,
            "--bandwidth-bytes-per-s", str(self.rate(gbit)), "--store-timeout-s", "60",
        ]  # fmt: skip
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            self.drafters = list(pool.map(lambda i: self._start(argv, f"drafter{i}-{gbit:g}G"), range(n)))

    def stop_drafters(self) -> None:
        for d in self.drafters:
            d.stop()
        self.drafters = []

    def close(self) -> None:
        self.stop_drafters()
        self.verifier.stop()

    def request(self, i: int, ids: list[int], method: str, args) -> dict:
        from vericache_connector.demo import procs

        return procs.request(self.drafters[i].url, ids, method, args.new_tokens, args.draft_k, timeout_s=1200)

    def reset(self) -> None:
        return  # our verifier frees a request's KV when it ends; drafters keep no prompt between requests

    def load_rate(self) -> list[float]:
        """The verifier's full-copy reads, bytes/s each (its log)."""
        return [float(x.split("(")[1].split(" bytes")[0]) / float(x.split(", ")[1].split("s)")[0])
                for x in (self.verifier.log().split("full KV loaded ")[1:]) if "bytes, " in x]  # fmt: skip


BACKENDS = {
    "engine": "our engine: `vericache verifier` + `vericache drafter` processes",
    "vllm": "vLLM servers: a verifier server with the connector, drafter-role servers behind `vericache router`",
}


def make_cluster(args, store: str, logs: Path, token: str):
    if args.backend == "engine":
        return Cluster(args, store, logs, token)
    from benchmarks.disaggregated_vllm import VLLMCluster
    from vericache_connector.demo.procs import REF_KV_BYTES_PER_TOKEN

    scale = 1.0 if args.scale_to == "none" else KV_BYTES_PER_TOKEN / REF_KV_BYTES_PER_TOKEN[args.scale_to]
    return VLLMCluster(args, store, logs, token, scale)


def run_setting(cluster: Cluster, prompts: dict, gbit: float, n: int, args, ref: dict) -> list[dict]:
    """`rounds` rounds; in each, every method in turn sends one request to each of the n drafters at once."""
    names, rows = list(prompts), []
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        for r in range(args.rounds):
            for method in args.methods:
                jobs = [(i, names[(i + r) % len(names)]) for i in range(n)]
                cluster.reset()
                t0 = time.perf_counter()
                outs = list(pool.map(lambda j: cluster.request(j[0], prompts[j[1]], method, args), jobs))
                batch_s = time.perf_counter() - t0
                for (i, name), out in zip(jobs, outs):
                    if method == "full-kv" and out["path"] == "fetch":
                        ref.setdefault(name, out["tokens"])
                    rows.append(dict(gbit=gbit, drafters=n, round=r, method=method, prompt=name, drafter=i,
                                     batch_s=batch_s, backend=args.backend,
                                     **{k: v for k, v in out.items() if k != "status"}))  # fmt: skip
    return rows


def run_rates(cluster: Cluster, prompts: dict, args, ref: dict) -> list[dict]:
    """Open loop: each drafter gets Poisson arrivals at `rate`; latency counts from the arrival."""
    gbit, n = args.rate_setting[0], int(args.rate_setting[1])
    names, rows = list(prompts), []
    for rate in args.rates:
        rnd, plan = random.Random(f"{rate}"), []  # the same arrivals for every method: a paired comparison
        for i in range(n):
            t = 0.0
            for j in range(args.rate_requests):
                t += rnd.expovariate(rate)
                plan.append((t, i, names[(i + j) % len(names)]))
        for method in args.methods:
            cluster.reset()
            t0 = time.perf_counter()

            def fire(job):
                at, i, name = job
                time.sleep(max(0.0, t0 + at - time.perf_counter()))
                out = cluster.request(i, prompts[name], method, args)
                return dict(arrival_s=at, done_s=time.perf_counter() - t0, latency_s=time.perf_counter() - t0 - at,
                            prompt=name, drafter=i, **out)  # fmt: skip

            with concurrent.futures.ThreadPoolExecutor(len(plan)) as pool:
                outs = list(pool.map(fire, plan))
            for o in outs:
                rows.append(dict(rate=rate, gbit=gbit, drafters=n, method=method, **o))
            print(f"  rate {rate:g}/s per drafter, {method}: mean latency "
                  f"{mean([o['latency_s'] for o in outs]):.2f}s", file=sys.stderr, flush=True)  # fmt: skip
    return rows


def summarize(rows: list[dict], ref: dict, methods) -> list[dict]:
    out = []
    for gbit, n in dict.fromkeys((r["gbit"], r["drafters"]) for r in rows):
        at = [r for r in rows if (r["gbit"], r["drafters"]) == (gbit, n)]
        by = {m: [r for r in at if r["method"] == m] for m in methods}
        lat = {m: mean([r["wall_s"] for r in rs]) for m, rs in by.items()}
        full = by.get("full-kv", [])
        fetch = mean([r.get("full_arrived_s") for r in full])
        decode = mean([r["total_s"] - r["full_arrived_s"] for r in full if r.get("full_arrived_s") is not None])
        checked = [r for r in at if r["method"] != "full-kv" or r["path"] == "fetch"]
        same = [r["tokens"] == ref.get(r["prompt"]) for r in checked]
        v = by.get("verified", [])
        row = dict(
            backend=at[0].get("backend", "engine"),
            slow_link_gbit=gbit,
            drafters=n,
            fetch_over_decode=fetch / decode if fetch and decode else None,
            latency_speedup_vs_full=lat["full-kv"] / lat["verified"]
            if lat.get("full-kv") and lat.get("verified")
            else None,
            latency_speedup_vs_recompute=(
                lat["recompute"] / lat["verified"] if lat.get("recompute") and lat.get("verified") else None
            ),
            identical=all(same),
            requests=len(at),
            identical_count=sum(same),
            fetch_s=fetch,
            decode_s=decode,
            verified_paths=sorted({r["path"] for r in v}),
            verified_mean_accepted=mean([r.get("mean_accepted") for r in v]),
            verified_calls=mean([r.get("verify_calls") for r in v]),
            # draft forwards per emitted token (> 1: drafts thrown away after a rejection) and the first-token wait
            verified_draft_steps_per_token=mean(
                [r["draft_steps"] / len(r["tokens"]) for r in v if r["path"] == "verified" and r["tokens"]]
            ),
            verified_first_token_s=mean([r.get("first_token_s") for r in v]),
            verified_compressed_s=mean([r.get("compressed_s") for r in v]),  # its copy fetched over the slow link
            **{f"latency_s_{m}": lat[m] for m in methods},
            **{
                f"throughput_rps_{m}": len(rs) / sum({r["round"]: r["batch_s"] for r in rs}.values())
                for m, rs in by.items()
                if rs
            },
        )
        out.append(row)
    return out


def summarize_rates(rows: list[dict], ref: dict) -> list[dict]:
    out = []
    for rate, method in dict.fromkeys((r["rate"], r["method"]) for r in rows):
        rs = [r for r in rows if (r["rate"], r["method"]) == (rate, method)]
        span = max(r["done_s"] for r in rs) - min(r["arrival_s"] for r in rs)
        out.append(
            dict(
                rate_per_drafter=rate,
                offered_rps=rate * rs[0]["drafters"],
                method=method,
                latency_s=mean([r["latency_s"] for r in rs]),
                latency_p90_s=sorted(r["latency_s"] for r in rs)[math.ceil(0.9 * len(rs)) - 1],  # nearest rank
                throughput_rps=len(rs) / span,
                identical=sum(r["tokens"] == ref.get(r["prompt"]) for r in rs),
                requests=len(rs),
            )
        )
    return out


def tables(summary, rates, header) -> str:
    out = [*header, "", "### Mean request latency per setting (closed loop: every drafter one request at a time)", ""]
    out += [
        "| slow link Gbit/s | drafters | fetch / decode | full-kv s | verified s | recompute s "
        "| **speedup vs full-kv** | speedup vs recompute | accepted/call | calls/request | draft steps/token "
        "| verified: compressed copy in s | verified first token s | == full-KV |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary:
        out.append(
            f"| {r['slow_link_gbit']:g} | {r['drafters']} | {fmt(r['fetch_over_decode'])} "
            f"| {fmt(r.get('latency_s_full-kv'))} | {fmt(r.get('latency_s_verified'))} "
            f"| {fmt(r.get('latency_s_recompute'))} | **{fmt(r['latency_speedup_vs_full'])}x** "
            f"| {fmt(r['latency_speedup_vs_recompute'])}x | {fmt(r['verified_mean_accepted'])} "
            f"| {fmt(r['verified_calls'], '.1f')} | {fmt(r['verified_draft_steps_per_token'])} "
            f"| {fmt(r['verified_compressed_s'])} | {fmt(r['verified_first_token_s'])} "
            f"| {r['identical_count']}/{r['requests']} |"
        )
    if rates:
        out += ["", "### Latency and throughput vs request rate (open loop, Poisson arrivals per drafter)", ""]
        out += [
            "| req/s per drafter | offered req/s | method | mean latency s | p90 s | throughput req/s | == full-KV |",
            "|---:|---:|---|---:|---:|---:|---:|",
        ]
        for r in rates:
            out.append(
                f"| {r['rate_per_drafter']:g} | {r['offered_rps']:g} | {r['method']} | {fmt(r['latency_s'])} "
                f"| {fmt(r['latency_p90_s'])} | {fmt(r['throughput_rps'], '.3f')} | {r['identical']}/{r['requests']} |"
            )
    return "\n".join(out)


def plots(summary, rates, out: Path) -> list[str]:
    import matplotlib.ticker

    plt, files = pyplot(), []
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    x, y = "fetch_over_decode", "latency_speedup_vs_full"
    drafters = sorted({r["drafters"] for r in summary})
    lines(ax, [r for r in summary if r[x] and r[y]], "drafters", x, y, drafters, "1 verifier + {} drafter(s)".format)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.axhline(1.5, color="gray", lw=0.8, ls="--")
    ax.axvline(1.0, color="gray", lw=0.8, ls=":")
    ax.set_xscale("log")
    ax.set_xticks([0.1, 0.2, 0.3, 0.5, 1, 2, 3, 5, 10])
    ax.xaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("remote fetch time / decode time (full-KV baseline; links emulated on the CPU)")
    ax.set_ylabel("mean latency: full-KV fetch / verified")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    files.append(save(fig, out / "speedup_vs_ratio.png"))
    if rates:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
        for method in dict.fromkeys(r["method"] for r in rates):
            rs = [r for r in rates if r["method"] == method]
            a1.plot([r["offered_rps"] for r in rs], [r["latency_s"] for r in rs], marker="o", label=method)
            a2.plot([r["offered_rps"] for r in rs], [r["throughput_rps"] for r in rs], marker="o", label=method)
        a1.set_xlabel("offered load, req/s (all drafters)")
        a1.set_ylabel("mean latency, s (queueing included)")
        a2.set_xlabel("offered load, req/s (all drafters)")
        a2.set_ylabel("throughput, req/s")
        for a in (a1, a2):
            a.grid(alpha=0.3)
            a.legend(fontsize=7)
        files.append(save(fig, out / "latency_throughput_vs_rate.png"))
    return files


def main(argv=None) -> int:
    paths.setup()
    args = parse_args(argv)
    # `timeout` sends SIGTERM: exit through the finally below, so the verifier and drafters are stopped too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from transformers import AutoTokenizer

    from storage_backends import stored_prefix_len
    from vericache_connector.data import load_prompts
    from vericache_connector.model import resolve_model_dir

    redis = os.environ.get("VERICACHE_REDIS_URL")
    if not redis:
        raise SystemExit("VERICACHE_REDIS_URL is not set (source .ci/services.sh, or /tmp/svc.env here)")
    bad = set(args.methods) - {"full-kv", "verified", "recompute", "local"}
    if bad or "full-kv" not in args.methods or "verified" not in args.methods:
        raise SystemExit(f"--methods must include full-kv and verified (of full-kv verified recompute local): {bad}")
    if args.backend == "vllm" and "local" in args.methods:
        raise SystemExit("--methods local is our engine's (--backend engine): a vLLM node has no such mode")
    t_start = time.perf_counter()
    load = LoadAverage().start()  # a busy neighbour on 2 cores changes the ratios themselves
    tok = AutoTokenizer.from_pretrained(resolve_model_dir(None))
    texts = dict(list(load_prompts().items())[: args.prompts])
    prompts = {n: tok(t, add_special_tokens=False).input_ids[: args.prompt_tokens] for n, t in texts.items()}
    store = f"{redis}?prefix=bd{uuid.uuid4().hex[:8]}:"
    out = Results.create(args.out, argv)
    cluster = make_cluster(args, store, out.logs, secrets.token_hex(24))
    rows, rate_rows, ref = [], [], {}
    try:
        for gbit in args.gbits:
            cluster.start_drafters(max(args.drafters), gbit)
            if not ref and args.backend == "vllm":  # the verifier's own greedy outputs; it stores both copies
                ref.update(cluster.warm(prompts, args.new_tokens))
            elif not ref:  # a cold request per prompt writes both copies, as a miss does
                for ids in prompts.values():
                    cluster.request(0, ids, "local", args)
            for n in args.drafters:
                rows += run_setting(cluster, prompts, gbit, n, args, ref)
                s = summarize([r for r in rows if (r["gbit"], r["drafters"]) == (gbit, n)], ref, args.methods)[0]
                print(
                    f"{gbit:g} Gbit/s, {n} drafter(s): fetch/decode {fmt(s['fetch_over_decode'])}, verified "
                    f"{fmt(s['latency_speedup_vs_full'])}x vs full-kv, identical {s['identical']}",
                    file=sys.stderr,
                    flush=True,
                )
            if args.rates and gbit == args.rate_setting[0]:
                rate_rows = run_rates(cluster, prompts, args, ref)
    finally:
        cluster.close()
    summary = summarize(rows, ref, args.methods)
    rates = summarize_rates(rate_rows, ref) if rate_rows else []
    wall = time.perf_counter() - t_start
    cmd = out.command
    loads = cluster.load_rate()
    stored = {n: stored_prefix_len(len(ids), 256) for n, ids in prompts.items()}
    header = [
        f"# Drafters + verifier ({BACKENDS[args.backend]}): 1 verifier + N drafters (processes on 127.0.0.1, real "
        f"Redis), SmolLM2-135M float32 "
        f"on the CPU, greedy, {args.new_tokens} new tokens, compressed copy {args.compressor}, draft_k {args.draft_k}, "
        f"drafter draft weights "
        f"{args.draft_weights}; prompts "
        + ", ".join(f"{n} ({len(ids)} tok, {stored[n]} stored)" for n, ids in prompts.items()),
        "",
        f"Links EMULATED on the CPU: the drafters' slow link is a token bucket at Gbit/s x {cluster.scale:.4f} "
        f"(our {KV_BYTES_PER_TOKEN} B/token KV vs {args.scale_to}'s), so transfer times equal {args.scale_to}'s over "
        f"that link; the verifier's link: {args.fast_gbyte:g} GB/s scaled the same way, above what loopback Redis "
        f"gives: it read full copies at {fmt(mean(loads) and mean(loads) / 1e6, '.0f')} MB/s (mean of "
        f"{len(loads)} loads). Compute is not scaled; "
        + (
            f"--pin: the verifier runs on core {cluster.cores('verifier')[0]} and every drafter on cores "
            f"{','.join(map(str, cluster.cores('drafter')))} (in every method alike), as if on separate machines."
            if args.pin
            else f"all processes share this machine's {os.cpu_count()} cores."
        ),
        "Latency = client-measured request time. Speedup = mean full-kv latency / mean verified latency in the same "
        "setting (methods interleaved round by round). fetch / decode = the full-kv baseline's fetch time / its "
        "time after the fetch (suffix prefill + decoding). == full-KV: outputs identical to the full-kv output "
        "of the same prompt (plain full-KV greedy"
        + ("; --backend vllm: the verifier server's own greedy output)." if args.backend == "vllm" else ")."),
        f"Command: `{cmd}`  Wall time: {wall:.0f} s. {describe(load.stop())} (the servers' own load included).",
    ]
    table = tables(summary, rates, header)
    files = plots(summary, rates, out.path)
    payload = dict(
        backend=args.backend,
        command=cmd,
        wall_s=wall,
        load_avg=load.record(),
        links_emulated=True,
        bandwidth_scale=cluster.scale,
        verifier_load_mb_per_s=mean(loads) and mean(loads) / 1e6,
        prompts={n: len(ids) for n, ids in prompts.items()},
        stored=stored,
        args=vars(args),
        summary=summary,
        rates=rates,
        rows=[{k: v for k, v in r.items() if k != "tokens"} for r in rows],
        rate_rows=[{k: v for k, v in r.items() if k != "tokens"} for r in rate_rows],
        plots=files,
    )
    out.write(payload, table)
    print(table)
    ok = all(r["identical"] for r in summary) and all(r["identical"] == r["requests"] for r in rates)
    print(f"every output identical to full-KV greedy: {ok}; wrote {out} in {wall:.0f} s", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

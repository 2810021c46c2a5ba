"""The summary of a vllm_bench.py run: one entry per (link, concurrency, configuration), means over rounds, with
its ratio to the best alternative, its first token against plain vLLM's and the logs' counts.

A new per-row figure is a line in entry() (from the row's client JSON or its log_stats)."""

from __future__ import annotations

import statistics

from benchmarks.kit.report import mean, ratio
from benchmarks.vllm_load.client import METRICS, client_metrics, client_record
from benchmarks.vllm_load.exact import check_runs
from benchmarks.vllm_load.grid import BY_NAME, OURS, REFERENCE
from benchmarks.vllm_load.logs import summed

EMULATED = "the store link is EMULATED on the CPU (a token bucket on the store's reads); the compute is real"


def summarize(args, runs: list[dict], workload: dict, load: dict, command: str) -> dict:
    """runs: one dict per client run (round, concurrency, gbits, configuration, client: vLLM's JSON or None,
    client_json, logs: log_stats, log_excerpt, server_logs, load_avg, error). The summary: one entry per (gbits,
    concurrency, configuration), means over rounds; plain vLLM's runs are listed under every link. Each run keeps
    client_record() of its client JSON (keep_texts: which runs keep their texts)."""
    ref_label = REFERENCE[args.topology]
    check_runs(runs, ref_label, args.configs, args.concurrency, workload["requests"], args.new)
    for r in runs:
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
        compare_point(s, point, ref_label, OURS[args.topology])
        s["drafters"] = args.drafters if args.topology == "router" else None
        if args.topology == "router":  # every configuration the same cores (router.py)
            from benchmarks.vllm_load.router import cores_of

            s["cores"] = cores_of()
    keep_texts(runs, ref_label)
    return {
        "command": command,
        "args": vars(args),
        "emulated": EMULATED,
        "load_avg": load,
        "workload": workload,
        "summary": summary,
        "runs": runs,
    }


def keep_texts(runs: list[dict], ref_label: str) -> None:
    """Each run's client JSON -> client_record(): the generated texts kept once, with the first reference run
    (the lowest concurrency's, round 0), and with every run whose texts differ from those; the others' equal
    digests say they are the same texts."""
    refs = [r for r in runs if r["configuration"] == ref_label and r.get("client")]
    first = min(refs, key=lambda r: (r["round"], r["concurrency"]), default=None)
    texts = first and first["client"].get("generated_texts")
    for r in runs:
        if r.get("client") is not None:
            same = r is not first and r["client"].get("generated_texts") == texts
            r["client"] = client_record(r["client"], texts=not same)


def compare_point(s: dict, point: list[dict], ref_label: str, ours: str) -> None:
    """s against the other entries at its (link, concurrency): x best alternative, TTFT ratios, fetch / decode."""
    alts = [t for t in point if BY_NAME[t["configuration"]].alternative and t["output_throughput"]]
    best = max(alts, key=lambda t: t["output_throughput"], default=None)
    s["best_alternative"] = best and best["configuration"]
    s["x_best_alternative"] = ratio(s["output_throughput"], best and best["output_throughput"])
    p = next((t for t in point if t["configuration"] == ref_label), None)
    s["ttft_vs_plain"] = ratio(s["mean_ttft_s"], p and p["mean_ttft_s"])
    fastest = min((t["mean_ttft_s"] for t in alts if t["mean_ttft_s"] is not None), default=None)
    s["ttft_vs_best_alternative"] = ratio(s["mean_ttft_s"], fastest)
    loaders = [t for t in point if t.get("mean_load_s") is not None and t["configuration"] != ours]
    decode = p and p["mean_e2e_s"] is not None and p["mean_e2e_s"] - p["mean_ttft_s"]
    s["fetch_over_decode"] = loaders[0]["mean_load_s"] / decode if loaders and decode else None


def mean_by_key(dicts) -> dict[str, float] | None:
    """Per-key means of {key: value} dicts (None where none has any)."""
    keys: dict[str, list[float]] = {}
    for d in dicts:
        for k, v in (d or {}).items():
            keys.setdefault(k, []).append(v)
    return {k: round(statistics.fmean(v), 1) for k, v in sorted(keys.items(), key=lambda kv: int(kv[0]))} or None


def served_paths(router_paths: dict[str, int], requests: int) -> dict[str, int]:
    """The router's per-request paths (router/paths.py) as issue 53 counts them: drafted (verified), direct (a
    verifier decoded it by itself: direct, plain, or passed on as it came, which the router does not log),
    handed_back (started drafted, finished plainly on a verifier after a fault: fallback), alone (a drafter
    computed and decoded it by itself, exact)."""
    logged = sum(router_paths.values())
    return {
        "drafted": router_paths.get("verified", 0),
        "direct": router_paths.get("direct", 0) + router_paths.get("plain", 0) + max(0, requests - logged),
        "handed_back": router_paths.get("fallback", 0),
        "alone": router_paths.get("alone", 0),
    }


def entry(label: str, gbits: float, concurrency: int, mine: list[dict]) -> dict:
    """One summary entry from the runs of one (configuration, link, concurrency), one per round."""
    done = [r for r in mine if r.get("metrics")]
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
    # where the accepted tokens came from (compressed-KV drafts, pre-drafts, n-gram matches), over the rounds, and
    # the proposer's step times: vLLM's step by batch size, one batched view draft step by rows drafting
    out["accepted_by_source"] = summed(r.get("accepted_by_source") for r in done) or None
    out["target_step_ms"] = mean_by_key(lg.get("target_step_ms") for lg in logs)
    out["draft_step_ms"] = mean_by_key(lg.get("draft_step_ms") for lg in logs)
    out["router_paths"] = summed(lg.get("router_paths") for lg in logs) or None  # verified / direct / alone ...
    requests = sum((r.get("client") or {}).get("completed") or 0 for r in done)
    out["paths"] = served_paths(out["router_paths"], requests) if out["router_paths"] else None
    calls = sum(lg.get("router_verify_calls", 0) for lg in logs)
    out["accepted_per_verify_call"] = sum(lg.get("router_accepted", 0) for lg in logs) / calls if calls else None
    return out

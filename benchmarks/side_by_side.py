"""Side by side on the same prompts, in one process: full-KV fetch, recompute, lossy compressed, VeriCache.

For every emulated link bandwidth (Gbit/s on the real link, scaled to the model's KV bytes, see below):
  (a) full-kv    fetch the whole full KV copy over the link, then plain decoding (what LMCache does today)
  (b) recompute  no cache: prefill the whole prompt here, then plain decoding
  (c) lossy      fetch only the compressed copy and decode on it (drifts: first divergence from (a), token
                 agreement, and mean KL(full || lossy) of next-token distributions, teacher-forced along (a)'s
                 output)
  (d) vericache  fetch the compressed copy, draft on it at once while the full copy streams in layer by
                 layer, verify on the full KV (RemotePrefixCache.generate, the hit path). Output == (a).

The link is the REAL path: a throttled local:// DualCopyStore (token bucket on reads) for (a) and (c), and
RemotePrefixCache(local://, bandwidth_bytes_per_s) for (d); the copies are written first, unthrottled, exactly
as a miss would write them (prefill of the chunk-aligned stored prefix, compressed with each preset).

Bandwidth scaling: the emulated rate is gbit * 1e9 / 8 * (model KV bytes/token) / (reference KV bytes/token),
reference = Llama-3-8B in bf16 (32 layers x 8 KV heads x 128 x 2 (K,V) x 2 bytes = 128 KiB/token). So moving
SmolLM2's KV (float32 on CPU: 30 x 3 x 64 x 2 x 4 = 45 KiB/token) takes exactly as long as moving Llama-3-8B's
KV for the same token count over the stated real link. Compute is NOT scaled (CPU SmolLM2 steps).

    python benchmarks/side_by_side.py                                  # the default grid (run_all.sh)
    python benchmarks/side_by_side.py --compressors kivi4 --ks 8 --gbits 10 --extra-compressors --json
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/<script>.py): import from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import asyncio
import json
import time
from dataclasses import asdict, dataclass, field

from tqdm.auto import tqdm

from benchmarks.kit import paths
from benchmarks.kit.load import LoadAverage
from benchmarks.kit.plots import points, pyplot, save
from benchmarks.kit.report import fmt, mean
from benchmarks.kit.results import Results

REF_KV_BYTES_PER_TOKEN = {
    "llama3-8b": 32 * 8 * 128 * 2 * 2,
    "qwen3-32b": 64 * 8 * 128 * 2 * 2,
    "llama3.3-70b": 80 * 8 * 128 * 2 * 2,
}
DEFAULT_SWEEP = ["kivi4", "snapkv-4x"]  # all draft horizons
DEFAULT_GBITS = [1.0, 10.0, 25.0, 100.0]
DEFAULT_KS = ["4", "8", "16", "32", "adaptive"]
STORE_URL = "local://side-by-side"


def parse_args(argv=None):
    from vericache_connector.compressors import PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--compressors", nargs="+", default=DEFAULT_SWEEP, help="presets/specs swept over every --ks and every --gbits"
    )
    p.add_argument("--ks", nargs="+", default=DEFAULT_KS, help="draft horizons; 'adaptive' = start 8, 2..32")
    p.add_argument(
        "--extra-compressors",
        nargs="*",
        default=sorted(PRESETS),
        help="presets run at --extra-k only (default: every preset); pass none to skip",
    )
    p.add_argument("--extra-k", default="8")
    p.add_argument(
        "--extra-gbits",
        nargs="*",
        type=float,
        default=[1.0, 10.0],
        help="bandwidths for the extra compressors (default 1 10; 'all' grid: pass the --gbits)",
    )
    p.add_argument("--gbits", nargs="+", type=float, default=DEFAULT_GBITS, help="real link Gbit/s")
    p.add_argument(
        "--scale-to",
        default="llama3-8b",
        choices=[*REF_KV_BYTES_PER_TOKEN, "none"],
        help="scale the link so our KV moves as fast as this model's KV would (none: raw)",
    )
    p.add_argument("--prompts", type=int, default=2, help="the N shortest bundled prompts")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--chunk-size", type=int, default=256)
    p.add_argument("--k-max", type=int, default=32, help="cap of round-1 drafting while the full KV streams")
    p.add_argument("--model", default=None)
    p.add_argument("--out", default="results/side_by_side")
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    return p.parse_args(argv)


@dataclass
class Run:
    """One request: method x compressor x k x bandwidth x prompt."""

    method: str  # full-kv | recompute | lossy | vericache
    prompt: str
    gbit: float | None  # None: no link involved (recompute)
    compressor: str = "-"
    k: str = "-"
    total_s: float = 0.0  # end to end: request in -> last token out
    first_token_s: float = 0.0
    full_arrived_s: float | None = None
    new_tokens: int = 0
    accepted: float | None = None  # mean accepted drafts per verification, all rounds (vericache)
    accepted_at_k: float | None = None  # the same over rounds that drafted exactly k (not the long round 1)
    round1_drafts: int | None = None  # drafts made in round 1 (more than k while the full KV streams in)
    first_emit: int = 1  # tokens in the first emission (round 1: accepted + bonus)
    bytes_compressed: int = 0
    bytes_full: int = 0
    tokens: list[int] = field(default_factory=list, repr=False)
    path: str = ""

    @property
    def decode_tps(self) -> float | None:
        """Tokens/s after the first emission; None when every token came in the first one."""
        rest = self.new_tokens - self.first_emit
        return None if rest <= 0 else rest / max(1e-9, self.total_s - self.first_token_s)

    @property
    def overall_tps(self) -> float:
        return self.new_tokens / self.total_s


def decode_cfg(k: str, new_tokens: int, k_max: int):
    from vericache_connector.engine.speculative import DecodeConfig

    if k == "adaptive":
        return DecodeConfig(
            max_new_tokens=new_tokens, draft_k=8, adaptive=True, k_min=2, k_max=max(k_max, 8), stop_at_eos=False
        )
    return DecodeConfig(max_new_tokens=new_tokens, draft_k=int(k), k_min=1, k_max=max(k_max, int(k)), stop_at_eos=False)


class Bench:
    def __init__(self, engine, args):
        import torch

        self.torch, self.engine, self.args = torch, engine, args
        c = engine.model.cfg
        self.kv_bytes_per_token = c.num_layers * c.num_kv_heads * c.head_dim * 2 * engine.model.dtype.itemsize
        ref = self.kv_bytes_per_token if args.scale_to == "none" else REF_KV_BYTES_PER_TOKEN[args.scale_to]
        self.scale = self.kv_bytes_per_token / ref

    def rate(self, gbit: float) -> float:
        return gbit * 1e9 / 8 * self.scale

    def store(self, gbit: float | None):
        from storage_backends import DualCopyStore

        return DualCopyStore(
            STORE_URL,
            self.engine.model_name,
            self.engine.model.dtype,
            self.args.chunk_size,
            None if gbit is None else self.rate(gbit),
        )

    # ---- setup: the copies a miss would have written --------------------------------------------
    def write_copies(self, ids: list[int], compressors: dict) -> int:
        from storage_backends import stored_prefix_len

        stored = stored_prefix_len(len(ids), self.args.chunk_size)
        pre = self.engine.prefill(ids[:stored])
        layers = [{"k": k, "v": v} for k, v in zip(pre.prefix.keys, pre.prefix.values)]
        comps = {}
        for comp in compressors.values():
            c = comp.compress(pre.prefix)
            comps[c.spec] = c.to_payload()
        asyncio.run(self._put(ids[:stored], layers, comps))
        return stored

    async def _put(self, prefix, layers, comps):
        store = self.store(None)
        await store.put_prefix(prefix, layers, comps)
        await store.close()

    # ---- (b) recompute ------------------------------------------------------------------------
    def recompute(self, name: str, ids: list[int]) -> Run:
        t0 = time.perf_counter()
        cfg = decode_cfg("8", self.args.new_tokens, self.args.k_max)
        pre = self.engine.prefill(ids)
        t_first = time.perf_counter() - t0
        outs = self.engine.generate_full([pre], cfg)
        return Run(
            "recompute",
            name,
            None,
            total_s=time.perf_counter() - t0,
            first_token_s=t_first,
            new_tokens=len(outs[0]),
            tokens=outs[0],
            path="local",
        )

    # ---- (a) full-KV fetch, then plain decoding -------------------------------------------------
    def full_kv(self, name: str, ids: list[int], stored: int, gbit: float) -> tuple[Run, object]:
        from vericache_connector.engine.speculative import autoregressive_decode

        torch, model = self.torch, self.engine.model
        n_new = self.args.new_tokens
        t0 = time.perf_counter()
        cache = model.new_cache(1, len(ids) + n_new + 2)
        nbytes = asyncio.run(self._stream(ids[:stored], cache, gbit))
        arrived = time.perf_counter() - t0
        cache.lengths[0] = stored
        cfg = decode_cfg("8", n_new, self.args.k_max)
        first = self._suffix_first(ids, stored, cache)
        t_first = time.perf_counter() - t0
        outs = autoregressive_decode(model, cache, first, torch.tensor([len(ids)]), cfg)
        run = Run(
            "full-kv",
            name,
            gbit,
            total_s=time.perf_counter() - t0,
            first_token_s=t_first,
            full_arrived_s=arrived,
            new_tokens=len(outs[0]),
            bytes_full=nbytes,
            tokens=outs[0],
            path="fetch",
        )
        return run, cache

    async def _stream(self, prefix, cache, gbit) -> int:
        store, n, nbytes = self.store(gbit), len(prefix), 0
        try:
            async for layer, k, v in store.stream_full(prefix):
                cache.keys[layer][0, :, :n] = k
                cache.values[layer][0, :, :n] = v
                nbytes += k.nbytes + v.nbytes
        finally:
            await store.close()
        return nbytes

    def _suffix_first(self, ids, stored, cache):
        """Forward the prompt suffix onto `cache` (prefix loaded); greedy first token."""
        torch = self.torch
        suffix = torch.tensor([ids[stored:]])
        logits, _ = self.engine.model(suffix, torch.arange(stored, len(ids))[None], cache, last_only=True)
        return logits[:, -1].argmax(-1)

    # ---- (c) lossy: compressed copy only ---------------------------------------------------------
    def lossy(self, name, ids, stored, gbit, comp_name, comp) -> tuple[Run, object]:
        from vericache_connector.engine.speculative import autoregressive_decode

        torch, n_new = self.torch, self.args.new_tokens
        t0 = time.perf_counter()
        compressed = asyncio.run(self._fetch_compressed(ids[:stored], comp.spec, gbit))
        cache = self.engine.draft_cache([compressed], len(ids) - stored + n_new + 2)
        first = self._suffix_first(ids, stored, cache)
        t_first = time.perf_counter() - t0
        outs = autoregressive_decode(
            self.engine.model, cache, first, torch.tensor([len(ids)]), decode_cfg("8", n_new, self.args.k_max)
        )
        run = Run(
            "lossy",
            name,
            gbit,
            comp_name,
            total_s=time.perf_counter() - t0,
            first_token_s=t_first,
            new_tokens=len(outs[0]),
            bytes_compressed=compressed.nbytes,
            tokens=outs[0],
            path="compressed",
        )
        return run, compressed

    async def _fetch_compressed(self, prefix, spec, gbit):
        from vericache_connector.compressors import LayeredKV

        store = self.store(gbit)
        try:
            return LayeredKV.from_payload(*await store.get_compressed(prefix, spec))
        finally:
            await store.close()

    def teacher_forced_logp(self, ids, stored, cache_factory, reference: list[int]):
        """log-probs [N, V] predicting reference[i] given prompt + reference[:i], on the given prefix cache."""
        torch = self.torch
        cache = cache_factory(len(ids) - stored + len(reference) + 2)
        seq = ids[stored:] + reference[:-1]
        logits, _ = self.engine.model(torch.tensor([seq]), torch.arange(stored, stored + len(seq))[None], cache)
        p = len(ids) - stored
        return torch.log_softmax(logits[0, p - 1 :].float(), -1)

    # ---- (d) VeriCache, the real hit path -------------------------------------------------------
    def vericache(self, name, ids, gbit, comp_name, k) -> Run:
        from vericache_connector.remote.prefix_cache import RemoteCacheConfig, RemotePrefixCache

        cfg = RemoteCacheConfig(
            url=STORE_URL,
            compressor=comp_name,
            chunk_size=self.args.chunk_size,
            bandwidth_bytes_per_s=self.rate(gbit),
            timeout_s=120.0,
            model_name=self.engine.model_name,
        )
        with RemotePrefixCache(self.engine, cfg) as rc:
            res = rc.generate(ids, decode_cfg(k, self.args.new_tokens, self.args.k_max))
        tm, st = res.timings, res.stats
        acc, lens = st.accepted[0], st.draft_lengths
        at_k = [a for a, n in zip(acc, lens) if k == "adaptive" or n == int(k)]
        return Run(
            "vericache",
            name,
            gbit,
            comp_name,
            k,
            total_s=tm.total_s,
            first_token_s=tm.first_token_s,
            full_arrived_s=tm.full_arrived_s,
            new_tokens=len(res.tokens),
            accepted=st.mean_accepted(),
            accepted_at_k=mean(at_k),
            round1_drafts=lens[0] if lens else None,
            first_emit=min(len(res.tokens), acc[0] + 1) if acc else 1,
            bytes_compressed=res.bytes_compressed,
            bytes_full=res.bytes_full,
            tokens=res.tokens,
            path=res.path,
        )


def aggregate(runs: list[Run], quality: dict, ref_bytes: dict) -> list[dict]:
    """One row per (method, compressor, k, gbit), averaged over prompts, with ratios vs full-kv."""

    def keyf(r):
        return r.method, r.compressor, r.k, r.gbit

    groups: dict = {}
    for r in runs:
        groups.setdefault(keyf(r), []).append(r)
    base = {g: {r.prompt: r for r in rs} for (m, _, _, g), rs in groups.items() if m == "full-kv"}
    rows = []
    for (method, comp, k, gbit), rs in groups.items():
        gbits = [gbit] if gbit is not None else sorted(base)
        for g in gbits:  # recompute does not use the link: one row per bandwidth for the ratios
            ref = base.get(g, {})
            row = {
                "method": method,
                "compressor": comp,
                "k": k,
                "gbit": g,
                "total_s": mean([r.total_s for r in rs]),
                "first_token_s": mean([r.first_token_s for r in rs]),
                "full_arrived_s": mean([r.full_arrived_s for r in rs]),
                "decode_tps": mean([r.decode_tps for r in rs]),
                "overall_tps": mean([r.overall_tps for r in rs]),
                "accepted": mean([r.accepted for r in rs]),
                "accepted_at_k": mean([r.accepted_at_k for r in rs]),
                "round1_drafts": mean([r.round1_drafts for r in rs]),
                "mb_compressed": mean([r.bytes_compressed for r in rs]) / 2**20,
                "mb_full": mean([r.bytes_full for r in rs]) / 2**20,
                "speedup": mean([ref[r.prompt].total_s / r.total_s for r in rs if r.prompt in ref]),
                "ttft_speedup": mean([ref[r.prompt].first_token_s / r.first_token_s for r in rs if r.prompt in ref]),
                "identical": sum(r.tokens == ref[r.prompt].tokens for r in rs if r.prompt in ref),
                "prompts": len(rs),
            }
            if method == "lossy":
                row.update(quality.get(comp, {}))
            if method in ("lossy", "vericache") and comp in ref_bytes:
                row["bytes_ratio"] = ref_bytes[comp]
            rows.append(row)
    order = {"full-kv": 0, "recompute": 1, "lossy": 2, "vericache": 3}

    def kord(k):
        return 99 if k == "adaptive" else (int(k) if k.isdigit() else 0)

    rows.sort(key=lambda r: (r["gbit"], order[r["method"]], r["compressor"], kord(r["k"])))
    return rows


def tables(rows, header_lines) -> str:
    out = list(header_lines)
    out += [
        "",
        "### Latency and speedup vs (a) full-KV fetch + decode (per bandwidth)",
        "",
        "| Gbit/s | method | compressor | k | e2e s | TTFT s | full KV in s | tok/s overall | tok/s after 1st "
        "| acc/verify (at k) | round-1 drafts | comp MB | full MB | **speedup e2e** | TTFT speedup | == full-KV |",
        "|---:|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['gbit']:g} | {r['method']} | {r['compressor']} | {r['k']} | {fmt(r['total_s'])} "
            f"| {fmt(r['first_token_s'])} | {fmt(r['full_arrived_s'])} | {fmt(r['overall_tps'], '.1f')} "
            f"| {fmt(r['decode_tps'], '.1f')} | {fmt(r['accepted'], '.1f')} ({fmt(r['accepted_at_k'], '.1f')}) "
            f"| {fmt(r['round1_drafts'], '.0f')} | {fmt(r['mb_compressed'], '.1f')} | {fmt(r['mb_full'], '.1f')} "
            f"| **{fmt(r['speedup'])}x** | {fmt(r['ttft_speedup'])}x | {r['identical']}/{r['prompts']} |"
        )
    lossy = {}
    for r in rows:
        if r["method"] == "lossy":
            lossy.setdefault(r["compressor"], r)
    if lossy:
        out += [
            "",
            "### Quality of lossy compressed-only decoding (VeriCache and full-KV: agreement 1.0, KL 0)",
            "",
            "| compressor | bytes vs full | first divergence (token idx, per prompt) | token agreement "
            "| mean KL(full‖lossy) nats | teacher-forced top-1 agreement |",
            "|---|---:|---|---:|---:|---:|",
        ]
        for comp, r in lossy.items():
            out.append(
                f"| {comp} | {fmt(r.get('bytes_ratio'), '.3f')} | {r.get('first_divergence')} "
                f"| {fmt(r.get('agreement'), '.3f')} | {fmt(r.get('kl'), '.4f')} | {fmt(r.get('tf_top1'), '.3f')} |"
            )
    return "\n".join(out)


def plots(rows, ks, out: Path) -> list[str]:
    plt, files = pyplot(), []
    vc = [r for r in rows if r["method"] == "vericache"]
    # 1) acceptance vs draft length, per compressor (mean over bandwidths)
    fig, ax = plt.subplots(figsize=(6, 4))
    num_ks = [k for k in ks if k.isdigit()]
    for comp in dict.fromkeys(r["compressor"] for r in vc):
        pts = [
            (int(k), mean([r["accepted_at_k"] for r in vc if r["compressor"] == comp and r["k"] == k])) for k in num_ks
        ]
        pts = [(x, y) for x, y in pts if y is not None]
        if len(pts) >= 2:
            ax.plot(*zip(*pts), marker="o", label=comp)
            ad = mean([r["accepted"] for r in vc if r["compressor"] == comp and r["k"] == "adaptive"])
            if ad is not None:
                ax.axhline(ad, ls="--", lw=0.8, color=ax.lines[-1].get_color())
    if num_ks:
        xs = [int(k) for k in num_ks]
        ax.plot(xs, xs, "k:", label="all accepted")
        ax.set_xscale("log", base=2)
        ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("draft length k (dashed: adaptive)")
    ax.set_ylabel("accepted drafts per verification")
    ax.set_title("Acceptance vs draft length (rounds that drafted exactly k; mean over bandwidths)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    files.append(save(fig, out / "acceptance_vs_k.png"))
    # 2) speedup over full KV vs bandwidth
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    gb = sorted({r["gbit"] for r in rows})

    def line(sel, label, **kw):
        at = [{"gbit": g, "speedup": mean([r["speedup"] for r in rows if sel(r) and r["gbit"] == g])} for g in gb]
        pts = points(at, "gbit", "speedup")
        if pts:
            ax.plot(*zip(*pts), marker="o", label=label, **kw)

    line(lambda r: r["method"] == "recompute", "(b) recompute", color="gray", ls="--")
    sweep = list(dict.fromkeys(r["compressor"] for r in vc if r["k"] not in ("8",)))
    for comp in sweep:
        best = {}
        for r in vc:
            if r["compressor"] == comp:
                best[r["gbit"]] = max(best.get(r["gbit"], 0), r["speedup"] or 0)
        ax.plot(sorted(best), [best[g] for g in sorted(best)], marker="o", lw=2, label=f"(d) VeriCache {comp} (best k)")
    others = [r for r in vc if r["compressor"] not in sweep]
    if others:
        ax.scatter(
            [r["gbit"] for r in others],
            [r["speedup"] for r in others],
            s=14,
            color="tab:green",
            alpha=0.5,
            label="(d) VeriCache, other presets (k=%s)" % others[0]["k"],
        )
    for comp in sweep:
        line(
            lambda r, c=comp: r["method"] == "lossy" and r["compressor"] == c,
            f"(c) lossy {comp} (wrong output)",
            ls=":",
        )
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("real link bandwidth, Gbit/s (KV scaled to Llama-3-8B bytes)")
    ax.set_ylabel("end-to-end speedup over (a) full-KV fetch")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, which="both")
    files.append(save(fig, out / "speedup_vs_bandwidth.png"))
    # 3) quality vs throughput (at the lowest bandwidth, where the link matters most)
    g0 = gb[0]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    at = [r for r in rows if r["gbit"] == g0]
    los = [r for r in at if r["method"] == "lossy"]
    ax.scatter(
        [r["speedup"] for r in los],
        [r.get("agreement") for r in los],
        marker="x",
        color="tab:red",
        label="(c) lossy compressed-only",
    )
    for r in los:
        ax.annotate(r["compressor"], (r["speedup"], r.get("agreement")), fontsize=6)
    vcs = [r for r in at if r["method"] == "vericache"]
    ax.scatter(
        [r["speedup"] for r in vcs],
        [r["identical"] / r["prompts"] for r in vcs],
        marker="o",
        color="tab:green",
        alpha=0.6,
        label="(d) VeriCache (every compressor, k)",
    )
    rec = [r for r in at if r["method"] == "recompute"]
    ax.scatter([r["speedup"] for r in rec], [1.0] * len(rec), marker="s", color="gray", label="(b) recompute")
    ax.scatter([1.0], [1.0], marker="*", s=120, color="k", label="(a) full-KV fetch")
    ax.set_xlabel(f"end-to-end speedup over (a) at {g0:g} Gbit/s")
    ax.set_ylabel("token agreement with full-KV output")
    ax.set_ylim(-0.05, 1.08)
    ax.legend(fontsize=7, loc="lower left")
    ax.grid(alpha=0.3)
    files.append(save(fig, out / "quality_vs_speed.png"))
    return files


def main(argv=None) -> int:
    paths.setup()
    args = parse_args(argv)
    import torch

    from vericache_connector.compressors import get_compressor
    from vericache_connector.data import load_prompts
    from vericache_connector.demo import first_divergence
    from vericache_connector.engine import VeriCacheEngine

    for k in [*args.ks, args.extra_k]:
        if k != "adaptive" and not (k.isdigit() and int(k) >= 1):
            raise SystemExit(f"bad draft horizon {k!r}: a positive integer or 'adaptive'")
    extra_gbits = args.extra_gbits
    grid = [(c, k, g) for c in args.compressors for k in args.ks for g in args.gbits]
    grid += [
        (c, args.extra_k, g)
        for c in args.extra_compressors
        for g in extra_gbits
        if (c, args.extra_k, g) not in set(grid)
    ]
    comp_names = list(dict.fromkeys([c for c, _, _ in grid]))
    comps = {c: get_compressor(c) for c in comp_names}
    lossy_grid = list(dict.fromkeys((c, g) for c, _, g in grid))
    all_gbits = sorted({g for _, _, g in grid} | set(args.gbits))

    t_start, load = time.perf_counter(), LoadAverage().start()
    torch.manual_seed(0)
    engine = VeriCacheEngine.from_pretrained(args.model)
    bench = Bench(engine, args)
    texts = dict(list(load_prompts().items())[: args.prompts])
    prompt_ids = {n: engine.encode(t) for n, t in texts.items()}
    runs: list[Run] = []
    quality_raw: dict = {}
    ref_bytes: dict = {}
    stored_of = {}
    total = len(texts) * (2 + len(all_gbits) + len(lossy_grid) + len(grid))
    with tqdm(total=total, desc="side by side", unit="run") as bar:
        for name, ids in prompt_ids.items():
            bar.set_postfix_str(f"{name}: write copies")
            stored_of[name] = stored = bench.write_copies(ids, comps)
            bar.update(1)
            bar.set_postfix_str(f"{name}: recompute")
            runs.append(bench.recompute(name, ids))
            bar.update(1)
            full_tf = None
            ref_tokens = {}
            for g in all_gbits:
                bar.set_postfix_str(f"{name}: full-kv {g:g}G")
                run, cache = bench.full_kv(name, ids, stored, g)
                runs.append(run)
                ref_tokens[g] = run.tokens
                if full_tf is None:

                    def full_factory(extra, src=cache):
                        c = engine.model.new_cache(1, stored + extra)
                        c.load_row(0, [k[0, :, :stored] for k in src.keys], [v[0, :, :stored] for v in src.values])
                        return c

                    full_tf = bench.teacher_forced_logp(ids, stored, full_factory, run.tokens)
                bar.update(1)
            ref = ref_tokens[all_gbits[0]]
            for c, g in lossy_grid:
                bar.set_postfix_str(f"{name}: lossy {c} {g:g}G")
                run, compressed = bench.lossy(name, ids, stored, g, c, comps[c])
                runs.append(run)
                if (c, name) not in quality_raw:
                    lossy_tf = bench.teacher_forced_logp(
                        ids, stored, lambda extra, cc=compressed: engine.draft_cache([cc], extra), ref
                    )
                    kl = (full_tf.exp() * (full_tf - lossy_tf)).sum(-1)
                    quality_raw[(c, name)] = {
                        "first_divergence": first_divergence(ref, run.tokens),
                        "agreement": sum(a == b for a, b in zip(ref, run.tokens)) / len(ref),
                        "kl": float(kl.mean()),
                        "tf_top1": float((lossy_tf.argmax(-1) == full_tf.argmax(-1)).float().mean()),
                    }
                    ref_bytes.setdefault(c, []).append(compressed.nbytes / (stored * bench.kv_bytes_per_token))
                bar.update(1)
            for c, k, g in grid:
                bar.set_postfix_str(f"{name}: vericache {c} k={k} {g:g}G")
                runs.append(bench.vericache(name, ids, g, c, k))
                bar.update(1)
    quality = {}
    for c in comp_names:
        qs = [quality_raw[(c, n)] for n in prompt_ids if (c, n) in quality_raw]
        if qs:
            quality[c] = {
                "first_divergence": [q["first_divergence"] for q in qs],
                "agreement": mean([q["agreement"] for q in qs]),
                "kl": mean([q["kl"] for q in qs]),
                "tf_top1": mean([q["tf_top1"] for q in qs]),
            }
    ref_bytes = {c: mean(v) for c, v in ref_bytes.items()}
    rows = aggregate(runs, quality, ref_bytes)
    wall = time.perf_counter() - t_start

    out = Results.create(args.out, argv)
    cmd = out.command
    lens = {n: len(ids) for n, ids in prompt_ids.items()}
    vc_rows = [r for r in rows if r["method"] == "vericache"]
    all_identical = all(r["identical"] == r["prompts"] for r in vc_rows)
    header = [
        f"# VeriCache side by side: {engine.model_name} ({engine.model.dtype}, CPU, OMP threads "
        f"{torch.get_num_threads()}), greedy, {args.new_tokens} new tokens, prompts "
        + ", ".join(f"{n} ({lens[n]} tok, {stored_of[n]} stored)" for n in lens),
        "",
        f"Link: REAL path (throttled local:// DualCopyStore; RemotePrefixCache for VeriCache). Bandwidth column = "
        f"real link Gbit/s; emulated rate = Gbit/s x {bench.scale:.4f} "
        + (
            f"(our {bench.kv_bytes_per_token} B/token KV vs {args.scale_to}'s "
            f"{REF_KV_BYTES_PER_TOKEN[args.scale_to]} B/token), so transfer times equal {args.scale_to}'s over that link."
            if args.scale_to != "none"
            else "(unscaled)"
        ),
        "Ratios are (a) full-KV fetch + decode time / this method's time, per prompt, averaged. "
        f"(d) VeriCache output == (a) output: {'YES, every row' if all_identical else 'NO, see == column'}.",
        f"Command: `{cmd}`  Wall time: {wall:.0f} s",
    ]
    table = tables(rows, header)
    files = plots(rows, args.ks, out.path)
    payload = {
        "command": cmd,
        "wall_s": wall,
        "model": engine.model_name,
        "prompt_tokens": lens,
        "stored_tokens": stored_of,
        "kv_bytes_per_token": bench.kv_bytes_per_token,
        "bandwidth_scale": bench.scale,
        "scale_to": args.scale_to,
        "new_tokens": args.new_tokens,
        "rows": rows,
        "quality": quality,
        "runs": [{**{k: v for k, v in asdict(r).items() if k != "tokens"}, "decode_tps": r.decode_tps} for r in runs],
        "all_identical": all_identical,
        "plots": files,
        "load_avg": load.stop(),
    }
    out.write(payload, table)
    print(json.dumps(payload, indent=2) if args.json else table)
    print(f"(d) == (a) on every row: {all_identical}", file=sys.stderr)
    print(f"wrote {out} in {wall:.0f} s", file=sys.stderr)
    return 0 if all_identical else 1


if __name__ == "__main__":
    sys.exit(main())

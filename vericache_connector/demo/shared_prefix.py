"""The main job: a prefix stored by one node, reused by another over a slow link, four ways side by side.

Node A serves a long prompt (a miss: it prefills, answers, and stores the prefix twice, the full copy and a
small compressed copy). Node B, another process far from the store, then serves the same prompt four ways,
interleaved round by round:
  (1) recompute          prefill the whole prompt here, plain full-KV greedy decoding (no store)
  (2) full copy          fetch the full copy over the slow link, then plain full-KV greedy decoding
  (3) compressed first   fetch the compressed copy and draft on it at once while the full copy streams in;
                         the first verify pass waits for it (RemotePrefixCache without a verifier)
  (4) verified           fetch only the compressed copy and draft on it; a verifier beside the store checks
                         the drafts on the full KV it reads there (the full copy never crosses the slow link)
Then node A, beside the store, serves (2) and (4) without the slow link: where the gain vanishes. Every
output is compared token for token with full-KV greedy decoding, (1)'s first output.

All on 127.0.0.1 with the embedded store (local:// on disk, a temporary folder). The slow link is EMULATED
(a token bucket on node B's store reads); with 2+ cores the verifier runs on a core of its own and the nodes
on the others (separate machines' compute, emulated). The compute is real. Every process serves only after
its warm-up, and each way is run once on a short prompt before anything is timed.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass

from tqdm.auto import tqdm

from ..store.config import STORE_DEFAULT
from . import procs
from .shared_prefix_report import LABELS, SharedPrefixReport, WayRow

WAYS = tuple(LABELS)  # node B's ways, in the order of the table
FAST_WAYS = ("full-kv", "verified")  # node A's, beside the store
# node B's link: ~2.5x the CPU decode time of 32 tokens for graphlib_py's full copy (82.6 MB) on this project's
# 2-core CI machine; the printed fetch / decode is measured
DEFAULT_LINK_MB_S = 11.0
WARM_UP_TOKENS = 300  # the short prompt every way runs once before the timing (one stored chunk)


@dataclass
class SharedPrefixConfig:
    prompt: str = "graphlib_py"  # a bundled prompt
    prompt_tokens: int | None = None  # cut the prompt to this many tokens (default: all of it)
    new_tokens: int = 32
    rounds: int = 2
    link_mb_s: float = DEFAULT_LINK_MB_S  # node B <-> store, emulated
    compressor: str = STORE_DEFAULT
    draft_k: int = 16
    pin: bool | None = None  # None: pin when this process may use 2+ cores
    model: str | None = None  # checkpoint dir (default: the bundled SmolLM2-135M)
    chunk_size: int = 256

    def check(self) -> None:
        for name in ("new_tokens", "rounds", "draft_k", "chunk_size"):
            v = getattr(self, name)
            if type(v) is not int or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if self.prompt_tokens is not None and (type(self.prompt_tokens) is not int or self.prompt_tokens < 2):
            raise ValueError(f"prompt_tokens must be an integer >= 2, got {self.prompt_tokens!r}")
        if not (isinstance(self.link_mb_s, (int, float)) and 0 < self.link_mb_s < float("inf")):
            raise ValueError(f"link_mb_s must be a finite number > 0, got {self.link_mb_s!r}")


class Cluster:
    """The verifier, node A (beside the store) and node B (the emulated slow link) as processes."""

    def __init__(self, cfg: SharedPrefixConfig, folder: str):
        self.cfg, self.folder, self.procs = cfg, folder, []
        self.store = f"local://{os.path.join(folder, 'store')}"
        self.env = procs.node_env(self.store, procs.write_verifier_secret(os.path.join(folder, "secret")))
        pin = cfg.pin if cfg.pin is not None else len(procs.usable_cores()) >= 2
        self.cores = {r: procs.pinned_cores(r) for r in ("verifier", "node")} if pin else None

    def start(self, bar) -> None:
        """The verifier first (both nodes need its address), then both nodes at once; each warms up first."""
        cfg = self.cfg
        model = ["--model", cfg.model] if cfg.model else []
        bar.set_description("starting the verifier")
        self.verifier = self._start("verifier", ["verifier", "--port", "0", *model])
        self.verifier.wait_ready()
        bar.update()
        bar.set_description("starting node A and node B")
        node = ["drafter", "--port", "0", "--verifier", self.verifier.url, "--compressor", cfg.compressor, *model]
        self.node_a = self._start("node A", node)
        rate = str(cfg.link_mb_s * 1e6)
        self.node_b = self._start("node B", [*node, "--bandwidth-bytes-per-s", rate, "--store-timeout-s", "300"])
        self.node_a.wait_ready()
        self.node_b.wait_ready()
        bar.update()

    def _start(self, name: str, argv: list[str]) -> procs.Proc:
        cores = self.cores and self.cores["verifier" if name == "verifier" else "node"]
        log = os.path.join(self.folder, name.replace(" ", "_") + ".log")
        p = procs.Proc(name, argv, log, self.env, cores)
        self.procs.append(p)
        return p

    def describe_cores(self) -> str:
        if not self.cores:
            return f"every process shares this machine's {len(procs.usable_cores())} cores"
        nodes = ",".join(map(str, self.cores["node"]))
        return (
            f"node A and node B on core {nodes}, the verifier on core {self.cores['verifier'][0]} "
            "(separate machines' compute, emulated)"
        )

    def close(self) -> None:
        for p in reversed(self.procs):
            p.stop()


@contextmanager
def _exit_on_sigterm():
    """`timeout` / kill send SIGTERM: leave through the finally blocks, so every process is stopped."""
    try:
        old = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    except ValueError:  # not the main thread: nothing to install
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def load_prompt_ids(cfg: SharedPrefixConfig):
    """(tokenizer, the prompt's ids, the warm-up prompt's ids); checked before any process starts."""
    import json

    from ..data import load_prompt, prompt_names

    text = load_prompt(cfg.prompt)  # an unknown name fails before the slow imports

    from transformers import AutoTokenizer

    from storage_backends import stored_prefix_len

    from ..model import resolve_model_dir
    from ..model.causal_lm import ModelConfig

    path = resolve_model_dir(cfg.model)
    mcfg = ModelConfig.from_dict(json.loads((path / "config.json").read_text()))
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(text, add_special_tokens=False).input_ids[: cfg.prompt_tokens]
    if stored_prefix_len(len(ids), cfg.chunk_size) == 0:
        raise ValueError(f"a prompt of {len(ids)} tokens stores nothing: it needs more than {cfg.chunk_size} tokens")
    if len(ids) + cfg.new_tokens > mcfg.max_position:
        raise ValueError(
            f"prompt of {len(ids)} tokens + {cfg.new_tokens} new tokens exceeds the model's context of "
            f"{mcfg.max_position} tokens"
        )
    other = next(n for n in prompt_names() if n != cfg.prompt)
    warm = tok(load_prompt(other), add_special_tokens=False).input_ids[:WARM_UP_TOKENS]
    return tok, ids, warm


def run_shared_prefix(cfg: SharedPrefixConfig, progress: bool = True) -> SharedPrefixReport:
    from storage_backends import stored_prefix_len

    cfg.check()
    t_start = time.perf_counter()
    tok, ids, warm = load_prompt_ids(cfg)
    folder = tempfile.mkdtemp(prefix="vericache-demo-")
    steps = 2 + 1 + len(WAYS) + len(FAST_WAYS) + 1 + cfg.rounds * (len(WAYS) + len(FAST_WAYS))
    with _exit_on_sigterm(), tqdm(total=steps, unit="step", leave=False, disable=not progress) as bar:
        cluster = None
        try:
            cluster = Cluster(cfg, folder)
            cluster.start(bar)
            a, b = cluster.node_a.url, cluster.node_b.url

            def ask(url: str, way: str, prompt: list[int], new: int, what: str) -> dict:
                bar.set_description(what)
                out = procs.request(url, prompt, way, new, cfg.draft_k)
                bar.update()
                return out

            # warm-up: node A stores a short prompt; then every way runs once on it (nothing timed)
            _stored(ask(a, "verified", warm, 4, "warm-up: node A stores a short prompt"), "the warm-up prompt")
            for way in WAYS:
                ask(b, way, warm, 4, f"warm-up: node B {LABELS[way][:3]}")
            for way in FAST_WAYS:
                ask(a, way, warm, 4, f"warm-up: node A {LABELS[way][:3]}")
            served = ask(a, "verified", ids, cfg.new_tokens, "node A serves the prompt (a miss: stores both copies)")
            _stored(served, "the prompt")
            rows = {w: WayRow(w, "B") for w in WAYS}
            fast = {w: WayRow(w, "A") for w in FAST_WAYS}
            outputs: list[tuple[WayRow, list[int]]] = []  # compared with the reference at the end
            for r in range(cfg.rounds):  # ways interleaved, each round starting one way later
                for way in WAYS[r % len(WAYS) :] + WAYS[: r % len(WAYS)]:
                    out = ask(b, way, ids, cfg.new_tokens, f"round {r + 1}/{cfg.rounds}: node B {LABELS[way][:3]}")
                    outputs.append((_add(rows[way], out), out["tokens"]))
                for way in fast:
                    out = ask(a, way, ids, cfg.new_tokens, f"round {r + 1}/{cfg.rounds}: node A, fast link")
                    outputs.append((_add(fast[way], out), out["tokens"]))
            cores = cluster.describe_cores()
        finally:
            if cluster is not None:
                bar.set_description("stopping the processes")
                cluster.close()
            shutil.rmtree(folder, ignore_errors=True)
    ref = next(tokens for row, tokens in outputs if row.way == "recompute")  # full-KV greedy: (1)'s first output
    for row, tokens in outputs:
        row.identical.append(tokens == ref)
    full_bytes = max(a.get("bytes_full") or 0 for a in rows["full-kv"].answers)
    compressed_bytes = max(a.get("bytes_compressed") or 0 for a in rows["verified"].answers + rows["local"].answers)
    if not (full_bytes and compressed_bytes):  # the store was not read: no row below means what it says
        raise RuntimeError(f"node B never fetched both copies: {rows['full-kv'].answers + rows['verified'].answers}")
    stored = stored_prefix_len(len(ids), cfg.chunk_size)
    kv_bytes, ref_bytes = full_bytes / stored, procs.REF_KV_BYTES_PER_TOKEN["llama3-8b"]
    gbit = cfg.link_mb_s * 1e6 * 8 / 1e9 * ref_bytes / kv_bytes
    return SharedPrefixReport(
        model=str(cfg.model or "SmolLM2-135M-Instruct, float32"),
        prompt=cfg.prompt,
        prompt_tokens=len(ids),
        stored_tokens=stored,
        chunk_size=cfg.chunk_size,
        new_tokens=cfg.new_tokens,
        compressor=cfg.compressor,
        draft_k=cfg.draft_k,
        rounds=cfg.rounds,
        link_mb_s=cfg.link_mb_s,
        link_ref=f"the transfer time of Llama-3-8B's KV, {ref_bytes // 1024} KiB/token vs this model's "
        f"{kv_bytes / 1024:.0f} KiB, over {gbit:.2g} Gbit/s",
        cores=cores,
        full_bytes=full_bytes,
        compressed_bytes=compressed_bytes,
        node_a_s=served["wall_s"],
        node_a_identical=served["tokens"] == ref,
        continuation=tok.decode(ref),
        ways=list(rows.values()),
        fast=list(fast.values()),
        wall_s=time.perf_counter() - t_start,
    )


def _stored(answer: dict, what: str) -> None:
    """Node A's first request for a prompt must be a miss that stored both copies: else nothing below means
    what it says."""
    if answer.get("path") != "miss" or answer.get("error"):
        raise RuntimeError(f"node A did not store {what}: path {answer.get('path')!r}, {answer.get('error')}")


def _add(row: WayRow, out: dict) -> WayRow:
    row.wall_s.append(out["wall_s"])
    row.paths.append(out["path"])
    row.answers.append({k: v for k, v in out.items() if k != "tokens"})
    return row

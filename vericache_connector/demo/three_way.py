"""The main job: one long real prompt decoded three ways side by side.

full KV (the reference) | lossy compressed KV only | VeriCache (draft on compressed, verify on full).
Reports whether VeriCache's output is identical to the full-KV output, where the lossy output drifted,
accepted drafts per verification, compressed/full bytes and wall times.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

from tqdm.auto import tqdm

from ..compressors import get_compressor
from ..data import load_prompt
from ..draft import DraftConfig
from ..engine.llm_engine import VeriCacheEngine
from ..engine.speculative import DecodeConfig


@dataclass
class DemoReport:
    model: str
    prompt: str
    prompt_tokens: int
    new_tokens: int
    compressor: str
    draft_k: int | str
    draft: str  # draft cache layout / draft weights (DraftConfig)
    temperature: float
    identical: bool
    lossy_identical: bool
    lossy_first_divergence: int | None  # index of the first generated token where lossy != full
    lossy_token_agreement: float  # fraction of positions where lossy == full
    mean_accepted_per_verification: float
    verifications: int
    compressed_bytes: int
    full_bytes: int
    prefill_s: float
    compress_s: float
    full_decode_s: float
    lossy_decode_s: float
    vericache_decode_s: float
    full_text: str
    lossy_text: str

    def text(self) -> str:
        ratio = self.compressed_bytes / self.full_bytes
        div = "never" if self.lossy_first_divergence is None else f"at token {self.lossy_first_divergence}"
        return "\n".join(
            [
                f"model {self.model}; prompt {self.prompt!r} ({self.prompt_tokens} tokens); "
                f"{self.new_tokens} new tokens; compressor {self.compressor}; draft k {self.draft_k}; "
                f"draft {self.draft}; temperature {self.temperature}",
                f"VeriCache output identical to full-KV output: {'yes' if self.identical else 'NO'}",
                f"lossy compressed-only output identical: {'yes' if self.lossy_identical else 'no'} "
                f"(diverged {div}; token agreement {self.lossy_token_agreement:.0%})",
                f"accepted drafts per verification: {self.mean_accepted_per_verification:.2f} "
                f"over {self.verifications} verifications",
                f"KV bytes: compressed {self.compressed_bytes / 2**20:.1f} MiB / full {self.full_bytes / 2**20:.1f} "
                f"MiB = {ratio:.3f} ({1 / ratio:.1f}x smaller)",
                f"wall time: prefill {self.prefill_s:.2f}s, compress {self.compress_s:.2f}s | decode: full KV "
                f"{self.full_decode_s:.2f}s, lossy {self.lossy_decode_s:.2f}s, VeriCache {self.vericache_decode_s:.2f}s",
                "--- full-KV / VeriCache continuation ---",
                self.full_text,
                "--- lossy continuation ---",
                self.lossy_text,
            ]
        )

    def as_dict(self) -> dict:
        return asdict(self)


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _timed_decode(label: str, total: int, fn):
    with tqdm(total=total, desc=label, unit="tok", leave=False) as bar:
        t = time.perf_counter()
        out = fn(bar.update)
        return out, time.perf_counter() - t


def run_demo(
    engine: VeriCacheEngine,
    prompt_text: str,
    prompt_name: str,
    compressor: str,
    cfg: DecodeConfig,
    model_name: str = "smollm2-135m-instruct",
    draft: DraftConfig | None = None,
) -> DemoReport:
    comp = get_compressor(compressor)
    draft = draft or engine.draft
    ids = engine.encode(prompt_text)
    engine.check_length(len(ids), cfg.max_new_tokens)
    t = time.perf_counter()
    pre = engine.prefill(ids)
    prefill_s = time.perf_counter() - t
    t = time.perf_counter()
    compressed = comp.compress(pre.prefix)
    compress_s = time.perf_counter() - t
    n = cfg.max_new_tokens
    full, full_s = _timed_decode("full KV", n, lambda cb: engine.generate_full([pre], cfg, cb)[0])
    lossy, lossy_s = _timed_decode("lossy", n, lambda cb: engine.generate_lossy([pre], [compressed], cfg, cb, draft)[0])
    (vc, stats), vc_s = _timed_decode("VeriCache", n, lambda cb: engine.generate([pre], [compressed], cfg, cb, draft))
    vc = vc[0]
    agree = sum(x == y for x, y in zip(lossy, full)) / max(1, len(full))
    return DemoReport(
        model=model_name,
        prompt=prompt_name,
        prompt_tokens=len(ids),
        new_tokens=len(vc),
        compressor=comp.spec,
        draft_k="adaptive" if cfg.adaptive else cfg.draft_k,
        draft=draft.describe(engine.model.device),
        temperature=cfg.temperature,
        identical=vc == full,
        lossy_identical=lossy == full,
        lossy_first_divergence=first_divergence(lossy, full),
        lossy_token_agreement=agree,
        mean_accepted_per_verification=stats.mean_accepted(),
        verifications=len(stats.accepted[0]),
        compressed_bytes=compressed.nbytes,
        full_bytes=pre.prefix.nbytes,
        prefill_s=prefill_s,
        compress_s=compress_s,
        full_decode_s=full_s,
        lossy_decode_s=lossy_s,
        vericache_decode_s=vc_s,
        full_text=engine.tokenizer.decode(full),
        lossy_text=engine.tokenizer.decode(lossy),
    )


def resolve_prompt(prompt: str | None, prompt_file: str | None) -> tuple[str, str]:
    if prompt_file:
        try:
            text = open(prompt_file, encoding="utf-8").read()
        except OSError as e:
            raise ValueError(f"cannot read prompt file {prompt_file!r}: {e.strerror}") from None
        return prompt_file, text
    name = prompt or "contextlib_py"
    return name, load_prompt(name)

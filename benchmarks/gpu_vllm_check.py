"""The vLLM connector's check on a GPU, in one call: a larger (random-weight, seeded) Llama served by vLLM
with and without VeriCacheConnector + CompressedKVProposer; greedy outputs must be identical, cold and
warm; time to first token and end-to-end latency side by side, as ratios.

    python benchmarks/gpu_vllm_check.py --json          # on the device (part of benchmarks/gpu_check.sh)
    python benchmarks/gpu_vllm_check.py --tiny --json   # the same flow on the CPU, a tiny model (dry run)

Random weights: acceptance says little here (the drafts come from the same random model, so they are
accepted about as often as the compressor preserves its argmax); identity and latency are the point.
Prompts are token ids, so the server runs with --skip-tokenizer-init and needs no tokenizer files.
"""

from __future__ import annotations

import sys
from pathlib import Path

if not __package__:  # run as a file (python benchmarks/<script>.py): import from the repository root, as -m does
    sys.path[0] = str(Path(__file__).resolve().parents[1])

import argparse
import json
import tempfile
import time

from benchmarks.kit import paths

SIZES = {  # hidden, intermediate, layers, heads, kv heads (head_dim 64)
    "tiny": (256, 512, 4, 4, 2),
    "1b": (2048, 5632, 16, 32, 8),
}


def build_model(size: str, dest: Path, seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv = SIZES[size]
    cfg = LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():  # larger than the init default, so that the argmax is not a coin toss
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 2.0 / p.shape[1] ** 0.5)
    model.to(torch.bfloat16 if size != "tiny" else torch.float32).save_pretrained(dest)


def main(argv=None) -> int:
    paths.setup()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model on the CPU (a dry run of this script)")
    p.add_argument("--tokens", type=int, nargs="+", default=[1100, 2000])
    p.add_argument("--new", type=int, default=32)
    p.add_argument("--spec-k", type=int, default=8)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        print(json.dumps({"skipped": f"vllm is not installed here: {e}"}))
        return 0
    import torch

    from benchmarks.kit.vllm_server import ServerConfig, VLLMServer

    size = "tiny" if args.tiny else "1b"
    work = Path(tempfile.mkdtemp(prefix="vericache-gpu-vllm-"))
    t0 = time.perf_counter()
    build_model(size, work / "model")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(100, 49000, (n,), generator=g).tolist() for n in args.tokens]
    common = dict(
        model=str(work / "model"),
        dtype="float32" if args.tiny else "bfloat16",
        max_model_len=max(args.tokens) + args.new + 64,
        extra_args=["--skip-tokenizer-init"],
    )
    if not torch.cuda.is_available():
        common["kv_space_gib"] = 2
    report = {
        "model": size,
        "build_s": time.perf_counter() - t0,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "requests": [],
    }
    with VLLMServer(ServerConfig(**common), log_path=str(work / "base.log")) as srv:
        srv.complete(prompts[0][:64], 4)
        base = [srv.complete(q, args.new) for q in prompts]
    cfg = ServerConfig(**common, store=f"local://{work}/kv", spec_k=args.spec_k)
    with VLLMServer(cfg, log_path=str(work / "vericache.log")) as srv:
        srv.complete(prompts[0][:64], 4)
        runs = {phase: [srv.complete(q, args.new) for q in prompts] for phase in ("cold", "warm")}
        report["spec_decoding_log"] = [
            ln.split("SpecDecoding metrics: ")[1] for ln in srv.log().splitlines() if "SpecDecoding metrics" in ln
        ]
        report["hits"] = sum("tokens loaded" in ln for ln in srv.log().splitlines())
    for i, q in enumerate(prompts):
        b = base[i]
        row = {"tokens": len(q), "base_ttft_s": b.ttft_s, "base_total_s": b.total_s}
        for phase, r in runs.items():
            row[f"{phase}_identical"] = r[i].token_ids == b.token_ids
            row[f"{phase}_ttft_s"], row[f"{phase}_total_s"] = r[i].ttft_s, r[i].total_s
        row["warm_ttft_ratio"] = row["warm_ttft_s"] / b.ttft_s
        row["warm_total_ratio"] = row["warm_total_s"] / b.total_s
        report["requests"].append(row)
    ok = all(r["cold_identical"] and r["warm_identical"] for r in report["requests"])
    report["identical"] = ok
    print(json.dumps(report, indent=None if args.json else 1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

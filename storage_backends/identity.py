"""Which model made a KV cache entry: a fingerprint of everything that determines the KV.

Two checkpoints whose folders share a name (runA/checkpoint, runB/checkpoint), or one hub name under two
organisations or revisions, must never share cache entries: their KV differs, and a hit of the other's
entry would silently change the output. So keys and manifests name the model by
``model_id(name, fingerprint)``: a readable name plus a digest over

  - the architecture config (config.json, canonical JSON): read and hashed on every call, never cached
    (it is small, and editing it, say ``rope_theta``, changes the KV without touching a weight),
  - every weights file (*.safetensors: name, size and a BLAKE2b of the bytes),
  - the tokenizer files (tokenizer.json, tokenizer_config.json, special_tokens_map.json, vocab files),
  - the KV dtype.

Hashing the weights reads them once; each file's digest is cached (``.vericache-fingerprint.json`` beside
the model, or under $VERICACHE_CACHE_DIR when the folder is read-only) under the file's identity: device,
inode, size, mtime and ctime. A copy (``cp -a`` keeps mtimes, and copies the cache file too) has new
inodes, and an edit in place changes the ctime even when the mtime is set back, so either is re-hashed;
the kernel sets the ctime, a user cannot restore it.

The KV dtype's spelling (dtype_str, torch_dtype: LMCache's names) lives here too, the one place both the
fingerprint and the keys (keys.py, lmcache_keys.py) take it from: this module imports neither of them.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import torch

SIDECAR = ".vericache-fingerprint.json"
CACHE_VERSION = 2  # v1 keyed the cache by (name, size, mtime) only: its entries are not trusted
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

# LMCache's dtype spelling (lmcache.utils.TORCH_DTYPE_TO_STR_DTYPE).
_DTYPE_STR = {
    torch.float16: "half",
    torch.bfloat16: "bfloat16",
    torch.float32: "float",
    torch.float64: "double",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.int16: "int16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.bool: "bool",
}
for _name, _s in (
    ("float8_e4m3fn", "fp8_e4m3fn"),
    ("float8_e5m2", "fp8_e5m2"),
    ("float8_e4m3fnuz", "fp8_e4m3fnuz"),
    ("float8_e5m2fnuz", "fp8_e5m2fnuz"),
):
    if hasattr(torch, _name):
        _DTYPE_STR[getattr(torch, _name)] = _s
_STR_DTYPE = {v: k for k, v in _DTYPE_STR.items()}


def dtype_str(dtype: torch.dtype | str) -> str:
    """LMCache's name of a dtype; accepts a torch.dtype, an LMCache name or 'float16'."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_STR:
            raise ValueError(f"unsupported dtype {dtype}")
        return _DTYPE_STR[dtype]
    if isinstance(dtype, str):
        if dtype in _STR_DTYPE:
            return dtype
        t = getattr(torch, dtype.removeprefix("torch."), None)
        if isinstance(t, torch.dtype) and t in _DTYPE_STR:
            return _DTYPE_STR[t]
    raise ValueError(f"unsupported dtype {dtype!r}")


def torch_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The torch.dtype of an LMCache dtype name (or of anything dtype_str accepts)."""
    return _STR_DTYPE[dtype_str(dtype)]


def _file_digest(path: Path) -> str:
    h = hashlib.blake2b(digest_size=16)
    with open(path, "rb") as f:
        while chunk := f.read(_READ):
            h.update(chunk)
    return h.hexdigest()


def _file_identity(st: os.stat_result) -> list[int]:
    """What must all stay the same for a cached digest to be trusted (nanosecond times)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _cache_file(model_dir: Path) -> Path:
    if os.access(model_dir, os.W_OK):
        return model_dir / SIDECAR
    root = Path(os.environ.get("VERICACHE_CACHE_DIR", Path.home() / ".cache" / "vericache")) / "fingerprints"
    return root / (hashlib.blake2b(str(model_dir.resolve()).encode(), digest_size=8).hexdigest() + ".json")


def _read_cache(cache: Path) -> dict:
    try:
        data = json.loads(cache.read_text())
        files = data["files"] if data.get("version") == CACHE_VERSION else {}
        return files if isinstance(files, dict) else {}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return {}


def _digest_of(path: Path, cached: dict, fresh: dict) -> tuple[int, str]:
    """(size, digest) of one file: from the cache if its identity is unchanged, else hashed now. The
    identity is taken before and after hashing: a file written meanwhile is not cached."""
    before = _file_identity(path.stat())
    hit = cached.get(path.name)
    if isinstance(hit, list) and len(hit) == 2 and hit[0] == before and isinstance(hit[1], str):
        fresh[path.name] = hit
        return before[2], hit[1]
    digest = _file_digest(path)
    if _file_identity(path.stat()) == before:
        fresh[path.name] = [before, digest]
    return before[2], digest


def weights_digest(model_dir: str | os.PathLike) -> str:
    """Digest of the checkpoint's files (config, weights, tokenizer): config.json read now, the other
    files' digests cached beside the checkpoint under each file's identity (module docstring)."""
    d = Path(model_dir)
    if not (d / "config.json").is_file():
        raise ValueError(f"{str(d)!r} is not a model directory: no config.json")
    try:
        config = json.loads((d / "config.json").read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ValueError(f"{str(d / 'config.json')!r} does not parse as JSON: {type(e).__name__}") from None
    files = sorted(d.glob("*.safetensors")) + [d / n for n in TOKENIZER_FILES if (d / n).is_file()]
    cache = _cache_file(d)
    cached, fresh = _read_cache(cache), {}
    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps(config, sort_keys=True, separators=(",", ":")).encode())
    for p in files:
        size, digest = _digest_of(p, cached, fresh)
        h.update(f"\0{p.name}\0{size}\0{digest}".encode())
    if fresh != cached:
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            tmp = cache.with_suffix(f".{os.getpid()}.tmp")  # several processes may hash at once
            tmp.write_text(json.dumps({"version": CACHE_VERSION, "files": fresh}))
            tmp.replace(cache)
        except OSError:
            pass  # a read-only place: hashed again next time
    return h.hexdigest()


def model_fingerprint(model_dir: str | os.PathLike, dtype) -> str:
    """DIGEST_CHARS hex characters naming (checkpoint files, KV dtype). dtype: a torch.dtype or any
    spelling dtype_str accepts ('float32', 'float', torch.float32 give one fingerprint)."""
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

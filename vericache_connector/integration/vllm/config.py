"""The connector's settings, as vLLM hands them over in ``kv_connector_extra_config``.

    --kv-transfer-config '{"kv_connector": "VeriCacheConnector",
                           "kv_connector_module_path": "vericache_connector.vllm_connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store": "redis://redis:6379/0", "compressor": "kivi4"}}'

"role" picks what the server is: "serve" (the default: loads the full copy, saves both copies; also the
verifier beside the store) or "drafter" (draft_role.py: loads ONLY compressed copies, decoded into its
own blocks, never the full copy, and saves nothing: what it generates are drafts, never answers, and it
answers only `vericache router`). Every key may be left out; the store URL and the compressor then come from the environment
(VERICACHE_STORE_URL, VERICACHE_COMPRESSOR: a Kubernetes Secret keeps credentials out of the pod's
arguments), else the defaults below. The result is a RemoteCacheConfig, validated the same way as for
the engine's own remote prefix cache. Errors never show a store password: URLs are shown redacted,
and JSON text that does not parse is not echoed (the error gives the position).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping

from ...store.config import RemoteCacheConfig

CONNECTOR_MODULE = "vericache_connector.vllm_connector"  # kv_connector_module_path (a stable re-export)
PROPOSER_CLASS = "vericache_connector.vllm_proposer.CompressedKVProposer"  # speculative "model" (re-export)
DEFAULT_STORE = "local:///tmp/vericache-kv"  # on-disk, so every vLLM process on the node shares it
ENV = {"store": "VERICACHE_STORE_URL", "compressor": "VERICACHE_COMPRESSOR"}
KEYS = {  # extra-config key -> (RemoteCacheConfig field, type)
    "store": ("url", str),
    "compressor": ("compressor", str),
    "chunk_size": ("chunk_size", int),
    "timeout_s": ("timeout_s", float),
    "bandwidth_bytes_per_s": ("bandwidth_bytes_per_s", float),
    "model_name": ("model_name", str),
    "mac_key_file": ("mac_key_file", str),
    "key_hashing": ("key_hashing", str),
    "cache_salt": ("cache_salt", str),
    "role": (None, str),  # not a store setting: connector_role() reads it
}
ROLES = ("serve", "drafter")


def load_connector_config(
    extra: Mapping[str, Any] | str | None, env: Mapping[str, str] | None = None
) -> RemoteCacheConfig:
    """``kv_connector_extra_config`` (a dict, or its JSON text) -> RemoteCacheConfig.

    Raises ValueError naming the bad key or value.
    """
    env = os.environ if env is None else env
    extra = _extra_dict(extra)
    connector_role(extra)
    fields: dict[str, Any] = {"url": DEFAULT_STORE}
    for key, var in ENV.items():
        if env.get(var):
            fields[KEYS[key][0]] = env[var]
    for key, value in extra.items():
        name, kind = KEYS[key]
        if value is None or name is None:
            continue
        if kind is int and not (isinstance(value, int) and not isinstance(value, bool)):
            raise ValueError(f"kv_connector_extra_config[{key!r}] must be an integer, got {value!r}")
        if kind is float and not (isinstance(value, (int, float)) and not isinstance(value, bool)):
            raise ValueError(f"kv_connector_extra_config[{key!r}] must be a number, got {value!r}")
        if kind is str and not isinstance(value, str):
            raise ValueError(f"kv_connector_extra_config[{key!r}] must be a string, got a {type(value).__name__}")
        fields[name] = kind(value)
    cfg = RemoteCacheConfig(**fields)
    from ...compressors import get_compressor

    get_compressor(cfg.compressor)  # ValueError naming an unknown compressor
    return cfg


def connector_role(extra: Mapping[str, Any] | str | None) -> str:
    """kv_connector_extra_config's "role": "serve" (default) or "drafter"; ValueError naming anything else."""
    role = _extra_dict(extra).get("role")
    if role is None:
        return "serve"
    if role not in ROLES:
        raise ValueError(f"kv_connector_extra_config['role'] must be one of {list(ROLES)}, got {role!r}")
    return role


def _extra_dict(extra: Mapping[str, Any] | str | None) -> dict[str, Any]:
    if isinstance(extra, str):
        try:
            extra = json.loads(extra) if extra.strip() else {}
        except json.JSONDecodeError as e:
            raise ValueError(f"kv_connector_extra_config is not JSON ({e})") from None
    if extra is not None and not isinstance(extra, Mapping):
        raise ValueError(f"kv_connector_extra_config must be a JSON object, got a {type(extra).__name__}")
    extra = dict(extra or {})
    if not all(isinstance(k, str) for k in extra):
        raise ValueError(f"kv_connector_extra_config keys must be strings, got {list(extra)!r}")
    unknown = sorted(set(extra) - set(KEYS))
    if unknown:
        raise ValueError(f"unknown kv_connector_extra_config key(s) {unknown}; known: {sorted(KEYS)}")
    return extra


def load_kv_transfer_config(text: str, env: Mapping[str, str] | None = None) -> RemoteCacheConfig:
    """The whole ``--kv-transfer-config`` JSON (as a pod's arguments carry it) -> RemoteCacheConfig,
    checking that it names this connector."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-transfer-config is not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--kv-transfer-config must be a JSON object, got a JSON {type(cfg).__name__}")
    connectors = (
        [cfg] + [c for c in cfg.get("kv_connector_extra_config", {}).get("connectors", []) if isinstance(c, dict)]
        if cfg.get("kv_connector") == "MultiConnector"
        else [cfg]
    )
    ours = [c for c in connectors if c.get("kv_connector") == "VeriCacheConnector"]
    if not ours:
        raise ValueError(
            f"--kv-transfer-config does not use VeriCacheConnector (kv_connector is {cfg.get('kv_connector')!r})"
        )
    mine = ours[0]
    if mine.get("kv_connector_module_path") != CONNECTOR_MODULE:
        raise ValueError(
            f"kv_connector_module_path must be {CONNECTOR_MODULE!r}, got {mine.get('kv_connector_module_path')!r}"
        )
    return load_connector_config(mine.get("kv_connector_extra_config"), env)

"""The connector's settings, as vLLM hands them over in ``kv_connector_extra_config``.

    --kv-transfer-config '{"kv_connector": "VeriCacheConnector",
                           "kv_connector_module_path": "vericache_connector.vllm_connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"store": "redis://redis:6379/0", "compressor": "kivi4"}}'

"role" picks what the server is: "serve" (the default: loads the full copy, saves both copies; also the
verifier beside the store) or "drafter" (drafter.py: loads ONLY compressed copies, decoded into its
own blocks, never the full copy, and saves nothing: what it generates are drafts, never answers, and it
answers only `vericache router`). Every key may be left out; the store URL and the compressor then come from the environment
(VERICACHE_STORE_URL, VERICACHE_COMPRESSOR: a Kubernetes Secret keeps credentials out of the pod's
arguments), else the defaults below. The result is a RemoteCacheConfig, validated the same way as for
the engine's own remote prefix cache. Errors never show a store password: URLs are shown redacted,
and JSON text that does not parse is not echoed (the error gives the position).

connector_spec() resolves all of it once, from vLLM's config, into the ConnectorSpec that both halves of
the connector are built from (as vLLM's OffloadingConnector builds one spec for its scheduler and worker):
the settings, the compressor they name (parsed here only), the served model's store name and the role,
checked against what vLLM's config asks of the connector.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from ....store.config import RemoteCacheConfig

if TYPE_CHECKING:
    from ....compressors import Compressor

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
    "load_policy": (None, str),  # not a store setting: load_policy() reads it
}
ROLES = ("serve", "drafter")
LOAD_POLICIES = ("auto", "always")  # auto: load or recompute per request (load_plan.py); always: every hit loads


@dataclass(frozen=True)
class ConnectorSpec:
    """What both halves of the connector are built from, resolved once from vLLM's config (connector_spec)."""

    cfg: RemoteCacheConfig
    compressor: Compressor  # cfg.compressor, resolved
    model_name: str  # how store keys and manifests name the served model (model_name_of)
    role: str  # one of ROLES
    block_size: int  # vLLM's; cfg.chunk_size is a multiple of it
    runs_proposer: bool  # the speculative config names our proposer: the worker hands it compressed copies
    prefix_caching: bool = False  # vLLM's prefix cache is on: a prefix brought in once serves its twins
    load_policy: str = "auto"  # one of LOAD_POLICIES

    @property
    def drafter(self) -> bool:
        return self.role == "drafter"


def connector_spec(vllm_config) -> ConnectorSpec:
    """vLLM's config -> the connector's spec; ValueError naming a bad setting, or what this server would
    need that vLLM's config does not give it."""
    cfg, compressor, role = _resolve(vllm_config.kv_transfer_config.kv_connector_extra_config)
    proposer = runs_our_proposer(vllm_config)
    if role == "drafter":
        check_drafter_server(compressor, proposer, cfg.compressor)
    block_size = vllm_config.cache_config.block_size
    if cfg.chunk_size % block_size:
        raise ValueError(f"chunk_size {cfg.chunk_size} must be a multiple of vLLM's block size {block_size}")
    if compressor.needs_queries:
        raise ValueError(
            f"compressor {cfg.compressor!r} needs the prompt's attention queries, which "
            f"vLLM does not hand to connectors; use a query-free one (kivi4, int8, fp8, "
            f"turboquant-k4v3, streamingllm-4x, knorm-4x)"
        )
    return ConnectorSpec(
        cfg,
        compressor,
        model_name_of(vllm_config, cfg.model_name),
        role,
        block_size,
        proposer,
        bool(getattr(vllm_config.cache_config, "enable_prefix_caching", False)),
        load_policy(vllm_config.kv_transfer_config.kv_connector_extra_config),
    )


def keeps_every_token(compressor: Compressor) -> bool:
    """A quantizer's copy (kivi, int8, fp8, turboquant, ...) holds every token; token dropping does not."""
    from ....compressors import GROUPS

    quantizers = next(names for names in GROUPS.values() if "kivi" in names)
    return compressor.name in quantizers


def check_drafter_server(compressor: Compressor | str, runs_proposer: bool, name: str | None = None) -> None:
    """What a drafter-role server must have before it serves: ValueError naming what is missing.
    `compressor`: the resolved compressor (`name`: its spec as configured, for the errors), or that spec."""
    from ....compressors import get_compressor
    from ....router.config import router_token
    from ..router_plugins import GUARD

    name = compressor if isinstance(compressor, str) else name or compressor.spec
    if not keeps_every_token(get_compressor(compressor)):  # a resolved compressor is used as it is
        raise ValueError(
            f"the drafter role needs a compressor that keeps every token (a quantizer: kivi4, int8, fp8, "
            f"turboquant-k4v3, ...): {name!r} drops tokens, whose K/V vLLM's blocks would then lack"
        )
    if runs_proposer:
        raise ValueError("the drafter role does not run the compressed-KV proposer: drop --speculative-config")
    router_token()  # ValueError when missing: the guard below would refuse every request
    if not any(GUARD in line for line in _command_lines()):
        raise ValueError(
            f"a drafter-role server answers only the router: start it with --middleware {GUARD} "
            f"(on the command line), so that requests without the router token are refused"
        )


def _command_lines(depth: int = 4) -> list[str]:
    """This process's command line and its parents' (vLLM's engine core runs in a child of the API server)."""
    lines, pid = [], os.getpid()
    for _ in range(depth):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                lines.append(f.read().replace(b"\0", b" ").decode("utf-8", "replace"))
            with open(f"/proc/{pid}/stat", "rb") as f:
                pid = int(f.read().rsplit(b")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
        if pid <= 1:
            break
    return lines


def runs_our_proposer(vllm_config) -> bool:
    spec = getattr(vllm_config, "speculative_config", None)
    return spec is not None and getattr(spec, "method", None) == "custom_class" and spec.model == PROPOSER_CLASS


def model_name_of(vllm_config, configured: str | None) -> str:
    """How store keys and manifests name the served model: `configured` (kv_connector_extra_config's
    model_name, which must then identify the weights), else the same identity the engine gives the
    checkpoint ('name.fingerprint' of config, weights, tokenizer and dtype) for the folder vLLM loads:
    the local directory, or the hub snapshot already on this machine. Failing both: the hub name with a
    fingerprint of vLLM's config dict, the revision and the dtype."""
    if configured:
        return configured
    from ....model.loader import config_identity, model_identity

    mc = vllm_config.model_config
    model, revision = str(mc.model), getattr(mc, "revision", None)
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return model_identity(path, mc.dtype)
    snapshot = _hub_snapshot(model, revision)
    if snapshot is not None:
        return model_identity(snapshot, mc.dtype, name=model)
    hf = getattr(mc, "hf_config", None)
    config = hf.to_dict() if hasattr(hf, "to_dict") else dict(hf or {})
    return config_identity(model, config, revision, mc.dtype)


def _hub_snapshot(repo_id: str, revision: str | None) -> Path | None:
    """The local snapshot folder of a hub model, if this machine has it (never downloads)."""
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(repo_id, revision=revision, local_files_only=True))
    except Exception:  # noqa: BLE001 - not a hub name, not cached, no huggingface_hub
        return None
    return path if (path / "config.json").is_file() else None


def load_connector_config(
    extra: Mapping[str, Any] | str | None, env: Mapping[str, str] | None = None
) -> RemoteCacheConfig:
    """``kv_connector_extra_config`` (a dict, or its JSON text) -> RemoteCacheConfig.

    Raises ValueError naming the bad key or value.
    """
    return _resolve(extra, env)[0]


def _resolve(
    extra: Mapping[str, Any] | str | None, env: Mapping[str, str] | None = None
) -> tuple[RemoteCacheConfig, Compressor, str]:
    """``kv_connector_extra_config`` -> (its RemoteCacheConfig, the compressor it names, its role)."""
    env = os.environ if env is None else env
    extra = _extra_dict(extra)
    role = connector_role(extra)
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
    fields["url"] = _store_url(fields["url"], extra.get("store"), env)
    cfg = RemoteCacheConfig(**fields)
    from ....compressors import get_compressor

    return cfg, get_compressor(cfg.compressor), role  # ValueError naming an unknown compressor


PASSWORD_ENV = "VERICACHE_STORE_PASSWORD"  # or ..._FILE: the store's password, kept out of vLLM's arguments
PASSWORD_SCHEMES = ("redis", "rediss", "redis+cluster", "redis+sentinel")


def _store_url(url: str, given: Any, env: Mapping[str, str]) -> str:
    """The store URL with $VERICACHE_STORE_PASSWORD(_FILE) as its password. A password inside
    kv_connector_extra_config is refused: vLLM prints its arguments at start-up ("non-default args")."""
    from storage_backends.credentials import has_password, secret_from_env, with_password

    if given is not None and has_password(given):
        raise ValueError(
            "kv_connector_extra_config['store'] holds a password, which vLLM prints in its start-up log "
            f"(non-default args): give the URL in ${ENV['store']} (a Kubernetes Secret), or the password in a "
            f"file named by ${PASSWORD_ENV}_FILE (or in ${PASSWORD_ENV}), and change the password"
        )
    password = secret_from_env(PASSWORD_ENV, env, what="store password")
    if password is None:
        return url
    scheme = url.split("://", 1)[0]
    if scheme not in PASSWORD_SCHEMES:
        raise ValueError(f"${PASSWORD_ENV} is set, but a {scheme}:// store takes no password (Redis does)")
    return with_password(url, password.decode())


def connector_role(extra: Mapping[str, Any] | str | None) -> str:
    """kv_connector_extra_config's "role": "serve" (default) or "drafter"; ValueError naming anything else."""
    role = _extra_dict(extra).get("role")
    if role is None:
        return "serve"
    if role not in ROLES:
        raise ValueError(f"kv_connector_extra_config['role'] must be one of {list(ROLES)}, got {role!r}")
    return role


def load_policy(extra: Mapping[str, Any] | str | None) -> str:
    """kv_connector_extra_config's "load_policy": "auto" (default) or "always"; ValueError naming anything else."""
    policy = _extra_dict(extra).get("load_policy")
    if policy is None:
        return "auto"
    if policy not in LOAD_POLICIES:
        raise ValueError(
            f"kv_connector_extra_config['load_policy'] must be one of {list(LOAD_POLICIES)}, got {policy!r}"
        )
    return policy


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


def our_connector(cfg: Mapping[str, Any]) -> dict | None:
    """The VeriCacheConnector entry of a --kv-transfer-config object: itself, or one of MultiConnector's
    connectors; None where it names none."""
    connectors = [cfg]
    if cfg.get("kv_connector") == "MultiConnector":
        extra = cfg.get("kv_connector_extra_config")
        connectors += [
            c for c in (extra.get("connectors", []) if isinstance(extra, dict) else []) if isinstance(c, dict)
        ]
    return next((c for c in connectors if c.get("kv_connector") == "VeriCacheConnector"), None)


def load_kv_transfer_config(text: str, env: Mapping[str, str] | None = None) -> RemoteCacheConfig:
    """The whole ``--kv-transfer-config`` JSON (as a pod's arguments carry it) -> RemoteCacheConfig,
    checking that it names this connector."""
    try:
        cfg = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-transfer-config is not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"--kv-transfer-config must be a JSON object, got a JSON {type(cfg).__name__}")
    mine = our_connector(cfg)
    if mine is None:
        raise ValueError(
            f"--kv-transfer-config does not use VeriCacheConnector (kv_connector is {cfg.get('kv_connector')!r})"
        )
    if mine.get("kv_connector_module_path") != CONNECTOR_MODULE:
        raise ValueError(
            f"kv_connector_module_path must be {CONNECTOR_MODULE!r}, got {mine.get('kv_connector_module_path')!r}"
        )
    return load_connector_config(mine.get("kv_connector_extra_config"), env)

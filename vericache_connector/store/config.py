"""Settings of a remote dual-copy prefix store, shared by the engine's RemotePrefixCache and the vLLM
connector. RemoteCacheConfig is the one owner of the store timeout: it is passed explicitly to the
store's backend, and a URL that carries its own ``timeout_s`` is refused (two owners would disagree).

The URL may carry a password (redis://:secret@host): errors and the repr show it redacted (shown_url).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from storage_backends import redact_url
from storage_backends.base import query_options

SCHEMES = ("local", "redis", "rediss", "redis+cluster", "redis+sentinel", "s3", "nixl")
DEFAULT_TIMEOUT_S = 5.0  # a lookup, a compressed fetch, one layer of the full stream (then: recompute)
# the verifier's opening call: its answer waits for the request's full-KV load, queued behind other loads
VERIFIER_LOAD_TIMEOUT_S = 30.0


def shown_url(url: object) -> str:
    """A store URL as errors and reprs show it: quoted, its password (and credential-like options)
    masked by storage_backends.redact_url, which does not trust the URL to be well formed."""
    return repr(redact_url(url)) if isinstance(url, str) else redact_url(url)


# The compressed copy of a stored prefix is written once for every later question, so the store path needs
# a query-agnostic compressor (SnapKV and TOVA score positions with the prompt's own last queries). The
# default is KIVI 4-bit: the paper's drafter for remote prefixes, it needs only the K/V (the vLLM worker and
# the LMCache adapter have nothing else), and it kept the longest accepted runs at x = 25-50 of everything we
# measured (README, "Acceptance vs draft horizon"). KVzip (kvzip-5x) is the query-agnostic token-dropping choice where the
# writer also has the model and the token ids (RemotePrefixCache, the verifier): it re-runs the model to
# reconstruct the context, minutes per long prompt on a CPU. Every store config defaults to STORE_DEFAULT
# (tests/unit/test_config_defaults.py).
STORE_DEFAULT = "kivi4"


@dataclass
class RemoteCacheConfig:
    url: str = "local://"
    compressor: str = STORE_DEFAULT
    chunk_size: int = 256
    bandwidth_bytes_per_s: float | None = None  # emulate a slow link (reads)
    timeout_s: float = DEFAULT_TIMEOUT_S  # every store operation, and a stalled full stream
    # Names the model in store keys. Default: the engine's / vLLM's model identity, 'folder.fingerprint'
    # (config, weights, tokenizer, dtype). An explicit name must identify the weights itself: every
    # model given the same name shares (and trusts) the same entries.
    model_name: str | None = None
    # "lmcache": key chunks by LMCache's multiprocess-server chunk hashes, to read and write the prefixes an
    # LMCache server stores through vericache_connector/integration/lmcache/l2_adapter.py (and its per-tenant cache_salt).
    key_hashing: str = "vericache"
    cache_salt: str = ""
    # Integrity for stores shared with others: a keyed MAC over every manifest and payload (DualCopyStore's
    # mac_key) read from this file (a mounted Secret), else from $VERICACHE_MAC_KEY_FILE / $VERICACHE_MAC_KEY;
    # none: off. With a key, an entry without a valid tag is a miss: a writer without the key cannot plant KV.
    mac_key_file: str | None = None
    # Disaggregated hits (remote/drafter.py): with a verifier, a hit fetches ONLY the compressed copy and
    # drafts on it; the verifier next to the store checks the drafts on the full KV it loads over its own
    # fast link, so the full copy never crosses this node's link. tcp://HOST:PORT: `vericache verifier`;
    # http://HOST:PORT: a vLLM server (greedy). Any verifier fault: the full copy is fetched here instead.
    verifier: str | None = None
    # The token shared with the verifier: this file (a mounted Secret), else $VERICACHE_VERIFIER_TOKEN_FILE /
    # $VERICACHE_VERIFIER_TOKEN (never a command-line value)
    verifier_token_file: str | None = None
    verifier_timeout_s: float = 5.0  # one verify call
    # the opening call: its answer waits for the verifier's full-KV load, queued behind other requests' loads
    # (the drafter drafts on meanwhile); a verifier silent this long is a fault like any other
    verifier_load_timeout_s: float = VERIFIER_LOAD_TIMEOUT_S

    def __post_init__(self):
        scheme = self.url.split("://", 1)[0].lower() if isinstance(self.url, str) and "://" in self.url else None
        if scheme not in SCHEMES:
            raise ValueError(
                f"bad store URL {shown_url(self.url)}: expected {', '.join(s + '://...' for s in SCHEMES)}"
            )
        try:
            options = query_options(self.url)
        except ValueError:
            raise ValueError(f"bad store URL {shown_url(self.url)}: it does not parse") from None
        if "timeout_s" in options:
            raise ValueError(
                f"store URL {shown_url(self.url)} sets timeout_s: set it in the config "
                f"(RemoteCacheConfig.timeout_s / kv_connector_extra_config.timeout_s) instead"
            )
        from storage_backends.lmcache_keys import check_hashing, check_salt

        check_hashing(self.key_hashing)
        check_salt(self.cache_salt)
        if self.chunk_size <= 0:
            raise ValueError(f"chunk_size must be > 0, got {self.chunk_size}")
        if not (math.isfinite(self.timeout_s) and self.timeout_s > 0):  # NaN and inf too: never a silent "no store"
            raise ValueError(f"timeout_s must be a finite number > 0, got {self.timeout_s!r}")
        bandwidth = self.bandwidth_bytes_per_s
        if bandwidth is not None and not (math.isfinite(bandwidth) and bandwidth > 0):
            raise ValueError(f"bandwidth_bytes_per_s must be a finite number > 0 or None, got {bandwidth!r}")
        if self.verifier is not None and not (
            isinstance(self.verifier, str) and self.verifier.split("://", 1)[0] in ("tcp", "http", "https")
        ):
            raise ValueError(
                f"bad verifier URL {shown_url(self.verifier)}: expected tcp://HOST:PORT or http(s)://HOST:PORT"
            )
        for name in ("verifier_timeout_s", "verifier_load_timeout_s"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ValueError(f"{name} must be a finite number > 0, got {getattr(self, name)!r}")

    def __repr__(self) -> str:
        shown = ", ".join(
            f"{f.name}={shown_url(getattr(self, f.name)) if f.name in ('url', 'verifier') else repr(getattr(self, f.name))}"
            for f in fields(self)
        )
        return f"{type(self).__name__}({shown})"

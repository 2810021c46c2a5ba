"""The connector's settings checked in vLLM's API server, before it starts its engine and workers.

vLLM builds the connector inside its engine-core process: a bad setting there ends the start-up inside
three tracebacks (~200 lines), and a store of the wrong kind (`redis+cluster://` at a plain Redis, a wrong
password) would start a server that never uses its store. vLLM loads its general plugins
(entry point group `vllm.general_plugins`) in the API server before it parses the command line: this one
reads `--kv-transfer-config` from it and, where it names VeriCacheConnector (alone or inside MultiConnector),
resolves the whole connector config (connector/config.py) and asks the store once. A bad value, or a store
that answers as the wrong kind or refuses the credentials, ends the start-up with ONE line naming it
(exit status 2); a store that does not answer at all is a warning (a store that is down is a miss: requests
compute their prompts until it answers). Anything else (another connector, no such flag, a config file) is
left to vLLM. Set VERICACHE_PREFLIGHT=0 to skip it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import sys

from storage_backends import StoreError, StoreUnavailable, redact_url

FLAG = "--kv-transfer-config"
PROBE_KEY = "vericache-preflight"  # read, never written
REFUSED = ("auth", "noperm", "wrongpass", "invalid username-password", "invalid password")  # a store's refusals


def kv_transfer_text(argv: list[str]) -> str | None:
    """The value of --kv-transfer-config on a command line (`--flag VALUE` or `--flag=VALUE`), else None."""
    for i, arg in enumerate(argv):
        if arg == FLAG and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(FLAG + "="):
            return arg[len(FLAG) + 1 :]
    return None


def names_us(text: str) -> bool:
    """Whether the --kv-transfer-config JSON names VeriCacheConnector (alone or inside MultiConnector)."""
    from .config import our_connector

    try:
        cfg = json.loads(text)
    except json.JSONDecodeError:
        return False
    return isinstance(cfg, dict) and our_connector(cfg) is not None


async def probe_store(url: str, timeout_s: float) -> None:
    """Ask the store for one key. StoreError: it answered as the wrong kind or refused; StoreUnavailable: no
    answer (down, timed out)."""
    from storage_backends import open_backend

    quiet = logging.getLogger("vericache.store")  # its warning would be a second line: the error says it
    was, quiet.disabled = quiet.disabled, True
    backend = open_backend(url, timeout_s=timeout_s, connect_timeout_s=min(timeout_s, 2.0))
    try:
        await asyncio.wait_for(backend.get(PROBE_KEY), timeout_s * 2)
    except asyncio.TimeoutError:
        raise StoreUnavailable(f"{redact_url(url)}: no answer in {timeout_s * 2:g}s") from None
    finally:
        await backend.close()
        quiet.disabled = was


def check(text: str, env=None) -> str | None:
    """--kv-transfer-config text -> None where it is fine, a warning line where the store did not answer;
    ValueError naming what is wrong."""
    from .config import load_kv_transfer_config, load_policy, our_connector

    cfg = load_kv_transfer_config(text, env)  # the whole connector config resolved, its role included
    load_policy(our_connector(json.loads(text)).get("kv_connector_extra_config"))
    try:
        asyncio.run(probe_store(cfg.url, cfg.timeout_s))
    except StoreUnavailable as e:
        if not any(word in str(e).lower() for word in REFUSED):
            return (
                f"store {redact_url(cfg.url)} does not answer now ({e}): requests compute their prompts until it does"
            )
        raise ValueError(f"store {redact_url(cfg.url)} refused the credentials: {e}") from None
    except StoreError as e:
        raise ValueError(f"store {redact_url(cfg.url)} is not what its URL says: {e}") from None
    return None


def check_command_line() -> None:
    """vLLM's general plugin: in the API server (the main process), check the connector config on its command
    line; exit with one line on a bad one."""
    if multiprocessing.parent_process() is not None or os.environ.get("VERICACHE_PREFLIGHT") == "0":
        return
    text = kv_transfer_text(sys.argv[1:])
    if text is None or not names_us(text):
        return
    try:
        warning = check(text)
    except ValueError as e:
        print(f"vericache: bad {FLAG}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    if warning:
        print(f"vericache: WARNING: {warning}", file=sys.stderr, flush=True)

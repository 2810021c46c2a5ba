"""Real processes on 127.0.0.1 for the drafters + verifier tests: `vericache verifier`, `vericache drafter`
and a fake verifier (fake_verifier.py) that answers garbage or nothing, each the demo's procs.Proc (logging
to a file; ready once it prints its "serving ... on <url>" line; stop() sends SIGTERM, kill() SIGKILL: a crash).
The processes get the token and the CURVE keys below by environment (never argv), as pods get Secrets."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported when a process starts: vericache_connector.demo imports torch
    from vericache_connector.demo import procs

SUPPORT = os.path.dirname(os.path.abspath(__file__))
TOKEN = "verifier-test-token-0123456789abcdef"  # tests only; real ones come from a Secret
# CURVE key pairs (Z85), tests only: the verifier's, the drafters', and one the verifier does not admit
SERVER_PUBLIC, SERVER_SECRET = b"Xi72&LXFBn1@-xj^{9MoY0Z(DX^S]0ef>8zW}bs?", b"^BmVXHkCyLq-UPiC{wX]Hnq^tWEeKzDI]>-g3^AG"
CLIENT_PUBLIC, CLIENT_SECRET = b"(kH:EuYB*)})My^u?t[5R!GGWPosyvZY)xtq+Qac", b"&4i*1AA?YxD4S%280Q]RHQb&xdgNp8cP4$zr(h7p"
STRANGER_PUBLIC, STRANGER_SECRET = (
    b"8E]HDG[Um3-s^I+gC:gG9w=<0O(L)c.P+mKQRwKf",
    b"8+AaZ/*sCfy>7N^H@iAfnonjKBS:}F&[HQ%rYu&y",
)


def client_env() -> dict[str, str]:
    """What a drafter needs: the token, its secret key and the verifier's public key."""
    return {
        "VERICACHE_VERIFIER_TOKEN": TOKEN,
        "VERICACHE_VERIFIER_CLIENT_SECRET_KEY": CLIENT_SECRET.decode(),
        "VERICACHE_VERIFIER_PUBLIC_KEY": SERVER_PUBLIC.decode(),
    }


def server_env() -> dict[str, str]:
    """What the verifier needs: the token, its secret key and the drafters' public keys."""
    return {
        "VERICACHE_VERIFIER_TOKEN": TOKEN,
        "VERICACHE_VERIFIER_SECRET_KEY": SERVER_SECRET.decode(),
        "VERICACHE_VERIFIER_CLIENT_KEYS": CLIENT_PUBLIC.decode(),
    }


def proc_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERICACHE_VERIFIER_")}
    return {**env, **client_env(), **server_env(), "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": "0", **extra}


def dealer(url: str, secret: bytes = CLIENT_SECRET, public: bytes = CLIENT_PUBLIC):
    """A raw DEALER to the verifier at url with these CURVE keys (tests that send hand-made frames)."""
    import zmq

    from vericache_connector.remote import rpc

    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = secret, public, SERVER_PUBLIC
    sock.connect(rpc.zmq_endpoint(url))
    return sock


def start(name: str, argv: list[str], log_path: str, env=None, ready_s: float = 180, program=None) -> procs.Proc:
    """procs.Proc(...) once it serves; when it exits or is not serving within ready_s: killed, and RuntimeError
    with its log's tail."""
    from vericache_connector.demo import procs

    p = procs.Proc(name, argv, log_path, env or proc_env(), program=program)
    try:
        p.wait_ready(ready_s)
    except RuntimeError:
        p.kill()
        raise RuntimeError(f"{p.argv[2:4]} did not start (exit {p.proc.returncode}):\n{p.log()[-3000:]}") from None
    return p


def verifier(store: str, log_path: str, port: int = 0, ttl_s: float = 30.0, **env) -> procs.Proc:
    argv = ["verifier", "--port", str(port), "--ttl-s", str(ttl_s)]
    return start("verifier", argv, log_path, proc_env(VERICACHE_STORE_URL=store, **env))


def drafter(store: str, verifier_url: str, log_path: str, *extra: str) -> procs.Proc:
    argv = ["drafter", "--port", "0", "--verifier", verifier_url, *extra]
    return start("drafter", argv, log_path, proc_env(VERICACHE_STORE_URL=store))


def fake_verifier(mode: str, log_path: str) -> procs.Proc:
    program = [sys.executable, os.path.join(SUPPORT, "fake_verifier.py")]
    return start("fake verifier", [mode], log_path, ready_s=60, program=program)


def usage(url: str):
    """The verifier's counters (rpc.Usage), asked over its own protocol."""
    from vericache_connector.remote import auth, rpc

    client = rpc.ZmqVerifier(url, TOKEN.encode(), timeout_s=10, keys=auth.client_keys(client_env()))
    try:
        return client.call(rpc.Stats())
    finally:
        client.close()


def seed_store(engine, url: str, ids: list[int], chunk: int = 256, compressor: str = "kivi4") -> int:
    """Write both copies of ids' stored prefix straight through DualCopyStore (as a miss would); returns
    the stored length."""
    import asyncio

    from storage_backends import DualCopyStore, stored_prefix_len
    from vericache_connector.compressors import get_compressor

    stored = stored_prefix_len(len(ids), chunk)
    pre = engine.prefill(ids[:stored])
    comp = get_compressor(compressor).compress(pre.prefix)
    layers = [{"k": k, "v": v} for k, v in zip(pre.prefix.keys, pre.prefix.values)]

    async def put():
        async with DualCopyStore(url, engine.model_name, engine.model.dtype, chunk) as st:
            await st.put_prefix(ids[:stored], layers, {comp.spec: comp.to_payload()})

    asyncio.run(asyncio.wait_for(put(), 120))
    return stored

"""Who may talk to the verifier: the CURVE keys of the verifier and of its drafters.

ZeroMQ CURVE (CurveZMQ: Curve25519 keys, every frame encrypted and authenticated) between drafters and the
verifier. The verifier holds a secret key; each drafter holds a key pair of its own and the verifier's
public key; the verifier admits only the drafter public keys it is given, through a ZAP handler (the
ZeroMQ Authentication Protocol: libzmq asks it during the handshake, before any message of the peer is
delivered). The shared token (rpc.py) still goes with every call, now inside the encrypted channel.

Keys are Z85 text (40 characters: `python -c "import zmq; print(*zmq.curve_keypair())"` prints a public
and a secret key), each from NAME_FILE (a mounted Secret file) or NAME (credentials.secret_from_env):
  the verifier  VERICACHE_VERIFIER_SECRET_KEY          its secret key
                VERICACHE_VERIFIER_CLIENT_KEYS         the drafters' public keys (whitespace or comma separated)
  a drafter     VERICACHE_VERIFIER_CLIENT_SECRET_KEY   its secret key
                VERICACHE_VERIFIER_PUBLIC_KEY          the verifier's public key
Without keys both sides refuse to start, unless VERICACHE_VERIFIER_INSECURE=1 (a laptop, a test): calls
then travel in clear as they did before CURVE, and both sides log a warning saying so.

gate.py holds the verifier's side of the handshake (the ZAP handler that admits these keys) and bounds what
a peer without a key can cost it. `python -m vericache_connector.remote.auth DIR` writes a key pair for each
side (write_keys).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass

from storage_backends.credentials import secret_from_env

from .peer_log import esc

SECRET_KEY_ENV = "VERICACHE_VERIFIER_SECRET_KEY"
CLIENT_KEYS_ENV = "VERICACHE_VERIFIER_CLIENT_KEYS"
CLIENT_SECRET_KEY_ENV = "VERICACHE_VERIFIER_CLIENT_SECRET_KEY"
PUBLIC_KEY_ENV = "VERICACHE_VERIFIER_PUBLIC_KEY"
INSECURE_ENV = "VERICACHE_VERIFIER_INSECURE"
ZAP_DOMAIN = b"vericache-verifier"


# ---- keys ---------------------------------------------------------------------------------------------
def _key(value: bytes, name: str) -> bytes:
    """A Z85 CURVE key checked (40 characters, 32 bytes); ValueError naming the variable, never the value."""
    from zmq.utils import z85

    try:
        ok = len(value) == 40 and len(z85.decode(value)) == 32
    except (ValueError, KeyError, TypeError, IndexError, struct.error):  # not Z85 characters
        ok = False
    if not ok:
        raise ValueError(f"{name} is not a CURVE key (40 Z85 characters, as zmq.curve_keypair() makes them)")
    return bytes(value)


def _curve_available() -> None:
    import zmq

    if not zmq.has("curve"):
        raise ValueError(f"this pyzmq's libzmq {zmq.zmq_version()} has no CURVE: set {INSECURE_ENV}=1 to run in clear")


def insecure(env=None) -> bool:
    """VERICACHE_VERIFIER_INSECURE=1: no CURVE (calls in clear). Any other value but unset/0 is an error."""
    value = (os.environ if env is None else env).get(INSECURE_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{INSECURE_ENV} must be 1 or 0, got {esc(value, 20)!r}")
    return value == "1"


def _keys(names: tuple[str, ...], env, side: str) -> list[bytes] | None:
    """The values of names (each required), or None when none is set and the insecure mode is on."""
    values = {n: secret_from_env(n, env, what=n) for n in names}
    off = insecure(env)
    if all(v is None for v in values.values()):
        if off:
            return None
        files = " and ".join(f"{n}_FILE" for n in names)
        raise ValueError(
            f"no CURVE keys for the {side}: set {files} (mounted Secret files; or the variables themselves), "
            f"or {INSECURE_ENV}=1 to run without (calls in clear: a test setup only)"
        )
    if off:
        raise ValueError(f"{INSECURE_ENV}=1 and CURVE keys are both set for the {side}: unset one")
    missing = [n for n, v in values.items() if v is None]
    if missing:
        raise ValueError(f"the {side} needs {' and '.join(missing)} too (a _FILE path or the value)")
    _curve_available()
    return [values[n] for n in names]


@dataclass(frozen=True, repr=False)
class ServerKeys:
    secret: bytes  # Z85
    public: bytes  # Z85, derived from secret
    clients: frozenset[bytes]  # raw 32-byte public keys of the drafters admitted

    def __repr__(self) -> str:
        return f"<ServerKeys public={self.public.decode()} clients={len(self.clients)}>"  # never the secret


@dataclass(frozen=True, repr=False)
class ClientKeys:
    secret: bytes
    public: bytes
    server: bytes  # the verifier's public key (Z85)

    def __repr__(self) -> str:
        return f"<ClientKeys public={self.public.decode()} server={self.server.decode()}>"


def server_keys(env=None) -> ServerKeys | None:
    """The verifier's keys from the environment (module docstring); None in the insecure mode."""
    import zmq
    from zmq.utils import z85

    got = _keys((SECRET_KEY_ENV, CLIENT_KEYS_ENV), env, "verifier")
    if got is None:
        return None
    secret = _key(got[0], SECRET_KEY_ENV)
    clients = [c for c in got[1].replace(b",", b" ").split() if c]
    if not clients:
        raise ValueError(f"{CLIENT_KEYS_ENV} holds no public key")
    raw = frozenset(z85.decode(_key(c, f"a key in {CLIENT_KEYS_ENV}")) for c in clients)
    return ServerKeys(secret, zmq.curve_public(secret), raw)


def client_keys(env=None) -> ClientKeys | None:
    """A drafter's keys from the environment (module docstring); None in the insecure mode."""
    import zmq

    got = _keys((CLIENT_SECRET_KEY_ENV, PUBLIC_KEY_ENV), env, "drafter")
    if got is None:
        return None
    secret = _key(got[0], CLIENT_SECRET_KEY_ENV)
    return ClientKeys(secret, zmq.curve_public(secret), _key(got[1].strip(), PUBLIC_KEY_ENV))


def secure_client(sock, keys: ClientKeys | None) -> None:
    if keys is not None:
        sock.curve_secretkey, sock.curve_publickey, sock.curve_serverkey = keys.secret, keys.public, keys.server


def secure_server(sock, keys: ServerKeys | None) -> None:
    """CURVE on a server socket, with ZAP enforced: no handler, no handshake (never 'any key')."""
    import zmq

    if keys is not None:
        sock.curve_server = True
        sock.curve_secretkey, sock.curve_publickey = keys.secret, keys.public
        sock.zap_domain = ZAP_DOMAIN
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)


# ---- keys for one machine (a laptop, the demo, tests) ----------------------------------------------------
def write_keys(folder: str) -> dict[str, str]:
    """A fresh verifier key pair and one drafter key pair, in files only this user reads (0600) under
    folder; returns the environment naming them (each side reads its own two). In a cluster the keys come
    from Secrets instead (k8s/secrets/verifier.example.yaml)."""
    import zmq

    os.makedirs(folder, mode=0o700, exist_ok=True)
    server_pub, server_sec = zmq.curve_keypair()
    client_pub, client_sec = zmq.curve_keypair()
    files = {
        SECRET_KEY_ENV: ("verifier.key", server_sec),
        CLIENT_KEYS_ENV: ("drafters.pub", client_pub),
        CLIENT_SECRET_KEY_ENV: ("drafter.key", client_sec),
        PUBLIC_KEY_ENV: ("verifier.pub", server_pub),
    }
    env = {}
    for name, (file, value) in files.items():
        path = os.path.join(folder, file)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(value + b"\n")
        env[f"{name}_FILE"] = path
    return env


def main(argv: list[str] | None = None) -> int:
    """python -m vericache_connector.remote.auth DIR: write_keys(DIR), and print the environment."""
    import argparse

    p = argparse.ArgumentParser(description="Write a verifier key pair and a drafter key pair (CURVE) to DIR.")
    p.add_argument("dir")
    for name, path in write_keys(p.parse_args(argv).dir).items():
        print(f"{name}={path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

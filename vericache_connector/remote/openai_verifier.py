"""A vLLM server next to the store as the verifier: greedy drafts checked through its OpenAI API.

One verify call is one /v1/completions request with prompt = prompt + emitted + drafts, max_tokens 1,
temperature 0 and prompt_logprobs 1: entry L + j of prompt_logprobs (L = len(prompt + emitted)) is vLLM's
distribution for draft d_j, whose rank-1 token is vLLM's argmax there, and the one generated token is its
argmax after the last draft. So n = leading j with argmax_j == d_j, and the next token is argmax_n (the
correction) or, when every draft matched, the generated token (the bonus): vLLM's own greedy decisions.

The call runs on a worker thread, so the drafter keeps drafting while it is in flight, exactly as with
our verifier (the VerifierClient protocol of client.py, as rpc.ZmqVerifier). Auth: vLLM's --api-key
(VLLM_API_KEY) as a Bearer token, the same VERICACHE_VERIFIER_TOKEN the drafters read.

Limits, from vLLM 0.32 itself: a request with prompt_logprobs never reads the prefix cache nor a KV
connector's load (SamplingParams sets skip_reading_prefix_cache; the scheduler then drops the connector's
match), so each verify call prefills prompt + emitted + drafts on the verifier: exact, but the full-KV
load over the fast link is not used on this backend. Sampling is not offered (no draft-probability
input in the API): a sampled request falls back to the drafter's local path.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.error
import urllib.request
from urllib.parse import urlsplit

import torch

from ..model.sampling import top_token, verify
from . import rpc

MAX_RESPONSE_BYTES = 64 << 20  # prompt_logprobs of a long prompt: ~200 bytes per token


class OpenAIVerifier:
    cheap_calls = False  # every call prefills the whole sequence: calls of draft_k drafts (drafter.py)

    def __init__(self, url: str, token: bytes | None, timeout_s: float = rpc.DEFAULT_TIMEOUT_S):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"bad vLLM verifier URL {url!r}: expected http(s)://HOST:PORT")
        self.url, self.timeout_s = url, timeout_s
        self.base = f"{parts.scheme}://{parts.netloc}{parts.path.rstrip('/').removesuffix('/v1')}"
        self.model = dict(p.split("=", 1) for p in parts.query.split("&") if "=" in p).get("model")
        self._token = token
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="vericache-vllm-verify")
        self._fut: concurrent.futures.Future | None = None
        self.deadline, self.waits_s = 0.0, timeout_s

    def __repr__(self) -> str:
        return f"<OpenAIVerifier {self.base}>"

    # ---- the VerifierClient protocol (client.py) -----------------------------------------------
    def send(self, call: rpc.Verify, timeout_s: float | None = None) -> None:
        if call.temperature > 0:
            raise rpc.VerifierError("the vLLM verifier backend checks greedy drafts only")
        self._fut = self._pool.submit(self._verify, call)
        self.waits_s = self.timeout_s if timeout_s is None else timeout_s
        self.deadline = time.monotonic() + self.waits_s

    def poll(self, wait_s: float = 0.0):
        left = min(wait_s, self.deadline - time.monotonic())
        try:
            return self._fut.result(max(0.0, left))
        except concurrent.futures.TimeoutError:
            if time.monotonic() >= self.deadline:
                self._fut.cancel()
                raise rpc.VerifierUnavailable(f"vLLM verifier {self.base}: no answer within {self.waits_s}s")
            return None

    def release(self, request: str) -> None:
        self._fut = None  # vLLM keeps no per-request state of ours

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- one call, on the worker thread ----------------------------------------------------------------
    def _verify(self, call: rpc.Verify) -> rpc.Verdict:
        seq = list(call.prompt) + list(call.emitted)
        drafts = list(call.drafts)
        body = {
            "model": self.model or self._served_model(),
            "prompt": seq + drafts,
            "max_tokens": 1,
            "temperature": 0.0,
            "prompt_logprobs": 1,
            "return_token_ids": True,
        }
        got = self._post("/v1/completions", body)
        try:
            choice = got["choices"][0]
            plp = choice["prompt_logprobs"]
            bonus = int(choice["token_ids"][0])
            if len(plp) != len(seq) + len(drafts):
                raise ValueError(f"{len(plp)} prompt logprobs for {len(seq) + len(drafts)} prompt tokens")
            best = [top_token(plp[len(seq) + j]) for j in range(len(drafts))] + [bonus]  # its greedy tokens
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise rpc.BadAnswer(f"vLLM verifier {self.base}: unexpected answer ({type(e).__name__}: {e})") from None
        n, token = verify(torch.tensor([drafts], dtype=torch.long).view(1, -1), torch.tensor([best]))
        return rpc.Verdict(call.request, call.seq, int(n[0]), int(token[0]))

    def _served_model(self) -> str:
        try:
            self.model = self._get("/v1/models")["data"][0]["id"]
        except (KeyError, IndexError, TypeError) as e:
            raise rpc.BadAnswer(f"vLLM verifier {self.base}: /v1/models lists no model ({e})") from None
        return self.model

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self._token:
            h["Authorization"] = "Bearer " + self._token.decode()
        return h

    def _get(self, path: str) -> dict:
        return self._open(urllib.request.Request(self.base + path, headers=self._headers()))

    def _post(self, path: str, body: dict) -> dict:
        return self._open(urllib.request.Request(self.base + path, json.dumps(body).encode(), self._headers()))

    def _open(self, req: urllib.request.Request) -> dict:
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as r:
                data = r.read(MAX_RESPONSE_BYTES + 1)
        except urllib.error.HTTPError as e:
            detail = e.read(300).decode("utf-8", "replace")
            raise rpc.VerifierRefused(rpc.Failure("", -1, f"http-{e.code}", detail)) from None
        except (urllib.error.URLError, OSError) as e:  # refused, reset, timed out
            raise rpc.VerifierUnavailable(f"vLLM verifier {self.base}: {e}") from None
        if len(data) > MAX_RESPONSE_BYTES:
            raise rpc.BadAnswer(f"vLLM verifier {self.base}: answer over {MAX_RESPONSE_BYTES} bytes")
        try:
            return json.loads(data)
        except ValueError as e:
            raise rpc.BadAnswer(f"vLLM verifier {self.base}: answer is not JSON ({e})") from None

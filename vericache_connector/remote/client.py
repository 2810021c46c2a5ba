"""VerifierClient: what a drafter's decode loop needs from a verifier, whichever it is.

Implemented by rpc.ZmqVerifier (our verifier over ZeroMQ: it keeps each request's full KV resident, so a
call costs one short forward) and openai_verifier.OpenAIVerifier (a vLLM server: prompt logprobs over the
whole sequence, one prefill per call). The pipeline (drafter.VerifiedDecode) sends one call at a time and
polls for its answer between draft steps; `cheap_calls` decides how many drafts a call carries.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from . import rpc


@runtime_checkable
class VerifierClient(Protocol):
    # True: a call costs the verifier a short forward (calls go out as soon as the previous answer is in, with
    # the drafts ready); False: it recomputes the sequence per call (calls of draft_k drafts)
    cheap_calls: bool

    def send(self, call: rpc.Verify, timeout_s: float | None = None) -> None:
        """Send one call (one in flight at a time); timeout_s: its deadline (None: the client's own)."""

    def poll(self, wait_s: float = 0.0) -> rpc.Answer | None:
        """The answer to the call in flight, waiting up to wait_s; None if not in yet. Raises a
        rpc.VerifierError subclass on a fault (past the deadline, refused, unreadable)."""

    def release(self, request: str) -> None:
        """The request is done or abandoned: the verifier may free what it holds for it."""

    def close(self) -> None: ...


def make_verifier(url: str, token_file: str | None, timeout_s: float) -> VerifierClient:
    """tcp://... -> our verifier (rpc.ZmqVerifier); http(s)://... -> a vLLM OpenAI server (greedy)."""
    if url.startswith(("http://", "https://")):
        from .openai_verifier import OpenAIVerifier

        token = None
        try:
            token = rpc.verifier_token(token_file)
        except ValueError:
            if token_file:
                raise
        return OpenAIVerifier(url, token, timeout_s)
    return rpc.ZmqVerifier(url, rpc.verifier_token(token_file), timeout_s)

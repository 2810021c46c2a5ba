"""The second path of a remote hit: drafts made here on the compressed copy, checked by a verifier beside
the store (remote/drafter.py's VerifiedDecode), so the full copy never crosses the link to this node.

    hit = VerifiedHit.open(cache, request)          # its first call goes out now: the verifier loads the
    res = hit.run(compressed, t_compressed)         # full copy over its fast link while we fetch ours

run() returns the RemoteResult (path "verified"), or the exception of a compressed copy that does not
build a draft cache (the caller then goes on with the full copy alone, as without a verifier). On a
verifier fault the full copy is streamed here after all and decoding resumes on the compressed copy from
the tokens verified so far (path "verifier-fallback"): prompt suffix + emitted are round 1's feed, so the
output continues exactly after them.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from ..compressors import CompressedKV
from .hit import RemoteResult, Request, Timings, err, since

logger = logging.getLogger("vericache.remote")


class VerifiedHit:
    def __init__(self, cache, r: Request, session):
        self.cache, self.r, self.session = cache, r, session  # cache: the RemotePrefixCache running r

    @classmethod
    def open(cls, cache, r: Request) -> "VerifiedHit | None":
        """The verify session's opening call; None when the verifier is down or refuses this request."""
        from .drafter import VerifiedDecode

        ids = r.prefix + r.suffix[0].tolist()
        name = cache.cfg.model_name or cache.engine.model_name
        session = VerifiedDecode(cache.verifier, name, ids, len(r.prefix), r.decode, cache.engine.model.cfg)
        try:
            session.open(cache.cfg.verifier_load_timeout_s)
        except Exception as e:  # down, or refuses this request: the path without a verifier
            logger.warning("verifier %s not used (%s: %s)", cache.cfg.verifier, type(e).__name__, e)
            return None
        return cls(cache, r, session)

    def abandon(self) -> None:
        self.session.abandon()

    def run(self, compressed: CompressedKV, t_compressed: float) -> RemoteResult | Exception:
        from .drafter import VerifierFault

        engine, r = self.cache.engine, self.r
        try:
            draft = engine.draft_cache([compressed], r.extra)
        except Exception as e:  # validated, yet it does not build
            logger.warning("compressed copy unusable (%s: %s); using the full copy", type(e).__name__, e)
            return e
        c0, t_ready = draft.lengths.clone(), time.perf_counter()
        try:
            out = self.session.run(engine.draft_model(), draft)
        except VerifierFault as f:
            draft.lengths = c0
            return self._finish_locally(draft, f.emitted, f.cause, compressed)
        tm = Timings(
            since(t_compressed, r.t0),
            since(t_ready, r.t0),
            since(out.first_draft_t, r.t0),
            first_token_s=since(out.first_token_t, r.t0),
        )
        logger.info(
            "verified: %d tokens in %d verify calls (mean accepted %.2f of %d drafted, forwards of up to %d rows)",
            len(out.tokens),
            out.calls,
            out.stats.mean_accepted(),
            out.drafted,
            max(out.batched, default=0),
        )
        return RemoteResult(
            out.tokens, "verified", out.stats, tm, bytes_compressed=compressed.nbytes, draft_steps=out.drafted
        )

    def _finish_locally(self, draft, emitted: list[int], cause, compressed: CompressedKV) -> RemoteResult:
        """The full copy streamed here (as without a verifier) while drafting resumes on the compressed copy."""
        cache, r = self.cache, self.r
        logger.warning(
            "verifier %s failed after %d verified tokens (%s: %s); fetching the full copy and finishing locally",
            cache.cfg.verifier,
            len(emitted),
            type(cause).__name__,
            cause,
        )
        decode = dataclasses.replace(r.decode, max_new_tokens=r.decode.max_new_tokens - len(emitted))
        first = torch.cat([r.suffix, torch.tensor([emitted], dtype=r.suffix.dtype, device=r.suffix.device)], 1)
        rest = Request(r.prefix, first, decode, r.t0)
        with cache.streaming_full_copy(rest) as (full, arrival):
            res = cache.decode(full, draft, first, decode, arrival, r.t0, "verifier-fallback")
        res.tokens = emitted + res.tokens
        res.bytes_compressed = compressed.nbytes
        res = cache.arrived(res, arrival, r.t0, "verifier-fallback-recompute")
        res.error = res.error or f"verifier: {err(cause)}"
        return res

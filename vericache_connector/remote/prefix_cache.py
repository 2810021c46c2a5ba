"""The engine's remote prefix cache: compressed copy first, full copy streamed in, output lossless.

    with RemotePrefixCache(engine, RemoteCacheConfig(url="redis://127.0.0.1:6379/0")) as cache:
        res = cache.generate(prompt_ids, DecodeConfig(max_new_tokens=64))   # .tokens .path .timings

A prompt of T tokens stores its first stored_prefix_len(T, chunk) tokens (whole chunks; the suffix keeps
>= 1 token, so the first verify pass gives the first token's logits). HIT: fetch the small compressed copy, build the draft
cache and start drafting at once, while the full copy streams layer by layer into the full cache on a
background event loop; the first verify pass waits for it and doubles as the suffix's prefill. MISS:
prefill locally, write both copies (the store writes payloads first, manifests last), decode. Every
store fault falls back to local computation, so the output is always the full-KV output.
One request at a time per RemotePrefixCache.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from dataclasses import dataclass

import torch

from storage_backends import CorruptObject, MissingObject, StoreUnavailable, stored_prefix_len

from ..compressors import CompressedKV, LayeredKV, PrefixKV, get_compressor
from ..engine.kv_cache import KVCache
from ..engine.llm_engine import VeriCacheEngine
from ..engine.speculative import DecodeConfig, SpecStats, speculative_decode
from .config import RemoteCacheConfig
from .full_copy import stream_full_copy
from .store_client import StoreClient

logger = logging.getLogger("vericache.remote")


@dataclass
class Timings:
    """Seconds since generate() was called."""

    first_draft_s: float | None = None  # first token drafted on the compressed KV
    drafted_until_s: float | None = None  # last draft of round 1 (it drafts on until the full copy is in)
    full_arrived_s: float | None = None  # full prefix KV complete (streamed in, or computed here)
    first_token_s: float | None = None  # first verified token
    total_s: float = 0.0


@dataclass
class RemoteResult:
    tokens: list[int]
    path: str  # local | miss | hit | hit-recompute | full-only | fallback-recompute
    stats: SpecStats
    timings: Timings
    stored_tokens: int = 0  # prompt tokens looked up in (or written to) the store
    bytes_compressed: int = 0  # fetched
    bytes_full: int = 0  # fetched
    wrote: bool = False  # this request wrote copies (now visible)
    error: str | None = None  # the fault behind a fallback


class _Arrival:
    """The full copy streaming into the full cache; wait() recomputes it here if the stream failed."""

    def __init__(self, recompute):
        self.event, self.recompute = threading.Event(), recompute
        self.error: BaseException | None = None
        self.nbytes, self.done_at = 0, None

    def ready(self) -> bool:
        return self.event.is_set()

    def wait(self) -> None:
        self.event.wait()
        if self.done_at is None:  # the stream failed: nothing writes into the cache any more
            logger.warning(
                "full copy stream failed (%s: %s); recomputing the prefix KV locally",
                type(self.error).__name__,
                self.error,
            )
            self.recompute()
            self.done_at = time.perf_counter()


class _Clock:
    """Stands in for the model in speculative_decode; notes when the first and the last draft forward of
    round 1 (the ones before the first verify pass) return. Draft forwards run `drafter`."""

    def __init__(self, model, draft: KVCache, drafter=None):
        self.model, self.cfg, self.draft, self.drafter = model, model.cfg, draft, drafter or model
        self.first_draft = self.round1_end = None
        self.verified = False

    def __call__(self, ids, positions, cache, **kw):
        out = (self.drafter if cache is self.draft else self.model)(ids, positions, cache, **kw)
        if cache is not self.draft:
            self.verified = True
        elif not self.verified:
            self.round1_end = time.perf_counter()
            self.first_draft = self.first_draft or self.round1_end
        return out


@dataclass
class _Request:
    prefix: list[int]  # the stored part of the prompt
    suffix: torch.Tensor  # [1, P] the rest, fed through the first draft and verify passes
    decode: DecodeConfig
    t0: float

    @property
    def extra(self) -> int:  # cache room past the prefix
        return self.suffix.shape[1] + self.decode.cache_headroom


class RemotePrefixCache:
    def __init__(self, engine: VeriCacheEngine, cfg: RemoteCacheConfig):
        self.engine, self.cfg = engine, cfg
        self.compressor = get_compressor(cfg.compressor)
        self.client = StoreClient(cfg, cfg.model_name or engine.model_name, engine.model.dtype, "vericache-remote")
        self.store = self.client.store

    def close(self) -> None:
        self.client.close()

    def __enter__(self) -> "RemotePrefixCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- one request ---------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], decode: DecodeConfig) -> RemoteResult:
        t0, ids = time.perf_counter(), list(prompt_ids)
        self.engine.check_length(len(ids), decode.max_new_tokens)
        stored = stored_prefix_len(len(ids), self.cfg.chunk_size)
        if stored == 0:
            res = self._local(ids, decode, t0)
        else:
            res = self._remote(
                _Request(ids[:stored], torch.tensor([ids[stored:]], device=self.engine.model.device), decode, t0)
            )
        res.stored_tokens, res.timings.total_s = stored, time.perf_counter() - t0
        tm = res.timings
        logger.info(
            "%s: %d prompt tokens (%d stored), %d new; first draft %s, full KV %s, first token %s, "
            "total %.2fs; fetched %d compressed + %d full bytes",
            res.path,
            len(ids),
            stored,
            len(res.tokens),
            _s(tm.first_draft_s),
            _s(tm.full_arrived_s),
            _s(tm.first_token_s),
            tm.total_s,
            res.bytes_compressed,
            res.bytes_full,
        )
        return res

    def _local(self, ids, decode, t0) -> RemoteResult:
        """Too short to store a chunk: plain local VeriCache."""
        pre = self.engine.prefill(ids)
        arrived, extra = time.perf_counter(), decode.cache_headroom
        full = self.engine.full_cache([pre], extra)
        draft = self.engine.draft_cache([self.compressor.compress(pre.prefix)], extra)
        res = self._decode(full, draft, self.engine.first_tokens([pre], decode), decode, None, t0, "local")
        res.timings.full_arrived_s = res.timings.first_token_s = arrived - t0
        return res

    def _remote(self, r: _Request) -> RemoteResult:
        # 1) Lookup: full copy of every chunk stored? compressed copy for our spec?
        try:
            found, has_comp = self._call(self._lookup(r.prefix), self.cfg.timeout_s)
        except Exception as e:  # down, timed out, broken: recompute, and do not try to write
            logger.warning("store lookup failed (%s: %s); recomputing locally, not storing", type(e).__name__, e)
            return self._miss(r, write=False, error=e)
        if found < len(r.prefix):
            return self._miss(r, write=True)
        # 2) HIT: the small compressed copy first. Absent or corrupt -> full-only; store gone -> recompute.
        compressed, error = None, None
        if has_comp:
            try:
                compressed = self._call(self._fetch_compressed(r.prefix), self.cfg.timeout_s)
            except StoreUnavailable as e:
                logger.warning("compressed copy fetch failed (%s); recomputing locally", e)
                return self._miss(r, write=False, error=e)
            except Exception as e:
                logger.warning("compressed copy unusable (%s: %s); using the full copy", type(e).__name__, e)
                error = e
        # 3) Full cache with the prefix length set but its data still empty; stream the full copy into it.
        full = self.engine.model.new_cache(1, len(r.prefix) + r.extra)
        full.lengths[0] = len(r.prefix)
        arrival = _Arrival(lambda: self._recompute_into(full, r.prefix))
        self._submit(self._stream_into(r.prefix, full, arrival))
        if compressed is None:
            return self._full_only(r, full, arrival, error)
        # 4) Draft on the compressed copy at once; round 1 verifies once the full copy is in.
        draft = self.engine.draft_cache([compressed], r.extra)
        res = self._decode(full, draft, r.suffix, r.decode, arrival, r.t0, "hit")
        res.bytes_compressed = compressed.nbytes
        res = self._arrived(res, arrival, r.t0, "hit-recompute")
        if isinstance(arrival.error, (CorruptObject, MissingObject)):  # repair: rewrite the full copy
            n = len(r.prefix)
            layers = [{"k": k[0, :, :n], "v": v[0, :, :n]} for k, v in zip(full.keys, full.values)]
            self._finish_write(
                res, self._submit(self.store.put_prefix(r.prefix, layers, overwrite=True)), "full copy repair"
            )
        return res

    def _miss(self, r: _Request, write: bool, error: BaseException | None = None) -> RemoteResult:
        """Prefill the prefix here, compress it, write both copies (concurrently with decoding)."""
        pre = self.engine.prefill(r.prefix)
        arrived = time.perf_counter()
        comp = self.compressor.compress(pre.prefix)
        layers = [{"k": k, "v": v} for k, v in zip(pre.prefix.keys, pre.prefix.values)]
        writing = (
            self._submit(self.store.put_prefix(r.prefix, layers, {comp.spec: comp.to_payload()})) if write else None
        )
        full, draft = self.engine.full_cache([pre], r.extra), self.engine.draft_cache([comp], r.extra)
        res = self._decode(full, draft, r.suffix, r.decode, None, r.t0, "miss" if write else "fallback-recompute")
        res.timings.full_arrived_s, res.error = arrived - r.t0, _err(error)
        if writing is not None:  # wait, so that the next request sees the copies
            self._finish_write(res, writing, "store write")
        return res

    def _full_only(self, r: _Request, full: KVCache, arrival: _Arrival, error) -> RemoteResult:
        """No usable compressed copy: wait for the full copy, compress it here, write the copy back."""
        arrival.wait()
        n = len(r.prefix)
        kv = PrefixKV([k[0, :, :n] for k in full.keys], [v[0, :, :n] for v in full.values])
        if self.compressor.needs_queries:
            kv.obs_queries = self._obs_queries(full, r.prefix)
        comp = self.compressor.compress(kv)
        writing = None
        if arrival.error is None:  # overwrite: a corrupt payload may sit under the same manifest
            writing = self._submit(
                self.store.put_prefix(r.prefix, compressed={comp.spec: comp.to_payload()}, overwrite=True)
            )
        draft = self.engine.draft_cache([comp], r.extra)
        res = self._decode(full, draft, r.suffix, r.decode, None, r.t0, "full-only")
        res.error = _err(error)
        res = self._arrived(res, arrival, r.t0, "fallback-recompute")
        if writing is not None:
            self._finish_write(res, writing, "compressed copy write-back")
        return res

    def _decode(self, full, draft, first, decode, arrival, t0, path) -> RemoteResult:
        clock, marks = _Clock(self.engine.model, draft, self.engine.draft_model()), []
        outs, stats = speculative_decode(
            clock,
            full,
            draft,
            first,
            decode,
            arrival=arrival,
            on_tokens=lambda n: marks or marks.append(time.perf_counter()),
        )
        return RemoteResult(
            outs[0],
            path,
            stats,
            Timings(
                _since(clock.first_draft, t0),
                _since(clock.round1_end, t0),
                first_token_s=_since(marks[0] if marks else None, t0),
            ),
        )

    @staticmethod
    def _arrived(res: RemoteResult, arrival: _Arrival, t0: float, failed_path: str) -> RemoteResult:
        res.timings.full_arrived_s, res.bytes_full = _since(arrival.done_at, t0), arrival.nbytes
        if arrival.error is not None:
            res.path, res.error = failed_path, _err(arrival.error)
        return res

    @staticmethod
    def _finish_write(res: RemoteResult, fut: concurrent.futures.Future, what: str) -> None:
        try:
            fut.result()
            res.wrote = True
        except Exception as e:  # the request is answered anyway; manifests-last keeps halves invisible
            logger.warning(
                "%s failed (%s: %s); request answered, nothing half-written is visible", what, type(e).__name__, e
            )
            res.error = res.error or f"write: {_err(e)}"

    # ---- store side (runs on the loop thread) ----------------------------------------------------
    def _submit(self, coro) -> concurrent.futures.Future:
        return self.client.submit(coro)

    def _call(self, coro, timeout: float):
        return self.client.call(coro, timeout)

    async def _lookup(self, prefix):
        return await asyncio.gather(self.store.lookup(prefix), self.store.has_compressed(prefix, self.compressor.spec))

    async def _fetch_compressed(self, prefix) -> CompressedKV | None:
        got = await self.store.get_compressed(prefix, self.compressor.spec)
        return None if got is None else LayeredKV.from_payload(*got)

    async def _stream_into(self, prefix, full: KVCache, arrival: _Arrival) -> None:
        """Copy each arriving layer into full[layer][0, :, :n]; a fault is left for arrival.wait()."""
        n = len(prefix)

        def put(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            full.keys[layer][0, :, :n] = k
            full.values[layer][0, :, :n] = v
            arrival.nbytes += k.nbytes + v.nbytes

        try:
            await stream_full_copy(
                self.store, prefix, len(full.keys), self.cfg.timeout_s, put, shape=full.keys[0][0, :, :n].shape
            )
            arrival.done_at = time.perf_counter()
        except BaseException as e:  # noqa: BLE001 - handed over to the decoding thread
            arrival.error = e
        finally:
            arrival.event.set()

    # ---- local recomputation -------------------------------------------------------------------
    @torch.inference_mode()
    def _recompute_into(self, full: KVCache, prefix: list[int]) -> None:
        """The prefix's exact KV from a forward into a fresh cache, copied into the full cache."""
        n, model = len(prefix), self.engine.model
        fresh = model.new_cache(1, n)
        model(
            torch.tensor([prefix], device=model.device),
            torch.arange(n, device=model.device)[None],
            fresh,
            last_only=True,
        )
        for layer in range(len(full.keys)):
            full.keys[layer][0, :, :n] = fresh.keys[layer][0]
            full.values[layer][0, :, :n] = fresh.values[layer][0]

    @torch.inference_mode()
    def _obs_queries(self, full: KVCache, prefix: list[int]) -> list[torch.Tensor]:
        """Observation queries (SnapKV, TOVA): re-run only the last window over the fetched KV."""
        n, model = len(prefix), self.engine.model
        w = min(self.engine.obs_window, n)
        scratch = model.new_cache(1, n)
        for layer in range(len(full.keys)):
            scratch.keys[layer][0, :, : n - w] = full.keys[layer][0, :, : n - w]
            scratch.values[layer][0, :, : n - w] = full.values[layer][0, :, : n - w]
        scratch.lengths[0] = n - w
        _, obs = model(
            torch.tensor([prefix[n - w :]], device=model.device),
            torch.arange(n - w, n, device=model.device)[None],
            scratch,
            obs_window=w,
            last_only=True,
        )
        return [o[0] for o in obs]


def _since(t: float | None, t0: float) -> float | None:
    return None if t is None else t - t0


def _err(e: BaseException | None) -> str | None:
    return None if e is None else f"{type(e).__name__}: {e}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"

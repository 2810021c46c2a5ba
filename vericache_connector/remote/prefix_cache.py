"""The engine's remote prefix cache: compressed copy first, full copy streamed in, output lossless.

    with RemotePrefixCache(engine, RemoteCacheConfig(url="redis://127.0.0.1:6379/0")) as cache:
        res = cache.generate(prompt_ids, DecodeConfig(max_new_tokens=64))   # .tokens .path .timings

A prompt of T tokens stores its first stored_prefix_len(T, chunk) tokens (whole chunks; the suffix keeps
>= 1 token, so the first verify pass gives the first token's logits). HIT: fetch the small compressed copy, build the draft
cache and start drafting at once, while the full copy streams layer by layer into the full cache on a
background event loop; the first verify pass waits for it and doubles as the suffix's prefill. MISS:
prefill locally, write both copies (the store writes payloads first, manifests last), decode. Every
store fault falls back to local computation, so the output is always the full-KV output.

Entries are the model's own: keys and manifests name it by engine.model_name (folder name + a
fingerprint of config, weights, tokenizer and dtype), so another checkpoint's entries are never read.
A compressed copy that passed its checksums is still validated against the model and its own meta
(Compressor.validate) before anything drafts on it; one that does not fit is a miss of the compressed
copy (the full copy is used, and a good compressed copy written back). Whatever goes wrong once the
full copy is streaming, the stream is cancelled before generate returns or raises.
One request at a time per RemotePrefixCache: threads may share one, their requests then take turns (a
lock; a request owns the engine's caches, the verifier connection and the store stream while it runs).
close() (or the with-block) waits for the request in progress, ends the loop thread, and a closed cache
raises at once.

With cfg.verifier (drafters + verifier, verified_hit.py), a HIT with a compressed copy fetches only that
copy: a verifier next to the store loads the full copy over its own fast link and checks the drafts, which
go on while each call is in flight (path "verified"; bytes_full stays 0). Any verifier fault: the full copy
is streamed here after all and the request finishes locally from the tokens verified so far
("verifier-fallback"). A miss, or a hit without a usable compressed copy, runs as without a verifier.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time

import torch

from storage_backends import CorruptObject, MissingObject, StoreUnavailable, stored_prefix_len

from ..compressors import CompressedKV, LayeredKV, PrefixKV, get_compressor
from ..engine.llm_engine import VeriCacheEngine
from ..engine.speculative import DecodeConfig, speculative_decode
from ..model.kv_cache import KVCache
from ..store.client import ClientClosed, StoreClient
from ..store.config import RemoteCacheConfig
from ..store.full_copy import stream_full_copy
from .hit import Arrival, DraftClock, RemoteResult, Request, Timings, err, shown_s, since
from .verified_hit import VerifiedHit

logger = logging.getLogger("vericache.remote")


class RemotePrefixCache:
    def __init__(self, engine: VeriCacheEngine, cfg: RemoteCacheConfig):
        self.engine, self.cfg = engine, cfg
        self._turn = threading.Lock()  # one request at a time (module docstring)
        self.compressor = get_compressor(cfg.compressor)
        # cfg.model_name overrides the fingerprinted name: it must then identify the weights itself
        self.client = StoreClient(cfg, cfg.model_name or engine.model_name, engine.model.dtype, "vericache-remote")
        self.store = self.client.store
        self.verifier = None
        if cfg.verifier:
            from .client import make_verifier

            try:
                self.verifier = make_verifier(cfg.verifier, cfg.verifier_token_file, cfg.verifier_timeout_s)
            except BaseException:
                self.client.close()
                raise

    @property
    def closed(self) -> bool:
        return self.client.closed

    def close(self) -> None:
        """After the request in progress (if any): cancel what still runs on the store loop, close the
        store's connections and the verifier's socket, end the loop thread. Idempotent."""
        with self._turn:
            if self.verifier is not None:
                self.verifier.close()
            self.client.close()

    def __enter__(self) -> "RemotePrefixCache":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- one request ---------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], decode: DecodeConfig) -> RemoteResult:
        """One request; a thread calling while another's request runs waits for it (module docstring)."""
        with self._turn:
            if self.closed:
                raise ClientClosed("RemotePrefixCache is closed: make a new one (or generate inside its with-block)")
            return self._generate(prompt_ids, decode)

    def _generate(self, prompt_ids: list[int], decode: DecodeConfig) -> RemoteResult:
        t0, ids = time.perf_counter(), list(prompt_ids)
        self.engine.check_length(len(ids), decode.max_new_tokens)
        stored = stored_prefix_len(len(ids), self.cfg.chunk_size)
        if stored == 0:
            res = self._local(ids, decode, t0)
        else:
            res = self._remote(
                Request(ids[:stored], torch.tensor([ids[stored:]], device=self.engine.model.device), decode, t0)
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
            shown_s(tm.first_draft_s),
            shown_s(tm.full_arrived_s),
            shown_s(tm.first_token_s),
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
        res = self.decode(full, draft, self.engine.first_tokens([pre], decode), decode, None, t0, "local")
        res.timings.full_arrived_s = res.timings.first_token_s = arrived - t0
        return res

    def _remote(self, r: Request) -> RemoteResult:
        # 1) Lookup: full copy of every chunk stored? compressed copy for our spec?
        try:
            found, has_comp = self._call(self._lookup(r.prefix), self.cfg.timeout_s)
        except Exception as e:  # down, timed out, broken: recompute, and do not try to write
            logger.warning("store lookup failed (%s: %s); recomputing locally, not storing", type(e).__name__, e)
            return self._miss(r, write=False, error=e)
        if found < len(r.prefix):
            return self._miss(r, write=True)
        # 2) HIT: the small compressed copy first. Absent or corrupt -> full-only; store gone -> recompute.
        #    Checksums passed; it must also fit the model and its own meta, else it is not used.
        #    With a verifier, its first call goes out now: it loads the full copy while we fetch ours.
        session = VerifiedHit.open(self, r) if has_comp and self.verifier is not None else None
        compressed, error, t_compressed = None, None, None
        if has_comp:
            try:
                compressed = self._call(self._fetch_compressed(r.prefix), self.cfg.timeout_s)
                if compressed is not None:
                    c = self.engine.model.cfg
                    self.compressor.validate(compressed, len(r.prefix), c.num_layers, c.num_kv_heads, c.head_dim)
                    t_compressed = time.perf_counter()
            except StoreUnavailable as e:
                logger.warning("compressed copy fetch failed (%s); recomputing locally", e)
                if session is not None:
                    session.abandon()
                return self._miss(r, write=False, error=e)
            except Exception as e:
                logger.warning("compressed copy unusable (%s: %s); using the full copy", type(e).__name__, e)
                compressed, error = None, e
        if session is not None:
            res = session.run(compressed, t_compressed) if compressed is not None else None
            if isinstance(res, RemoteResult):
                return res
            session.abandon()
            if res is not None:  # the compressed copy does not build a draft cache: the full copy alone
                compressed, error = None, res
        # 3) Stream the full copy into a full cache while drafting on the compressed copy.
        with self.streaming_full_copy(r) as (full, arrival):
            return self._use_copies(r, full, arrival, compressed, error)

    @contextlib.contextmanager
    def streaming_full_copy(self, r: Request):
        """(full cache, arrival): a cache with the prefix length set but its data still empty, the full copy
        streaming into it on the store loop. On leaving (on an error too) the stream is stopped: nothing goes
        on writing into the cache."""
        full = self.engine.model.new_cache(1, len(r.prefix) + r.extra)
        full.lengths[0] = len(r.prefix)
        arrival = Arrival(lambda: self._recompute_into(full, r.prefix))
        self._submit(self._stream_into(r.prefix, full, arrival))
        try:
            yield full, arrival
        finally:
            if not arrival.ready():
                try:
                    self._call(arrival.stop(), self.cfg.timeout_s)
                except Exception as e:
                    logger.warning("full copy stream not stopped (%s: %s)", type(e).__name__, e)

    def _use_copies(self, r: Request, full: KVCache, arrival: Arrival, compressed, error) -> RemoteResult:
        # 4) Draft on the compressed copy at once; round 1 verifies once the full copy is in.
        if compressed is not None:
            try:
                draft = self.engine.draft_cache([compressed], r.extra)
            except Exception as e:  # validated, yet it does not build: the full copy alone
                logger.warning("compressed copy unusable (%s: %s); using the full copy", type(e).__name__, e)
                compressed, error = None, e
        if compressed is None:
            return self._full_only(r, full, arrival, error)
        res = self.decode(full, draft, r.suffix, r.decode, arrival, r.t0, "hit")
        res.bytes_compressed = compressed.nbytes
        res = self.arrived(res, arrival, r.t0, "hit-recompute")
        if isinstance(arrival.error, (CorruptObject, MissingObject)):  # repair: rewrite the full copy
            n = len(r.prefix)
            layers = [{"k": k[0, :, :n], "v": v[0, :, :n]} for k, v in zip(full.keys, full.values)]
            self._finish_write(
                res, self._submit(self.store.put_prefix(r.prefix, layers, overwrite=True)), "full copy repair"
            )
        return res

    def _miss(self, r: Request, write: bool, error: BaseException | None = None) -> RemoteResult:
        """Prefill the prefix here, compress it, write both copies (concurrently with decoding)."""
        pre = self.engine.prefill(r.prefix)
        arrived = time.perf_counter()
        comp = self.compressor.compress(pre.prefix)
        layers = [{"k": k, "v": v} for k, v in zip(pre.prefix.keys, pre.prefix.values)]
        writing = (
            self._submit(self.store.put_prefix(r.prefix, layers, {comp.spec: comp.to_payload()})) if write else None
        )
        full, draft = self.engine.full_cache([pre], r.extra), self.engine.draft_cache([comp], r.extra)
        res = self.decode(full, draft, r.suffix, r.decode, None, r.t0, "miss" if write else "fallback-recompute")
        res.timings.full_arrived_s, res.error = arrived - r.t0, err(error)
        if writing is not None:  # wait, so that the next request sees the copies
            self._finish_write(res, writing, "store write")
        return res

    def _full_only(self, r: Request, full: KVCache, arrival: Arrival, error) -> RemoteResult:
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
        res = self.decode(full, draft, r.suffix, r.decode, None, r.t0, "full-only")
        res.error = err(error)
        res = self.arrived(res, arrival, r.t0, "fallback-recompute")
        if writing is not None:
            self._finish_write(res, writing, "compressed copy write-back")
        return res

    def decode(self, full, draft, first, decode, arrival, t0, path) -> RemoteResult:
        clock, marks = DraftClock(self.engine.model, draft, self.engine.draft_model()), []
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
                first_draft_s=since(clock.first_draft, t0),
                drafted_until_s=since(clock.round1_end, t0),
                first_token_s=since(marks[0] if marks else None, t0),
            ),
        )

    @staticmethod
    def arrived(res: RemoteResult, arrival: Arrival, t0: float, failed_path: str) -> RemoteResult:
        res.timings.full_arrived_s, res.bytes_full = since(arrival.done_at, t0), arrival.nbytes
        if arrival.error is not None:
            res.path, res.error = failed_path, err(arrival.error)
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
            res.error = res.error or f"write: {err(e)}"

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

    async def _stream_into(self, prefix, full: KVCache, arrival: Arrival) -> None:
        """Copy each arriving layer into full[layer][0, :, :n]; a fault is left for arrival.wait()."""
        n = len(prefix)
        arrival.task = asyncio.current_task()

        def put(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
            full.keys[layer][0, :, :n] = k
            full.values[layer][0, :, :n] = v
            arrival.nbytes += k.nbytes + v.nbytes

        try:
            await stream_full_copy(
                self.store, prefix, len(full.keys), self.cfg.timeout_s, put, shape=full.keys[0][0, :, :n].shape
            )
            arrival.done_at = time.perf_counter()
        except asyncio.CancelledError as e:  # arrival.stop() or close(): stop here
            arrival.error = e
            raise
        except Exception as e:  # handed over to the decoding thread
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

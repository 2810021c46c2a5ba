"""One request's drafts verified (the router's path "verified"): remote/drafter.py's loop (VerifiedDecode), with
the drafting done by a drafter-role vLLM server.

A drafter stream (/v1/completions, streamed, greedy) runs ahead of the verified tokens while a verify call is
in flight. S = prompt + emitted + spec, as there: `emitted` are verified, `spec` the drafts beyond them.
  - the opening call (no drafts) goes out at once: the verifier loads the prompt's full copy over its
    fast link meanwhile and answers the first token;
  - a call goes out when none is in flight and enough drafts are ready: k_min with the verify route (a
    call costs the verifier a short forward over the uncached tail), draft_k with prompt-logprobs (a
    call prefills the whole sequence there), or fewer when the stream can give no more (model/draft_rule.py,
    the ZeroMQ drafter's rule too);
  - the verdict (n, t) comes from model.sampling.verify, THE accept rule, applied to the verifier's own
    greedy tokens; emitted += d[:n] + [t] by model.sampling.emit. If all n drafts were accepted and the
    next draft is t, the stream is still on the verified path and drafts on; otherwise it is cancelled
    and a new one starts from prompt + emitted (the drafter's prefix cache keeps the prompt's blocks).
So the output is the verifier's greedy output, token for token.

The request's own state (prompt, emitted, what it wants, its stats, the emit rule) is its RoutedDecode's
(decode.py); a fault (UpstreamError, or Fault: a verdict that does not fit) ends the loop and is finished there.
"""

from __future__ import annotations

import asyncio
import time

import torch

from ..model.draft_rule import DraftRule, eos_ahead
from ..model.sampling import verify
from .upstream import Server, UpstreamError


class Fault(Exception):
    pass


class DraftLoop:
    """One request's draft / verify state: S = prompt + emitted + spec.

    spec      the drafts beyond the verified tokens
    gen       the drafter stream's generation: a restarted stream's events are told from stale ones
    sent      how many of spec the call in flight carries
    expect    all drafts sent were accepted and none came after: the stream's next draft must be this token
    """

    def __init__(self, decode, verifier: Server, drafter: Server):
        """decode: the request's RoutedDecode (its cfg, up, prompt, emitted, want, stats, done, deliver)."""
        cfg = decode.cfg
        self.d, self.verifier, self.drafter = decode, verifier, drafter
        self.events: asyncio.Queue = asyncio.Queue()
        self.spec: list[int] = []
        self.gen, self.sent, self.expect = 0, 0, None
        self.stream: asyncio.Task | None = None
        self.stream_done = True
        self.call: asyncio.Task | None = None
        self.rule = DraftRule.of(cfg.k_min, cfg.k_max, cfg.draft_k, cheap_calls=cfg.verify_api == "route")

    async def run(self, out: asyncio.Queue) -> None:
        """Draft and verify until the request is done; raises UpstreamError or Fault on a fault."""
        cfg, verifier = self.d.cfg, self.verifier
        self.send(0, cfg.open_timeout_s)  # the opening call: the verifier loads the prompt's full copy
        self.start_stream()
        try:
            while not self.d.done:
                kind, *ev = await self.events.get()
                if kind == "drafts" and ev[0] == self.gen:
                    self.on_drafts(ev[1])
                elif kind == "drafts-end" and ev[0] == self.gen:
                    self.on_stream_end(ev[1])
                elif kind == "verdict":
                    await self.on_verdict(*ev, out)
                elif kind == "fault":
                    raise ev[0]
                if self.call is None and not self.d.done and self.ready_to_send():
                    # a verifier that has not answered drafts yet gets the opening deadline (its first forward
                    # over drafts may be slow: vLLM warms up, the full copy still loads)
                    self.send(self.drafts_to_send(), cfg.verify_timeout_s if verifier.warm else cfg.open_timeout_s)
        finally:
            self.stop()

    def budget(self) -> int:  # tokens still to emit
        return self.d.want.max_tokens - len(self.d.emitted)

    def eos_ahead(self) -> bool:
        return eos_ahead(self.spec, self.d.want.eos, not self.d.want.ignore_eos)

    def start_stream(self) -> None:
        """A drafter stream from S; drafts past the budget or the cap are never sent, so never asked for."""
        if self.stream is not None:
            self.stream.cancel()
        self.gen += 1
        m = min(self.budget() - 1, self.rule.k_cap) - len(self.spec)
        self.stream_done, self.stream = m <= 0, None
        if m > 0:
            self.d.stats.streams += 1
            seq = self.d.prompt + self.d.emitted + self.spec
            self.stream = asyncio.create_task(self._drafts(seq, m, self.gen))

    def send(self, x: int, timeout_s: float) -> None:
        self.sent = x
        drafts = self.spec[:x]
        self.call = asyncio.create_task(self._verify(list(self.d.emitted), drafts, timeout_s))

    def ready_to_send(self) -> bool:
        w = self.d.want
        return self.rule.ready(self.spec, self.budget(), not self.stream_done, w.eos, not w.ignore_eos)

    def drafts_to_send(self) -> int:
        w = self.d.want
        return self.rule.count(self.spec, self.budget(), w.eos, not w.ignore_eos)

    def on_drafts(self, ids: list[int]) -> None:
        self.d.stats.drafted += len(ids)
        if self.expect is not None:  # the stream's next token must be the one just verified
            if ids[0] != self.expect:
                self.expect = None
                self.start_stream()
                return
            ids, self.expect = ids[1:], None
        self.spec.extend(ids)

    def on_stream_end(self, error: BaseException | None) -> None:
        self.stream_done = True
        if error is not None:
            raise error
        if self.expect is not None:  # it ended on the verified path: go on from there
            self.expect = None
            self.start_stream()

    async def on_verdict(self, drafts: list[int], best: list[int], out: asyncio.Queue) -> None:
        """THE accept rule on the verifier's greedy tokens, then the emit rule; drafting goes on from there."""
        self.call = None
        n_t = verify(torch.tensor([drafts], dtype=torch.long).view(1, -1), torch.tensor([best]))
        n, t = int(n_t[0][0]), int(n_t[1][0])
        if not 0 <= n <= len(drafts):
            raise Fault(f"verdict accepted {n} of {len(drafts)} drafts")
        self.d.stats.verify_calls += 1
        self.d.stats.accepted.append(n)
        await self.d.deliver(drafts[:n] + [t], out)
        if self.d.done:
            return
        ahead = self.spec[self.sent :]  # drafted while the call was in flight
        self.spec.clear()
        if n == self.sent and ahead and ahead[0] == t:  # still on the verified path: keep drafting
            self.spec.extend(ahead[1:])
        elif n == self.sent and not ahead and not self.stream_done:  # so far: check its next draft
            self.expect = t
        else:  # a rejection, or nothing more to come: draft again from prompt + emitted
            self.start_stream()
        if self.stream_done and self.expect is None and self.budget() - 1 > len(self.spec) and not self.eos_ahead():
            self.start_stream()

    def stop(self) -> None:
        for task in (self.stream, self.call):
            if task is not None:
                task.cancel()

    # ---- the calls out: one verify call, one drafter stream; each puts its events on self.events ---------------
    async def _verify(self, emitted: list[int], drafts: list[int], timeout_s: float) -> None:
        d, server, stats = self.d, self.verifier, self.d.stats
        t0 = time.perf_counter()
        server.inflight += 1
        try:
            best = await d.up.verify(server, d.prompt + emitted, drafts, d.cfg.verify_api, timeout_s)
            if drafts:
                server.warm = True
                if stats.drafted_calls:  # a request's first call over drafts also brings its prompt's KV in
                    server.verified(time.perf_counter() - t0)  # (a load or a prefill): it says nothing of a queue
                stats.drafted_calls += 1
            await self.events.put(("verdict", drafts, best))
        except UpstreamError as e:
            await self.events.put(("fault", e))
        finally:
            server.inflight -= 1
            stats.verify_s += time.perf_counter() - t0

    async def _drafts(self, seq: list[int], m: int, gen: int) -> None:
        """One drafter stream: greedy, up to m tokens after seq, each chunk put on `events` as it comes."""
        w, cfg = self.d.want, self.d.cfg
        body = {"prompt": seq, "max_tokens": m, "temperature": 0.0, "ignore_eos": w.ignore_eos}
        try:
            async for ids, _ in self.d.up.stream(self.drafter, body, cfg.draft_first_s, cfg.draft_stall_s):
                if ids:
                    await self.events.put(("drafts", gen, ids))
            await self.events.put(("drafts-end", gen, None))
        except UpstreamError as e:
            await self.events.put(("drafts-end", gen, e))

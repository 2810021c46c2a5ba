"""Pre-drafts: drafting a request's continuation on its compressed copy while its full copy loads.

On a store hit the connector's worker posts the compressed copy with a pre-draft request (handoff.post) and a
`loaded` event it sets when the full copy is in vLLM's blocks. The Predrafter builds the copy's draft cache
(draft_caches.py) on the posting thread, then its one thread drafts every pre-drafting chain, all requests in
one batched step (DraftCaches.step with branching: chains.py), until the request's full copy lands, PREDRAFT_MAX
tokens are drafted or its cache is full. The steps never overlap vLLM's forward and yield to it
(pacing.TargetGate): while vLLM serves other requests the pre-draft waits. What it drafted is proposed once
the request runs (proposer.py); it stops there.
"""

from __future__ import annotations

import threading
import time

from vllm.logger import init_logger

from ....compressors import CompressedKV
from .chains import Chain
from .draft_caches import DraftCaches, draft_key
from .pacing import TargetGate

logger = init_logger("vllm.vericache")

PREDRAFT_MAX = 256  # a chain's pre-draft stops here even if the full copy has not landed


class Predrafter:
    def __init__(self, caches: DraftCaches, gate: TargetGate, stats: dict[str, int]):
        self.caches, self.gate, self.stats = caches, gate, stats
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def predraft(
        self, prompt: list[int], prefix_len: int, compressed: CompressedKV, loaded: threading.Event | None
    ) -> None:
        """Draft the prompt's continuation on its compressed copy until `loaded` is set."""
        caches = self.caches
        if caches.draft is None or (loaded is not None and loaded.is_set()):
            return  # the full copy is in already: vLLM's own steps come next, a pre-draft would only delay them
        key = draft_key(prompt, prefix_len)
        with caches.lock:
            if key in caches.building:
                return
            caches.building.add(key)  # (the request may run before the draft cache is built: match waits)
        chain = caches.build(key, prompt, prefix_len, compressed)
        if chain is None or (loaded is not None and loaded.is_set()):
            return  # built too late to pre-draft (a busy CPU): the draft cache stays for drafts after the load
        with caches.lock:
            chain.group.prompt_len, chain.group.loaded = len(prompt), loaded
            chain.group.predraft_t0 = time.perf_counter()
            chain.tokens, chain.predrafting = list(prompt), True
            self.stats["predrafts"] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="vericache-predraft", daemon=True)
                self._thread.start()
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            jobs = self._jobs()
            if not jobs:
                self._wake.clear()
                continue
            if self.gate.target_busy():  # vLLM is serving other requests: their steps go first
                time.sleep(0.005)
                continue
            try:
                with self.gate.draft():
                    jobs = self._jobs()
                    if jobs:
                        self.caches.step(jobs, branch=True)
            except Exception as e:  # noqa: BLE001 - drafts are optional; vLLM decodes without them
                logger.warning("VeriCache pre-draft failed (%s: %s); no pre-drafts", type(e).__name__, e)
                with self.caches.lock:
                    for c in jobs:
                        c.predrafting = False

    def _jobs(self) -> list[Chain]:
        """Chains still pre-drafting: their full copy not in yet, below PREDRAFT_MAX, room left."""
        with self.caches.lock:
            groups = self.caches.groups.values()
            for g in groups:
                going = [c for c in g.chains if c.predrafting]
                if not going:
                    continue
                if g.loaded is None or g.loaded.is_set():
                    for c in going:
                        c.predrafting = False
                    g.predraft_s = time.perf_counter() - g.predraft_t0
                    made = [len(c.tokens) - g.prompt_len for c in g.chains]
                    logger.info(
                        "VeriCache pre-draft: %d tokens drafted on the compressed copy of a %d-token prefix, in %d "
                        "chains (%s)",
                        sum(made),
                        g.prefix_len,
                        len(made),
                        ", ".join(map(str, made)),
                    )
                for c in going:
                    if len(c.tokens) - g.prompt_len >= PREDRAFT_MAX or not c.room:
                        c.predrafting = False
            return [c for g in groups for c in g.chains if c.predrafting]

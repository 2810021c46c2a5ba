"""The run of a serving step (ServingEngine.step: schedule -> run -> postprocess): what the scheduler's Batch asks
for, on the model runner (model_runner.py); the engine keeps the clock and what it measures around it.

  prefill       the prompt's forward layer by layer, each layer's KV placed as soon as it is done: full KV into
                the row's own blocks (full), or the compressed copy into the draft / packed pool by prompt_kv.py's
                rule (lossy, vericache) and, for VeriCache, the stored part into the host tier and the prompt's
                last partial block into the full pool (resident); then the first token, sampled.
  packed step   after the packed forward, each row's token: sampled (decode, draft) or by the accept rule of
                model/sampling.py (verify), and the exact KV of pending + the accepted drafts copied from the
                verify pass into the draft pool.
  failed reload the prompt's stored part recomputed into the row's staging blocks (exact KV; with a complement
                reload only the positions the draft pool lacks): the verification retries on it.
"""

from __future__ import annotations

import time

import torch

import vericache_kernels.paged_packed as PP

from ..model.sampling import sample, verify
from .config import ServingConfig
from .host_tier import HostEntry, to_host_blocks
from .model_runner import Batch, ModelRunner, Prefilled, Sampled, Segment
from .pools import PoolLayout
from .prompt_kv import PromptPlacer, gather
from .sequence import Sequence


class StepExecutor:
    """One serving run's pools (made by `layout`: pools.py) and model runner, with the engine's compressor rule
    (PromptPlacer) and prefill store (see ServingEngine)."""

    def __init__(
        self,
        cfg: ServingConfig,
        model,
        pools: dict,
        runner: ModelRunner,
        placer: PromptPlacer,
        layout: PoolLayout,
        prefill_store: dict | None = None,
    ):
        self.cfg, self.model, self.pools, self.runner = cfg, model, pools, runner
        self.placer, self.prefill_store = placer, prefill_store
        self.compressor, self.packed, self.complement = layout.compressor, layout.packed, layout.complement

    # ---- a prefill ----
    def prefill(self, seq: Sequence) -> tuple[Prefilled, float | None]:
        """The prompt's forward, layer by layer: full KV -> its own blocks (full), or -> the compressor and the
        draft pool (lossy, vericache) and the host tier + the resident tail (vericache). -> the result and the
        seconds VeriCache added to the forward in the layers' compression, packing and host copy (None for a
        full-KV row)."""
        full_row, bs, pools = seq.full_kv, self.cfg.block_size, self.pools
        stored = seq.prompt_len // bs * bs
        host = HostEntry([], [], stored, stored) if self.cfg.policy == "vericache" and not full_row else None
        pin = self.model.device.type == "cuda"
        draft_len = packed_len = 0
        added = 0.0  # seconds in the layers' compression, packing and host copy (what VeriCache adds)
        ids = seq.request.prompt_ids

        def on_layer(layer: int, k: torch.Tensor, v: torch.Tensor, obs: torch.Tensor | None) -> None:
            nonlocal draft_len, packed_len, added
            if full_row:
                full = pools["full"]
                full.write(layer, full.slots(seq.blocks["full"], 0, k.shape[1]), k.transpose(0, 1), v.transpose(0, 1))
                return
            t0 = time.perf_counter()
            side, dropped = self.placer.draft_side(ids, layer, k, v, obs)
            if side[0] == "packed":  # the codes into packed blocks, KIVI's residual into the draft pool
                packed_len = self._write_packed(seq, layer, side[1], side[2])
                ck, cv = side[1].get("k_tail"), side[1].get("v_tail")
            else:
                ck, cv = side[1], side[2]
            draft_len = 0 if ck is None else ck.shape[1]
            if draft_len:
                draft = pools["draft"]
                draft.write(
                    layer, draft.slots(seq.blocks["draft"], 0, draft_len), ck.transpose(0, 1), cv.transpose(0, 1)
                )
            if host is not None:  # the stored part (or what the draft pool lacks of it) to the host tier
                if dropped is None:
                    kb, vb = to_host_blocks(k, v, stored, bs, self.model.dtype, pin)
                else:
                    kb, vb = to_host_blocks(*gather(k, v, dropped), dropped.shape[1], bs, self.model.dtype, pin)
                    host.dropped.append(dropped.cpu())
                    host.tokens = dropped.shape[1]
                host.keys.append(kb)
                host.values.append(vb)
                full = pools["full"]  # the prompt's last partial block stays resident
                tail = full.slots(seq.blocks["full"], 0, seq.prompt_len - stored)
                full.write(layer, tail, k[:, stored:].transpose(0, 1), v[:, stored:].transpose(0, 1))
            added += time.perf_counter() - t0

        needs_queries = self.compressor is not None and self.compressor.needs_queries and not full_row
        logits = self.runner.prefill(ids, self.cfg.obs_window if needs_queries else 0, on_layer, self.prefill_store)
        if self.complement and not full_row:  # the draft view: [kept positions, the resident tail's blocks (shared)]
            draft_len += seq.prompt_len - stored
        first, _ = sample(logits[None], self.cfg.temperature, seq.generator)
        return Prefilled(int(first[0]), draft_len, host, packed_len), None if full_row else added

    def _write_packed(self, seq: Sequence, layer: int, t: dict, n: int) -> int:
        """One layer of a quantized prompt (its n quantized entries) into the row's packed blocks."""
        if n:
            codes = {name: x for name, x in t.items() if not name.endswith("_tail")}
            blocks = PP.to_blocks(self.packed, codes, n, self.cfg.block_size)
            self.pools["packed"].write_blocks(layer, seq.blocks["packed"][: blocks["k"].shape[0]], blocks)
        return n

    # ---- a packed step ----
    def tokens(self, batch: Batch, logits: dict, acceptance=None) -> dict[int, Sampled]:
        """Each row's token from the packed forward's logits ({id(seq): logits}): sampled (decode, draft) or by the
        accept rule (verify); acceptance(seq, k) -> accepted count replays recorded acceptance instead."""
        out = {}
        for seg in batch.segments:
            lg, seq = logits[id(seg.seq)], seg.seq
            if seg.kind != "verify":
                tok, q = sample(lg[-1:], self.cfg.temperature, seq.generator)
                out[id(seq)] = Sampled(int(tok[0]), None if q is None else q[0])
                continue
            k = len(seq.drafts)
            if acceptance is not None:  # replayed acceptance (a random-weight model)
                n, token = min(k, int(acceptance(seq, k))), None
                token = int(lg[n].argmax())
            else:
                d = torch.tensor([seq.drafts], device=lg.device, dtype=torch.long).view(1, k)
                q = torch.stack(seq.draft_probs)[None] if self.cfg.temperature > 0 and k else None
                nt, tt = verify(d, lg[None], self.cfg.temperature, q, seq.generator)
                n, token = int(nt[0]), int(tt[0])
            if not (self.complement or seq.moving):  # complement: drafts and the verify share the tail's blocks
                self._keep_exact(seg, n + 1)
            out[id(seq)] = Sampled(token, accepted=n)
        return out

    def _keep_exact(self, seg: Segment, keep: int) -> None:
        """The draft cache gets the exact KV of pending + the accepted drafts, from the verify pass."""
        seq, full, draft = seg.seq, self.pools["full"], self.pools["draft"]
        src = full.slots(seg.view, seq.full_len, keep)
        dst = draft.slots(seq.blocks["draft"], seq.draft_len - len(seq.drafts), keep)
        bs = full.block_size
        for layer in range(len(full.caches)):
            kc, vc = full.caches[layer]
            draft.write(layer, dst, kc[src // bs, :, :, src % bs], vc[src // bs, :, src % bs])

    # ---- a failed reload ----
    def recompute_full(self, seq: Sequence) -> None:
        """The reload failed: recompute the prompt's stored part into the staging blocks (exact KV; with a
        complement reload only the positions the draft pool lacks)."""
        full, dropped = self.pools["full"], seq.host.dropped

        def into_staging(layer: int, k: torch.Tensor, v: torch.Tensor, obs) -> None:
            if dropped:
                k, v = gather(k, v, dropped[layer].to(k.device))
            full.write(layer, full.slots(seq.staging, 0, k.shape[1]), k.transpose(0, 1), v.transpose(0, 1))

        self.runner.prefill(seq.request.prompt_ids[: seq.stored_prompt], 0, into_staging)
        seq.reload = _Ready()


class _Ready:
    """A reload that needs no waiting (its KV was recomputed in place)."""

    done = prefetched = True
    error = None

    def wait_layer(self, layer: int) -> float:
        return 0.0

    def consume(self, layer: int) -> None:
        return None

"""The host tier: each VeriCache request's full prompt KV in host memory, reloaded over the host link into
device staging blocks just for its verifications.

HostEntry keeps the prompt's whole blocks in the device pool's block layout (keys [n, H, D, bs], values
[n, H, bs, D] per layer), so a reload is a plain block copy. The tail of the prompt that does not fill a
block stays resident on the device with the emitted tokens (the sequence's own full-pool blocks).

Link moves one reload at a time, layer by layer, on its own thread, and sets an event per layer so the
verify forward can start on layer 0 while later layers are still coming. Staging is a ring of `ring`
layers per reload: the copy of layer l waits until the verify forward has consumed layer l - ring, so at
most `ring` layers of a prompt are staged at once and the budget counts that many (on the CPU the staging
blocks exist for every layer, as the pool's layout has them; the ring's flow control is what is real):
  CUDA  host tensors pinned, copies with non_blocking=True on a side stream, a CUDA event per layer
        (the compute stream waits on it), the PCIe / C2C rate is the hardware's;
  CPU   host memory behind an EMULATED link: the copy is real, then the thread sleeps until the bytes
        moved so far match `bytes_per_s` (a proxy for the GPU's host link, stated in every report).
A reload that fails (a test can inject it) sets every event and its `error`; the caller recomputes.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from .block_manager import KVPool

Tensor = torch.Tensor


@dataclass
class HostEntry:
    keys: list[Tensor]  # per layer [n_blocks, H, D, bs]
    values: list[Tensor]  # per layer [n_blocks, H, bs, D]
    tokens: int  # entries held: n_blocks * bs
    stored: int = 0  # the prompt's whole blocks (tokens, or more with a complement reload)
    dropped: list[Tensor] = field(default_factory=list)  # complement reload: per layer the positions held [H, n]

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes + v.nbytes for k, v in zip(self.keys, self.values))


def to_host_blocks(
    k: Tensor, v: Tensor, tokens: int, block_size: int, dtype: torch.dtype, pin: bool
) -> tuple[Tensor, Tensor]:
    """One layer's first `tokens` (a multiple of block_size) of [H, T, D] keys/values, as host blocks."""
    h, _, d = k.shape
    nb = tokens // block_size
    kb = k[:, :tokens].reshape(h, nb, block_size, d).permute(1, 0, 3, 2).to("cpu", dtype).contiguous()
    vb = v[:, :tokens].reshape(h, nb, block_size, d).permute(1, 0, 2, 3).to("cpu", dtype).contiguous()
    return (kb.pin_memory(), vb.pin_memory()) if pin else (kb, vb)


class ReloadFailed(RuntimeError):
    pass


@dataclass
class Reload:
    """One prompt's full KV moving into staging blocks; layer l usable once layer_ready[l] is set."""

    entry: HostEntry
    pool: KVPool
    staging: list[int]
    ring: int = 1 << 30  # layers staged at most at once
    layer_ready: list[threading.Event] = field(default_factory=list)
    consumed: int = 0  # layers the verify forward is done with
    cond: threading.Condition = field(default_factory=threading.Condition)
    cuda_events: list = field(default_factory=list)
    error: BaseException | None = None
    submitted_s: float = 0.0
    paused_s: float = 0.0  # the link idle, waiting for a ring slot
    started_s: float | None = None
    finished_s: float | None = None

    @property
    def done(self) -> bool:
        return self.layer_ready[-1].is_set()

    @property
    def prefetched(self) -> bool:
        """The ring is full (or the reload is done): a verify forward can start without waiting on layer 0..ring-1."""
        return self.layer_ready[min(self.ring, len(self.layer_ready)) - 1].is_set()

    def consume(self, layer: int) -> None:
        """The verify forward is done with `layer`: its ring slot may take layer + ring."""
        with self.cond:
            self.consumed = max(self.consumed, layer + 1)
            self.cond.notify_all()

    def _wait_slot(self, layer: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.consumed >= layer - self.ring + 1)

    @property
    def nbytes(self) -> int:
        return self.entry.nbytes

    def wait_layer(self, layer: int) -> float:
        """Block until `layer` has arrived (or the reload failed); the seconds waited."""
        t = time.perf_counter()
        self.layer_ready[layer].wait()
        if self.error is not None:
            raise ReloadFailed(str(self.error)) from self.error
        if self.cuda_events:
            torch.cuda.current_stream().wait_event(self.cuda_events[layer])
        return time.perf_counter() - t


class Link:
    """The host -> device link: a FIFO of reloads served one at a time by a copy thread."""

    def __init__(self, bytes_per_s: float | None, device: torch.device | str = "cpu"):
        if bytes_per_s is not None and not bytes_per_s > 0:
            raise ValueError(f"link rate must be > 0 bytes/s or None, got {bytes_per_s}")
        self.rate, self.device = bytes_per_s, torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self.busy_s, self.bytes_moved, self.transfers = 0.0, 0, 0
        self.active = 0  # reloads on the wire now (the plan allows one)
        self.max_active = 0
        self.fail_next = 0  # tests: the next n reloads fail
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None

    def submit(self, entry: HostEntry, pool: KVPool, staging: list[int], ring: int | None = None) -> Reload:
        layers = len(entry.keys)
        r = Reload(
            entry,
            pool,
            staging,
            min(ring or layers, layers),
            [threading.Event() for _ in entry.keys],
            submitted_s=time.perf_counter(),
        )
        if self._thread is None:
            self._thread = threading.Thread(target=self._serve, name="vericache-link", daemon=True)
            self._thread.start()
        self._queue.put(r)
        return r

    def close(self) -> None:
        """Stop the copy thread once the reloads queued before are done (a later submit starts a new one)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(30)
            self._thread = None

    @torch.inference_mode()  # the pools are inference tensors (made under the engine's inference mode)
    def _serve(self) -> None:
        while (r := self._queue.get()) is not None:
            self.active += 1
            self.max_active = max(self.max_active, self.active)
            try:
                self._move(r)
            except BaseException as e:  # noqa: BLE001 - handed to the waiting verify step
                r.error = e
            finally:
                r.finished_s = time.perf_counter()
                self.busy_s += r.finished_s - r.started_s - r.paused_s
                self.active -= 1
                for ev in r.layer_ready:
                    ev.set()

    def _move(self, r: Reload) -> None:
        r.started_s, moved = time.perf_counter(), 0
        if self.fail_next > 0:
            self.fail_next -= 1
            raise ReloadFailed("injected reload failure")
        paused = 0.0
        for layer, (k, v) in enumerate(zip(r.entry.keys, r.entry.values)):
            if layer >= r.ring:  # the ring is full: wait for the forward to free a slot
                t = time.perf_counter()
                r._wait_slot(layer)
                paused += time.perf_counter() - t
            if self.cuda:
                with torch.cuda.stream(self.stream):
                    r.pool.copy_blocks(layer, r.staging, k, v)
                    ev = torch.cuda.Event()
                    ev.record(self.stream)
                r.cuda_events.append(ev)
            else:
                r.pool.copy_blocks(layer, r.staging, k, v)
            moved += k.nbytes + v.nbytes
            if self.rate is not None:  # emulated link: pace to the rate (on CUDA: an extra cap)
                lag = moved / self.rate - (time.perf_counter() - r.started_s)
                if lag > 0:
                    time.sleep(lag)
            if self.cuda:
                r.cuda_events[-1].synchronize()
            r.layer_ready[layer].set()
        r.paused_s = paused
        self.bytes_moved += moved
        self.transfers += 1

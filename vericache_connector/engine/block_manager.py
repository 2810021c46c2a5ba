"""Paged KV pools and the device budget (nano-vllm's block manager, with a byte cap across pools).

A KVPool holds the KV of every layer in one storage dtype, in fixed-size blocks of vLLM's CPU layout
(vericache_kernels.paged: keys [blocks, H_kv, D, bs], values [blocks, H_kv, bs, D]); a sequence owns a list
of block ids per pool, and token j of its view sits in block ids[j // bs] at offset j % bs.

The BlockManager is the device budget: every allocated block of every pool, plus transient holds (a
prefill's KV before it moves to the host tier), counts against one byte cap; an allocation that would
pass it raises BudgetExceeded. Pools are sized so that each could take the whole budget; the cap, not
the tensors' size, decides what fits. On the CPU this byte cap is how the GPU's memory limit is emulated. A
pool is made for the requests known when serving starts and grows (BlockManager.allocate) when a request added
later needs more blocks than it has while the budget allows them; the host link's copy thread writes into a pool
under its lock, so a growing pool never loses a copy.
"""

from __future__ import annotations

import math
import threading

import torch

import vericache_kernels.paged as PA
import vericache_kernels.paged_packed as PP

Tensor = torch.Tensor


class BudgetExceeded(RuntimeError):
    """An allocation would pass the device budget."""


class KVPool:
    def __init__(
        self,
        name: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        kv_dtype: str,
        num_blocks: int,
        device: torch.device | str = "cpu",
    ):
        PA.check_kv_dtype(kv_dtype)
        if kv_dtype in PA.FP8:
            raise ValueError(f"KV pools hold float dtypes, got {kv_dtype!r}")
        if num_blocks < 1:
            raise ValueError(f"pool {name!r}: num_blocks must be >= 1, got {num_blocks}")
        self.name, self.kv_dtype, self.block_size = name, kv_dtype, block_size
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype = PA.FLOATS[kv_dtype]
        self.caches = [
            PA.new_paged_cache(num_blocks, num_kv_heads, head_dim, block_size, kv_dtype, device)
            for _ in range(num_layers)
        ]
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.block_bytes = num_layers * 2 * num_kv_heads * head_dim * block_size * self.dtype.itemsize
        self.lock = threading.Lock()  # the link's copy thread writes under it (copy_blocks); grow swaps under it

    @property
    def num_blocks(self) -> int:
        return self.caches[0][0].shape[0]

    def grow(self, extra: int) -> None:
        """extra more (zeroed) blocks in every layer; block ids and their contents stay."""
        with self.lock:
            if self.caches[0][0].is_cuda:
                torch.cuda.synchronize()  # copies the link queued on its stream land before the swap
            n = self.num_blocks
            for i, kv in enumerate(self.caches):  # a layer at a time: one layer's copy more at once
                self.caches[i] = tuple(torch.cat([x, x.new_zeros((extra, *x.shape[1:]))]) for x in kv)
            self.free_blocks[:0] = range(n + extra - 1, n - 1, -1)

    @staticmethod
    def blocks_for(tokens: int, block_size: int) -> int:
        return math.ceil(tokens / block_size)

    def slots(self, block_ids: list[int] | Tensor, start: int, n: int) -> Tensor:
        """Slots (block * bs + offset) of entries start .. start + n of a view over block_ids."""
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=self.caches[0][0].device)
        pos = torch.arange(start, start + n, device=ids.device)
        if n and int(pos[-1]) // self.block_size >= len(ids):
            raise ValueError(f"pool {self.name!r}: entry {int(pos[-1])} is past {len(ids)} blocks")
        return ids[pos // self.block_size] * self.block_size + pos % self.block_size

    def write(self, layer: int, slots: Tensor, k: Tensor, v: Tensor) -> None:
        """k, v [n, H_kv, D] at slots [n]."""
        kc, vc = self.caches[layer]
        PA.paged_write(kc, vc, k, v, slots, self.kv_dtype)

    def gather(self, layer: int, block_ids: list[int], n: int) -> tuple[Tensor, Tensor]:
        """The first n entries of a view over block_ids as float32 [H_kv, n, D] keys, values."""
        kc, vc = self.caches[layer]
        table = torch.as_tensor([block_ids], dtype=torch.int32, device=kc.device)
        return PA.paged_gather(kc, vc, table, 0, n, self.kv_dtype)

    def copy_blocks(self, layer: int, dst: list[int], src_k: Tensor, src_v: Tensor) -> None:
        """Whole blocks in this pool's layout ([n, H, D, bs] keys, [n, H, bs, D] values) into blocks dst."""
        with self.lock:
            kc, vc = self.caches[layer]
            ids = torch.as_tensor(dst, dtype=torch.long, device=kc.device)
            kc.index_copy_(0, ids, src_k.to(kc.device, non_blocking=True))
            vc.index_copy_(0, ids, src_v.to(vc.device, non_blocking=True))


class PackedPool:
    """Blocks of packed KV (vericache_kernels.paged_packed's layout: a quantizer's codes and scales as it made
    them, one dict of tensors per layer): the prompt part of a quantized draft cache, never decoded in memory.
    Same block interface as KVPool for the BlockManager; block_bytes counts the packed bytes."""

    def __init__(
        self,
        name: str,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        fmt: PP.PackedFormat,
        num_blocks: int,
        device: torch.device | str = "cpu",
    ):
        if num_blocks < 1:
            raise ValueError(f"pool {name!r}: num_blocks must be >= 1, got {num_blocks}")
        self.name, self.fmt, self.block_size, self.num_layers = name, fmt, block_size, num_layers
        self.caches = [
            PP.new_packed_cache(fmt, num_blocks, num_kv_heads, head_dim, block_size, device) for _ in range(num_layers)
        ]
        self.free_blocks = list(range(num_blocks - 1, -1, -1))
        self.block_bytes = num_layers * fmt.block_bytes(num_kv_heads, head_dim, block_size)

    @property
    def num_blocks(self) -> int:
        return next(iter(self.caches[0].values())).shape[0]

    def grow(self, extra: int) -> None:
        """extra more (zeroed) blocks in every layer (only the engine's thread writes packed blocks)."""
        n = self.num_blocks
        self.caches = [
            {k: torch.cat([x, x.new_zeros((extra, *x.shape[1:]))]) for k, x in c.items()} for c in self.caches
        ]
        self.free_blocks[:0] = range(n + extra - 1, n - 1, -1)

    def write_blocks(self, layer: int, block_ids: list[int], blocks: dict[str, Tensor]) -> None:
        """Whole blocks (vericache_kernels.paged_packed.to_blocks) into block_ids."""
        PP.packed_write(self.caches[layer], block_ids, blocks)


class BlockManager:
    """Block allocation in every pool under one device byte budget (None: no cap)."""

    def __init__(self, pools: dict[str, KVPool], budget_bytes: int | None):
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be > 0 or None, got {budget_bytes}")
        self.pools, self.budget = pools, budget_bytes
        self.used = self.held = self.peak = 0

    @property
    def resident(self) -> int:
        """Bytes on the device now: allocated blocks plus transient holds."""
        return self.used + self.held

    def cost(self, need: dict[str, int]) -> int:
        """Bytes of {pool: blocks}."""
        return sum(self.pools[p].block_bytes * n for p, n in need.items())

    def fits(self, extra_bytes: int) -> bool:
        return self.budget is None or self.resident + extra_bytes <= self.budget

    def block_cost(self, pool: str, n: int, layers: int | None = None) -> int:
        """Bytes of n blocks of `pool`, or of `layers` of their layers (a staging ring)."""
        p = self.pools[pool]
        return n * p.block_bytes if layers is None else n * p.block_bytes * layers // p.num_layers

    def allocate(self, pool: str, n: int, layers: int | None = None) -> list[int]:
        """n blocks of `pool`; layers: only that many of their layers are live at once (staging ring). A pool
        with fewer free blocks than the budget allows grows (by a quarter at least)."""
        p, nbytes = self.pools[pool], self.block_cost(pool, n, layers)
        if n > len(p.free_blocks) and self.fits(nbytes):
            p.grow(max(n - len(p.free_blocks), p.num_blocks // 4))
        if not self.fits(nbytes):
            raise BudgetExceeded(
                f"{n} blocks of pool {pool!r} ({nbytes} bytes) do not fit: "
                f"{self.resident} of {self.budget} bytes in use, {len(p.free_blocks)} blocks free"
            )
        ids = [p.free_blocks.pop() for _ in range(n)]
        self.used += nbytes
        self.peak = max(self.peak, self.resident)
        return ids

    def grow(self, pool: str, n: int, layers: int) -> None:
        """n blocks allocated with `layers` live layers (a staging ring) now hold every layer: charge the rest."""
        extra = self.block_cost(pool, n) - self.block_cost(pool, n, layers)
        if not self.fits(extra):
            raise BudgetExceeded(f"{extra} more bytes of pool {pool!r} do not fit: {self.resident} of {self.budget}")
        self.used += extra
        self.peak = max(self.peak, self.resident)

    def free(self, pool: str, ids: list[int], layers: int | None = None) -> None:
        p = self.pools[pool]
        p.free_blocks.extend(reversed(ids))
        self.used -= self.block_cost(pool, len(ids), layers)

    def hold(self, nbytes: int) -> None:
        """Count a transient device tensor (e.g. a prefill's full KV) against the budget."""
        if not self.fits(nbytes):
            raise BudgetExceeded(f"a transient {nbytes} bytes do not fit: {self.resident} of {self.budget} in use")
        self.held += nbytes
        self.peak = max(self.peak, self.resident)

    def release(self, nbytes: int) -> None:
        self.held -= nbytes

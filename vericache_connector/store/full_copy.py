"""The full copy of a stored prefix, streamed layer by layer into whatever holds it.

Both readers of full copies use this one loop: the engine's RemotePrefixCache (into its KVCache) and
the vLLM connector's worker (into vLLM's paged blocks). A layer that does not arrive within `stall_s`
counts as a dropped stream; a layer out of order, of the wrong shape, or a copy with the wrong number
of layers is a StoreError. The caller decides what a failure means (recompute, report the blocks).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Callable, Sequence

import torch

from storage_backends import CorruptObject, DualCopyStore, StoreUnavailable

OnLayer = Callable[[int, torch.Tensor, torch.Tensor], None]


async def stream_full_copy(
    store: DualCopyStore,
    prefix: Sequence[int],
    num_layers: int,
    stall_s: float,
    on_layer: OnLayer,
    shape: tuple[int, ...] | None = None,
) -> int:
    """Call on_layer(layer, k, v) for every layer of prefix's full copy, k/v [H_kv, len(prefix), D],
    as each arrives; returns the bytes received. shape: the [H_kv, T, D] every layer must have."""
    got, nbytes = 0, 0
    async with contextlib.aclosing(store.stream_full(prefix)) as layers:
        while True:
            try:
                layer, k, v = await asyncio.wait_for(anext(layers), stall_s)
            except StopAsyncIteration:
                break
            except asyncio.TimeoutError:
                raise StoreUnavailable(f"full copy stream stalled for {stall_s}s at layer {got}") from None
            if layer != got or layer >= num_layers:
                raise CorruptObject(f"full copy sent layer {layer}, expected {got} of {num_layers}")
            if shape is not None and (tuple(k.shape) != tuple(shape) or tuple(v.shape) != tuple(shape)):
                raise CorruptObject(
                    f"full copy layer {layer} is {tuple(k.shape)}/{tuple(v.shape)}, expected {tuple(shape)}"
                )
            on_layer(layer, k, v)
            nbytes += k.nbytes + v.nbytes
            got += 1
    if got != num_layers:
        raise CorruptObject(f"full copy has {got} layers, the model {num_layers}")
    return nbytes

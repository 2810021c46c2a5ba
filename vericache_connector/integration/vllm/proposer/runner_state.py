"""What the proposer reads of vLLM's model runner: each layer's paged KV and each running request's blocks.

vLLM hands a custom_class proposer only token rows (propose) and the served model (load_model). Drafting on a
view of a request's own KV needs two more things the runner holds: the paged KV tensors (`runner.kv_caches`,
one per attention layer in layer order, bound after load_model) and the block table (`runner.input_batch`:
per batch index the request id and its block ids). The runner is the object that calls load_model
(`CPUModelRunner.load_model` -> `self.drafter.load_model(self.model)`, GPUModelRunner alike): RunnerState
finds it among the caller's frames once, and reads it at every propose, after vLLM's bookkeeping of the step.
Where it is not found, or lays its KV out otherwise (several KV cache groups, a kernel block size other than
the manager's), there is no self-drafting and the proposer drafts as before.
"""

from __future__ import annotations

import sys

import torch

Tensor = torch.Tensor


class UnsupportedRunner(ValueError):
    """vLLM's model runner is not laid out as RunnerState reads it."""


class RunnerState:
    def __init__(self, runner):
        self.runner = runner
        try:
            tables = runner.input_batch.block_table.block_tables
            _ = runner.input_batch.req_ids, runner.kv_caches
        except AttributeError as e:
            raise UnsupportedRunner(f"{type(runner).__name__} has no block table / KV caches ({e})") from None
        if len(tables) != 1:
            raise UnsupportedRunner(f"{len(tables)} KV cache groups (one full-attention group is drafted)")
        self.table = tables[0]

    @classmethod
    def of_caller(cls, depth: int = 6) -> RunnerState | None:
        """The model runner among the frames that called the caller (load_model's), else None."""
        frame = sys._getframe(2)
        for _ in range(depth):
            if frame is None:
                return None
            runner = frame.f_locals.get("self")
            if runner is not None and hasattr(runner, "input_batch") and hasattr(runner, "kv_caches"):
                return cls(runner)
            frame = frame.f_back
        return None

    def layers(self) -> list[Tensor]:
        """vLLM's paged KV per attention layer, in layer order ([blocks, H_kv, block_size, 2 D] on the CPU)."""
        caches = self.runner.kv_caches
        if not caches:
            raise UnsupportedRunner("the KV cache is not allocated yet")
        if caches[0].shape[2] != self.table.block_size:
            raise UnsupportedRunner(
                f"kernel block size {caches[0].shape[2]} differs from the block table's {self.table.block_size}"
            )
        return caches

    @property
    def block_size(self) -> int:
        return int(self.table.block_size)

    def req_id(self, index: int) -> str | None:
        ids = self.runner.input_batch.req_ids
        return ids[index] if index < len(ids) else None

    def blocks(self, indices: list[int]) -> Tensor:
        """int32 [len(indices), max blocks]: each batch index's block ids (padded with its last block)."""
        n = self.table.num_blocks_per_row[indices]
        width = int(n.max()) if len(indices) else 0
        rows = torch.from_numpy(self.table.block_table.np[indices, :width].copy())
        for r, count in enumerate(n.tolist()):
            rows[r, count:] = rows[r, max(count - 1, 0)]
        return rows

    def num_blocks(self, indices: list[int]) -> list[int]:
        return [int(x) for x in self.table.num_blocks_per_row[indices]]

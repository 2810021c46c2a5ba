"""moves.FullKVMoves.move_rows on its own (no model, no clock): while the guard says VeriCache loses, the row of
the lowest acceptance goes on on its full KV; where its full KV does not fit, rows of a higher acceptance are
paused (highest first) until it does, and none is paused where even that would not make it fit."""

from __future__ import annotations

from types import SimpleNamespace

from vericache_connector.engine.moves import FullKVMoves
from vericache_connector.engine.sequence import Phase, Request, Sequence

BLOCK = 100  # bytes a block costs
STAGING = 4 * BLOCK  # a row's whole full KV (what a move stages)


class Blocks:
    def __init__(self, free_blocks: int):
        self.free_bytes = free_blocks * BLOCK

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.free_bytes

    def free(self, pool: str, ids: list[int]) -> None:
        self.free_bytes += len(ids) * BLOCK


def sched(free_blocks: int, alphas: list[float]):
    rows = []
    for i, a in enumerate(alphas):
        seq = Sequence(Request(f"r{i}", [1, 2, 3], 8), phase=Phase.DECODING, alpha=a)
        seq.blocks = {"draft": [10 * i, 10 * i + 1], "full": [10 * i + 2]}  # 2 compressed blocks
        seq.drafts = [5]
        rows.append(seq)
    started = []
    s = SimpleNamespace(
        complement=False,
        running=list(rows),
        paused=[],
        plans={},
        step=7,
        num_layers=8,
        cfg=SimpleNamespace(alpha_prior=0.5),
        blocks=Blocks(free_blocks),
        sizes=SimpleNamespace(staging_bytes=lambda seq: STAGING, cost=lambda counts: sum(counts.values()) * BLOCK),
        rings=SimpleNamespace(peak_memory=lambda step: 0, release=lambda rid: None),
        fits_full=lambda seq: True,
        start_reload=lambda seq, ring: started.append((seq.request_id, ring)) or True,
    )
    return s, rows, started


def test_the_lowest_acceptance_row_moves_and_higher_ones_pause_to_make_room():
    s, (low, mid, high), started = sched(free_blocks=1, alphas=[0.3, 0.6, 0.9])
    FullKVMoves(s).move_rows()
    # 1 free block + 2 (high paused) = 3 < 4; + 2 (mid paused) = 5 >= 4: both paused, highest first
    assert s.paused == [high, mid] and all(q.phase is Phase.PAUSED and "draft" not in q.blocks for q in s.paused)
    assert s.running == [low] and low.moving and low.horizon == 1 and low.verify_step == 7
    assert started == [("r0", 8)]  # its prompt reloaded for every layer
    assert s.blocks.free_bytes == 5 * BLOCK


def test_no_row_pauses_where_the_move_fits_or_cannot_be_made_to():
    s, rows, started = sched(free_blocks=4, alphas=[0.9, 0.2, 0.5])
    FullKVMoves(s).move_rows()
    assert s.paused == [] and started == [("r1", 8)] and rows[1].moving  # fits as it is: lowest acceptance moves
    s, rows, started = sched(free_blocks=0, alphas=[0.3, 0.6])
    FullKVMoves(s).move_rows()  # 0 + 2 (the other row paused) < 4: nothing is paused for a move that cannot be
    assert s.paused == [] and started == [] and not any(q.moving for q in rows)


def test_a_paused_row_resumes_on_full_kv_when_it_fits():
    s, (low, high), started = sched(free_blocks=1, alphas=[0.3, 0.9])
    s.running.remove(high)
    high.blocks.pop("draft")
    s.paused.append(high)
    s.blocks.free_bytes = 0
    FullKVMoves(s).move_rows()
    assert started == []  # neither fits (the paused row frees nothing more)
    s.running.remove(low)  # the moved row finished: its blocks went back
    s.blocks.free_bytes = 4 * BLOCK
    FullKVMoves(s).move_rows()
    assert started == [("r1", 8)] and s.running == [high] and s.paused == [] and high.moving

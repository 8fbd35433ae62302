"""Layer groups: sliding-window layers keep only their window's blocks, and a prefix hit needs
only the window before it (exact block ids, on tiny pools)."""

from __future__ import annotations

import pytest

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.groups import LayerGroups, group_key
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix import make_extra_key
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

GEMMA3_270M = tuple(None if (i + 1) % 6 == 0 else 512 for i in range(18))


def make(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=64), arrival_seq=0)


def test_gemma3_groups() -> None:
    groups = LayerGroups.of(GEMMA3_270M)
    assert groups.num_slots == 3
    assert [(g.layers, g.window) for g in groups.groups] == [
        ((5, 11, 17), None), ((0, 1, 2), 512), ((3, 4, 6), 512), ((7, 8, 9), 512), ((10, 12, 13), 512),
        ((14, 15, 16), 512)]
    assert groups.group_of_layer[:7] == (1, 1, 1, 2, 2, 0, 2) and groups.slot_of_layer[:7] == (0, 1, 2, 0, 1, 0, 2)
    assert (groups.layers_of_kind("full"), groups.layers_of_kind("sliding")) == (3, 15)


def test_one_kind_is_one_group_and_uneven_kinds_leave_slots_unused() -> None:
    single = LayerGroups.of([None] * 30)
    assert single.is_single and single.num_slots == 30 and single.groups[0].layers == tuple(range(30))
    # Gemma 3 1B: 26 layers, 4 full; the sliding ones in groups of 4, the last of 2
    uneven = LayerGroups.of([None if (i + 1) % 6 == 0 else 512 for i in range(26)])
    assert uneven.num_slots == 4 and [len(g.layers) for g in uneven.groups] == [4, 4, 4, 4, 4, 4, 2]


def test_group_keys() -> None:
    key = bytes(range(32))
    assert group_key(key, 0) == key
    assert len({group_key(key, g) for g in range(6)}) == 6 and len(group_key(key, 3)) == 32


def manager(num_blocks: int, windows: tuple[int | None, ...] = (None, 8, 8), chunk: int = 4) -> KVCacheManager:
    """Three layers: one full, two sliding over 8 positions, a layer per group; blocks of 4."""
    return KVCacheManager(BlockPool(num_blocks, 4), make_extra_key("m", "native"), groups=LayerGroups.of(windows),
                          max_chunk_tokens=chunk)


def step(kv: KVCacheManager, req: Request, n: int) -> None:
    assert kv.try_allocate(req, n)
    req.num_computed_tokens += n
    kv.cache_computed_blocks(req)


def test_sliding_blocks_leave_as_the_window_moves() -> None:
    kv = manager(num_blocks=30)
    req = make("a", list(range(30)))
    assert kv.try_allocate(req, 4)                     # tokens 0-3: a block in each group
    assert [kv.block_ids("a", g) for g in range(3)] == [[0], [1], [2]]
    req.num_computed_tokens = 4
    kv.cache_computed_blocks(req)
    for _ in range(2):
        step(kv, req, 4)                               # tokens 4-11
    # next query at 12 sees 5..12: block 0 (tokens 0-3) left both sliding groups
    assert kv.block_ids("a", 0) == [0, 3, 6]
    assert kv.block_ids("a", 1) == [0, 4, 7] and kv.block_ids("a", 2) == [0, 5, 8]   # entry 0 released (reads 0)
    assert [kv._pool.blocks[i].ref_count for i in (1, 2)] == [0, 0] and kv._pool.blocks[1].is_cached
    for _ in range(4):
        step(kv, req, 4)                               # up to 28 tokens: next query at 28 sees 21..28
    assert kv.block_ids("a", 0) == [0, 3, 6, 9, 12, 15, 18]
    held = [b for g in (1, 2) for b in kv.block_ids("a", g) if b]
    assert held == [16, 19, 17, 20]                    # blocks 5 and 6 of each sliding group: 20..27
    assert kv.num_free_blocks == 30 - 7 - 4
    kv.check_integrity()
    kv.free(req)
    assert kv.num_free_blocks == 30
    kv.check_integrity()


def finished_conversation(kv: KVCacheManager) -> None:
    """A request of 24 computed tokens (blocks 0-5 in every group), run to its end and freed."""
    a = make("a", list(range(24)) + [99])
    for _ in range(6):
        step(kv, a, 4)
    kv.free(a)


def test_a_hit_needs_the_window_before_it_only() -> None:
    kv = manager(num_blocks=40)
    finished_conversation(kv)
    # b shares 24 tokens: a hit at block 6 (position 24) needs blocks 4, 5 of the sliding groups
    # (a query at 24 sees 17..24), which a released last, and every full block
    b = make("b", list(range(24)) + [7, 7])
    match = kv.match_prefix(b)
    assert match.num_device_blocks == 6
    assert [x.block_id for x in match.group_blocks[0] if x] == [0, 3, 6, 9, 12, 15]
    assert [None if x is None else x.block_id for x in match.group_blocks[1]] == [None] * 4 + [13, 16]
    assert kv.try_allocate(b, 2, match)
    assert kv.block_ids("b", 1) == [0, 0, 0, 0, 13, 16, 19] and kv.block_ids("b", 0)[:6] == [0, 3, 6, 9, 12, 15]
    kv.check_integrity()


def test_a_prefix_loses_its_interior_sliding_blocks_first_and_its_tail_hit_last() -> None:
    kv = manager(num_blocks=40)
    finished_conversation(kv)
    b = make("b", list(range(24)) + [7, 7])
    # 22 never-used blocks go first, then the 8 interior sliding blocks a released on the way
    taken = kv.allocate_unowned(30)
    assert sorted(x.block_id for x in taken[22:]) == [1, 2, 4, 5, 7, 8, 10, 11]
    assert kv.match_prefix(b).num_device_blocks == 6          # the hit at the end holds
    kv._pool.free(taken)
    taken = kv.allocate_unowned(33)        # then a's tail goes (tail first): the full and sliding blocks of 5
    assert {x.block_id for x in taken} >= {15, 16, 17}
    # the full blocks 0-4 remain, but no position's window does: no hit
    assert kv._pool.lookup(kv.block_keys(b)[4], tuple(range(16, 20))) is not None
    assert kv.match_prefix(b).num_device_blocks == 0
    kv._pool.free(taken)
    kv.check_integrity()


def test_check_fits_counts_windows_not_whole_contexts() -> None:
    kv = manager(num_blocks=20)
    # 40 tokens: 10 full blocks; each sliding group at most its window and a chunk (8 + 4 tokens), + 1
    assert kv.max_blocks_held(40) == 10 + 2 * 4
    kv.check_fits(SamplingParams(max_tokens=1), 39, 1)          # 18 blocks (every layer whole: 30)
    with pytest.raises(ValueError, match="needs up to 26 KV blocks"):
        kv.check_fits(SamplingParams(max_tokens=30), 40, 30)


def test_the_most_tokens_one_request_holds_agrees_with_check_fits() -> None:
    """``max_request_tokens`` is the largest n whose ``max_blocks_held`` the pool has; ``check_fits``
    accepts exactly the requests up to it. Sliding groups hold their window and a chunk, so past
    that a request's tokens cost the full group only."""
    for windows, num_blocks in (((None,), 10), ((None, 8, 8), 30), ((None, 8, 8), 12)):
        kv = manager(num_blocks, windows)
        n = kv.max_request_tokens(1000)
        assert kv.max_blocks_held(n) <= num_blocks < kv.max_blocks_held(n + 1)
        kv.check_fits(SamplingParams(max_tokens=None), 1, n - 1)
        with pytest.raises(ValueError, match="needs up to"):
            kv.check_fits(SamplingParams(max_tokens=None), 1, n)
        assert kv.max_request_tokens(n - 5) == n - 5                       # a limit under it is kept
    assert manager(10, (None,)).max_request_tokens(1000) == 40             # 10 blocks of 4
    # full group 18 blocks (72 tokens); the sliding ones 4 each (a window of 8 + a chunk of 4, + 1)
    assert manager(30, (None, 8, 8)).max_request_tokens(1000) == 88

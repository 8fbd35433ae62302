from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.block_pool import BlockPool, NoFreeBlocksError
from kvserve.kv.prefix import block_key, make_extra_key

EXTRA = make_extra_key("model", "native")


def key(i: int) -> bytes:
    return block_key(None, [i] * 4, EXTRA)


def test_allocate_takes_lowest_ids_first_and_free_appends_to_tail():
    pool = BlockPool(11, 4)
    a = pool.allocate(3)
    assert [b.block_id for b in a] == [0, 1, 2]
    assert pool.free_queue.block_ids() == list(range(3, 11))
    pool.cache(a[0], key(0), (0, 0, 0, 0))
    pool.cache(a[1], key(1), (1, 1, 1, 1))
    pool.free(reversed(a))  # tail first: cached blocks to the tail, block 2 (no key) to the head
    assert pool.free_queue.block_ids() == [2, 3, 4, 5, 6, 7, 8, 9, 10, 1, 0]
    pool.check_integrity()


def test_a_freed_block_without_a_key_is_reused_before_any_cached_block_is_evicted():
    pool = BlockPool(4, 4)
    blocks = pool.allocate(4)
    pool.cache(blocks[0], key(0), (0, 0, 0, 0))
    pool.free([blocks[0]])
    pool.free([blocks[3], blocks[2]])       # hold nothing: to the head, the last freed first
    assert pool.free_queue.block_ids() == [2, 3, 0]
    assert [b.block_id for b in pool.allocate(2)] == [2, 3]
    assert pool.num_evicted_blocks == 0 and pool.lookup(key(0), (0, 0, 0, 0)) is blocks[0]
    pool.check_integrity()


def test_freed_cached_block_stays_a_hit_until_reused():
    pool = BlockPool(4, 4)
    [b0, b1] = pool.allocate(2)
    assert pool.cache(b0, key(0), (0, 0, 0, 0))
    pool.free([b1, b0])
    assert pool.lookup(key(0), (0, 0, 0, 0)) is b0
    assert pool.num_free_blocks == 4
    # free order is [1, 2, 3, 0] (block 1 holds nothing: the head): three allocations leave
    # the cached block 0 alone
    got = pool.allocate(3)
    assert [b.block_id for b in got] == [1, 2, 3]
    assert pool.lookup(key(0), (0, 0, 0, 0)) is b0
    # the fourth evicts it
    [b] = pool.allocate(1)
    assert b.block_id == 0 and b.key is None
    assert pool.lookup(key(0), (0, 0, 0, 0)) is None
    assert pool.num_evicted_blocks == 1
    pool.check_integrity()


def test_touch_removes_a_cached_block_from_the_middle_of_the_free_queue():
    pool = BlockPool(5, 4)
    blocks = pool.allocate(5)
    pool.cache(blocks[2], key(2), (2, 2, 2, 2))
    pool.free(blocks)
    assert pool.free_queue.block_ids() == [4, 3, 1, 0, 2]     # blocks without a key at the head
    pool.touch([blocks[2]])
    assert pool.free_queue.block_ids() == [4, 3, 1, 0]
    assert blocks[2].ref_count == 1
    pool.touch([blocks[2]])
    assert blocks[2].ref_count == 2
    pool.free([blocks[2], blocks[2]])
    assert pool.free_queue.block_ids() == [4, 3, 1, 0, 2]
    pool.check_integrity()


def test_collision_on_key_with_other_tokens_is_a_miss():
    pool = BlockPool(2, 4)
    [b] = pool.allocate(1)
    pool.cache(b, key(7), (7, 7, 7, 7))
    assert pool.lookup(key(7), (7, 7, 7, 8)) is None
    assert pool.lookup(key(7), (7, 7, 7, 7)) is b


def test_duplicate_key_keeps_first_block():
    pool = BlockPool(3, 4)
    a, b = pool.allocate(2)
    assert pool.cache(a, key(1), (1, 1, 1, 1)) is True
    assert pool.cache(b, key(1), (1, 1, 1, 1)) is False
    assert b.key is None
    assert pool.num_cached_blocks == 1


def test_errors():
    pool = BlockPool(2, 4)
    with pytest.raises(NoFreeBlocksError, match="asked for 3 blocks, only 2"):
        pool.allocate(3)
    [b] = pool.allocate(1)
    pool.free([b])
    with pytest.raises(ValueError, match="double free"):
        pool.free([b])
    [b] = pool.allocate(1)
    with pytest.raises(ValueError, match="only full blocks"):
        pool.cache(b, key(1), (1, 1))
    with pytest.raises(ValueError):
        BlockPool(0, 4)


def test_evict_cached_keeps_referenced_blocks():
    pool = BlockPool(3, 4)
    a, b = pool.allocate(2)
    pool.cache(a, key(1), (1,) * 4)
    pool.cache(b, key(2), (2,) * 4)
    pool.free([a])
    assert pool.evict_cached() == 1
    assert a.key is None and b.key == key(2)
    pool.check_integrity()


def test_a_tenants_reset_drops_its_blocks_only():
    """Blocks record the tenant whose namespace their key is in; a reset scoped to one tenant
    forgets only its unreferenced blocks (pinned ones too), in one walk of the free queue."""
    pool = BlockPool(6, 4)
    blocks = pool.allocate(5)
    for i, (block, tenant) in enumerate(zip(blocks, ["alice", "alice", "bob", "", "alice"])):
        pool.cache(block, key(i), (i,) * 4, tenant)
    pool.pin_keys([key(1)])
    pool.free(blocks[:4])                                   # alice's last block stays in use
    assert pool.cached_blocks_by_tenant() == {"alice": 3, "bob": 1, "": 1}
    assert pool.evict_cached("alice") == 2                  # the pinned one too, not the one in use
    assert [b.key for b in blocks] == [None, None, key(2), key(3), key(4)]
    assert pool.cached_blocks_by_tenant() == {"alice": 1, "bob": 1, "": 1}
    assert pool.evict_cached("carol") == 0
    pool.check_integrity()
    assert pool.evict_cached() == 2                          # everyone's, still not the block in use
    assert pool.cached_blocks_by_tenant() == {"alice": 1}
    pool.unpin_keys([key(1)])
    pool.check_integrity()


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "touch", "reset"]),
                         st.integers(0, 1000)), max_size=120)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_invariants(sequence):
    """free + cached + used == total under any mix of verbs."""
    pool = BlockPool(9, 2)
    owned: list[list] = []      # per "request": blocks it references
    for op, n in sequence:
        if op == "alloc":
            want = n % 4 + 1
            if want <= pool.num_free_blocks:
                owned.append(pool.allocate(want))
            else:
                with pytest.raises(NoFreeBlocksError):
                    pool.allocate(want)
        elif op == "free" and owned:
            blocks = owned.pop(n % len(owned))
            pool.free(reversed(blocks))
        elif op == "cache" and owned:
            blocks = owned[n % len(owned)]
            block = blocks[n % len(blocks)]
            if block.key is None:
                pool.cache(block, block_key(None, [n, n], EXTRA), (n, n))
        elif op == "touch":
            cached = [b for b in pool.blocks if b.key is not None]
            if cached:
                b = cached[n % len(cached)]
                assert pool.lookup(b.key, b.token_ids) is b
                pool.touch([b])
                owned.append([b])
        elif op == "reset":
            pool.evict_cached()
        pool.check_integrity()
        refs = {}
        for blocks in owned:
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        assert all(b.ref_count == refs.get(b.block_id, 0) for b in pool.blocks)

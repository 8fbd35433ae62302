"""Eviction classes and pins in the pool and the KV manager: exact block ids and queue orders."""

from __future__ import annotations

import pytest
from fake_clock import FakeClock
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pins import PinLimitError, PinNotFoundError, Pins
from kvserve.kv.prefix import block_key, make_extra_key
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

EXTRA = make_extra_key("model", "native")
HIGH = 1


def key(i: int) -> bytes:
    return block_key(None, [i] * 4, EXTRA)


def cached_pool(num_blocks: int, num_cached: int) -> tuple[BlockPool, list]:
    """A pool whose first ``num_cached`` blocks hold keys 0.. and are all free (freed in id order)."""
    pool = BlockPool(num_blocks, 4)
    blocks = pool.allocate(num_blocks)
    for i in range(num_cached):
        pool.cache(blocks[i], key(i), (i,) * 4)
    pool.free(blocks)
    return pool, blocks


# -- the pool ----------------------------------------------------------------
def test_blocks_of_a_high_request_are_evicted_after_every_normal_block():
    pool = BlockPool(6, 4)
    hi = pool.allocate(2, retention=HIGH)
    lo = pool.allocate(2)
    for i, b in enumerate(hi + lo):
        pool.cache(b, key(i), (i,) * 4)
    pool.free(reversed(hi))
    pool.free(reversed(lo))
    assert pool.free_queue.block_ids() == [4, 5, 3, 2, 1, 0]      # normal (LRU), then high
    assert [b.block_id for b in pool.allocate(4)] == [4, 5, 3, 2]
    assert pool.lookup(key(0), (0,) * 4) is hi[0]
    pool.check_integrity()


def test_a_block_takes_the_highest_class_of_its_holders_since_it_was_last_free():
    pool, blocks = cached_pool(3, 3)
    pool.touch([blocks[0]])                 # a normal request...
    pool.touch([blocks[0]], retention=HIGH)  # ...and a high one share it
    pool.free([blocks[0], blocks[0]])
    assert blocks[0].queue_index == HIGH
    pool.touch([blocks[0]])                 # a new use period, by a normal request only
    pool.free([blocks[0]])
    assert blocks[0].queue_index == 0
    assert pool.free_queue.block_ids() == [1, 2, 0]
    pool.check_integrity()


def test_a_block_without_a_key_is_always_class_zero():
    pool = BlockPool(3, 4)
    blocks = pool.allocate(3, retention=HIGH)
    pool.cache(blocks[0], key(0), (0,) * 4)
    pool.free(reversed(blocks))
    assert [b.queue_index for b in blocks] == [HIGH, 0, 0]
    assert pool.free_queue.block_ids() == [1, 2, 0]     # keyless blocks at the head, the last freed first
    pool.check_integrity()


def test_pinned_blocks_wait_after_every_class_and_go_back_when_unpinned():
    pool, blocks = cached_pool(6, 4)                        # queue: 5 4 0 1 2 3 (0-3 cached)
    pool.touch([blocks[3]], retention=HIGH)
    pool.free([blocks[3]])                                  # 3 is high now
    pool.pin_keys([key(0), key(1)])                         # a chain: its tail waits nearer the head
    assert pool.free_queue.block_ids() == [5, 4, 2, 3, 1, 0]
    assert (pool.num_pinned_keys, pool.num_pinned_cached) == (2, 2)
    pool.pin_keys([key(0)])                                 # a second pin on key 0
    pool.unpin_keys([key(0), key(1)])                       # key 1 is free again, key 0 still pinned
    assert pool.free_queue.block_ids() == [5, 4, 2, 1, 3, 0]
    pool.unpin_keys([key(0)])
    assert pool.free_queue.block_ids() == [5, 4, 2, 1, 0, 3]
    assert pool.num_pinned_keys == 0
    with pytest.raises(ValueError, match="no pin covers"):
        pool.unpin_keys([key(0)])
    pool.check_integrity()


def test_a_pinned_block_is_evicted_last_and_counted():
    pool, _ = cached_pool(4, 4)
    pool.pin_keys([key(0)])
    assert [b.block_id for b in pool.peek_evictions(4)] == [1, 2, 3, 0]
    got = pool.allocate(4)
    assert [b.block_id for b in got] == [1, 2, 3, 0]
    assert (pool.num_pinned_evicted, pool.num_pinned_cached, pool.num_pinned_keys) == (1, 0, 1)
    # the pin outlives the block: the key is pinned again once a block holds it
    pool.cache(got[2], key(0), (0,) * 4)
    pool.free(got)
    assert pool.num_pinned_cached == 1
    assert pool.free_queue.block_ids() == [0, 2, 1, 3]      # keyless 1, 2, 0 to the head in turn
    pool.check_integrity()


def test_a_cache_reset_drops_pinned_blocks_but_keeps_the_pins():
    pool, blocks = cached_pool(4, 3)
    pool.pin_keys([key(1)])
    pool.touch([blocks[2]], retention=HIGH)
    pool.free([blocks[2]])
    assert pool.evict_cached() == 3
    assert pool.free_queue.block_ids() == [3, 0, 2, 1]
    assert (pool.num_pinned_keys, pool.num_pinned_cached) == (1, 0)
    pool.check_integrity()


# -- the pin table -------------------------------------------------------------
def pins_on(num_blocks: int = 8, limit: int = 4, max_ttl_s: float = 600.0) -> tuple[Pins, FakeClock, list]:
    clock = FakeClock(1000.0)
    pool, blocks = cached_pool(num_blocks, num_blocks)
    return Pins(pool, limit, max_ttl_s, clock), clock, blocks


def test_pins_expire_on_the_clock_and_a_repin_extends_them():
    pins, clock, _ = pins_on()
    [info] = pins.pin([([key(0), key(1)], 60.0)])
    assert (info.num_tokens, info.expires_in_s, info.num_device_blocks) == (8, 60.0, 2)
    clock.now += 50
    pins.pin([([key(0), key(1)], 60.0)])             # the same pin (same last key): now due at +110
    pins.pin([([key(0), key(1)], 5.0)])              # an earlier expiry never shortens it
    clock.now += 59.9
    assert pins.expire() == 0 and len(pins) == 1
    clock.now += 0.1
    assert pins.expire() == 1 and len(pins) == 0
    assert pins.pool.num_pinned_keys == 0 and pins.num_expired == 1
    assert pins.pool.free_queue.block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]   # evictable again, tail first
    pins.check_integrity()


def test_pins_over_the_limit_are_refused_whole_and_change_nothing():
    pins, _, _ = pins_on(limit=3)
    pins.pin([([key(0), key(1)], 60.0)])
    before = pins.pool.free_queue.block_ids()
    with pytest.raises(PinLimitError, match="pinning 2 more blocks would make 4 pinned, over this engine's "
                                            "limit of 3 of 8 blocks"):
        pins.pin([([key(2)], 60.0), ([key(3)], 60.0)])
    assert pins.pool.free_queue.block_ids() == before and len(pins) == 1
    pins.pin([([key(0)], 60.0), ([key(0), key(1), key(2)], 60.0)])   # one new key: fits
    assert pins.stats().num_pinned_keys == 3 and len(pins) == 3
    with pytest.raises(ValueError, match=r"ttl must be in \(0, 600\] seconds"):
        pins.pin([([key(0)], 601.0)])
    with pytest.raises(PinLimitError, match="pinning is off"):
        pins_on(limit=0)[0].pin([([key(0)], 1.0)])
    pins.check_integrity()


def test_unpin_names_the_exact_prefix():
    pins, _, _ = pins_on()
    pins.pin([([key(0), key(1)], 60.0), ([key(0)], 60.0)])
    with pytest.raises(PinNotFoundError, match="no pin covers exactly this prefix"):
        pins.unpin([key(1)])
    info = pins.unpin([key(0), key(1)])
    assert info.block_keys == (key(0), key(1)) and info.expires_in_s == 0.0
    assert pins.pool.pin_count(key(0)) == 1 and pins.pool.pin_count(key(1)) == 0
    pins.check_integrity()


# -- the KV manager ------------------------------------------------------------
def request(rid: str, tokens: list[int], retention: int = 0) -> Request:
    return Request(rid, tokens, SamplingParams(), arrival_seq=0, retention_class=retention)


def prefill(kv: KVCacheManager, req: Request) -> int:
    match = kv.match_prefix(req)
    hit = match.num_blocks * kv.block_size
    assert kv.try_allocate(req, req.num_tokens - hit, match)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    return hit


def manager(num_blocks: int = 8, limit: int = 4) -> tuple[KVCacheManager, FakeClock]:
    clock = FakeClock(1000.0)
    pool = BlockPool(num_blocks, 4)
    return KVCacheManager(pool, EXTRA, pins=Pins(pool, limit, 600.0, clock)), clock


SYSTEM = list(range(100, 108))   # two full blocks


def test_a_pinned_system_prompt_stays_a_hit_under_a_flood():
    kv, _ = manager()
    first = request("first", SYSTEM + [1, 2, 3])
    kv.pin(first.all_token_ids, [(8, 60.0)])
    assert prefill(kv, first) == 0
    kv.forget(first)
    for i in range(20):                                  # each takes every block but the two pinned
        flood = request(f"f{i}", [200 + 30 * i + j for j in range(23)])
        assert prefill(kv, flood) == 0
        kv.forget(flood)
        kv.check_integrity()
    again = request("again", SYSTEM + [9])
    assert prefill(kv, again) == 8
    assert kv.block_ids("again")[:2] == [0, 1]
    assert kv.num_pinned_hits(again, 2) == 2
    assert kv._pool.num_pinned_evicted == 0
    kv.check_integrity()


def test_an_expired_pin_is_evictable_again():
    kv, clock = manager()
    first = request("first", SYSTEM + [1])
    kv.pin(first.all_token_ids, [(8, 60.0)])
    prefill(kv, first)
    kv.forget(first)
    clock.now += 60
    assert kv.expire_pins() == 1
    flood = request("flood", [200 + j for j in range(31)])
    prefill(kv, flood)
    kv.forget(flood)
    assert prefill(kv, request("again", SYSTEM + [9])) == 0
    kv.check_integrity()


def test_a_flood_that_needs_the_pinned_blocks_evicts_them_last_and_tail_first():
    kv, _ = manager(limit=4)
    first = request("first", SYSTEM + [1])
    kv.pin(first.all_token_ids, [(8, 60.0)])
    prefill(kv, first)
    kv.forget(first)                                     # queue: 3..7, 2, then pinned 1, 0
    flood = request("flood", [200 + j for j in range(28)])   # 7 blocks: every unpinned one and block 1
    prefill(kv, flood)
    assert sorted(kv.block_ids("flood")) == [1, 2, 3, 4, 5, 6, 7]
    assert kv._pool.num_pinned_evicted == 1
    kv.forget(flood)
    assert prefill(kv, request("again", SYSTEM + [9])) == 4   # block 0 (the head) survived
    kv.check_integrity()


def test_high_priority_history_outlives_normal_traffic():
    kv, _ = manager(num_blocks=8)
    vip = request("vip", list(range(300, 312)) + [1], retention=HIGH)
    prefill(kv, vip)
    kv.forget(vip)
    for i in range(5):
        flood = request(f"f{i}", [400 + 30 * i + j for j in range(19)])   # 5 blocks each
        prefill(kv, flood)
        kv.forget(flood)
    assert prefill(kv, request("vip2", list(range(300, 312)) + [2])) == 12
    kv.check_integrity()


ops = st.lists(st.tuples(st.sampled_from(["alloc", "free", "cache", "touch", "pin", "unpin", "tick", "reset"]),
                         st.integers(0, 1000)), max_size=150)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_operations_keep_pin_and_class_invariants(sequence):
    clock = FakeClock(1000.0)
    pool = BlockPool(9, 2)
    pins = Pins(pool, 5, 100.0, clock)
    keys = [key(i) for i in range(12)]
    owned: list[list] = []
    for op, n in sequence:
        if op == "alloc" and n % 4 + 1 <= pool.num_free_blocks:
            owned.append(pool.allocate(n % 4 + 1, retention=n % 2))
        elif op == "free" and owned:
            pool.free(reversed(owned.pop(n % len(owned))))
        elif op == "cache" and owned:
            blocks = owned[n % len(owned)]
            block = blocks[n % len(blocks)]
            if block.key is None:
                pool.cache(block, keys[n % len(keys)], (n % len(keys),) * 2)
        elif op == "touch":
            k = keys[n % len(keys)]
            if pool.holds(k):
                block = pool.lookup(k, (n % len(keys),) * 2)
                assert block is not None
                pool.touch([block], retention=n % 2)
                owned.append([block])
        elif op == "pin":
            start = n % len(keys)
            try:
                pins.pin([(keys[start:start + n % 3 + 1], float(n % 50 + 1))])
            except PinLimitError:
                assert pool.num_pinned_keys + (n % 3 + 1) > 5
        elif op == "unpin":
            infos = pins.infos()
            if infos:
                pins.unpin(infos[n % len(infos)].block_keys)
        elif op == "tick":
            clock.now += n % 40
            pins.expire()
        elif op == "reset":
            pool.evict_cached()
        pool.check_integrity()
        pins.check_integrity()
    for blocks in owned:
        pool.free(blocks)
    pool.check_integrity()
    assert pool.num_free_blocks == 9

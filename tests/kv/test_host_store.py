"""The host store for ArkVale's stashed blocks: byte accounting, LRU order, evictions."""

from __future__ import annotations

import pytest
import torch

from kvserve.kv.budget.host_store import HostBlockStore, StashKey


def block(num_floats: int = 8, fill: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A stashed block of ``2 * num_floats * 4`` bytes (keys and values)."""
    return torch.full((num_floats,), fill), torch.full((num_floats,), fill)


BLOCK_NBYTES = 2 * 8 * 4


def test_bytes_are_counted_per_store_and_per_owner():
    store = HostBlockStore(10 * BLOCK_NBYTES)
    store.put(StashKey("a", 0, 1), block())
    store.put(StashKey("a", 1, 1), block())
    store.put(StashKey("b", 0, 3), block(16))
    assert store.nbytes == 4 * BLOCK_NBYTES and store.num_blocks == 3
    assert store.nbytes_of("a") == 2 * BLOCK_NBYTES and store.nbytes_of("b") == 2 * BLOCK_NBYTES
    assert store.owners() == {"a", "b"}
    assert sorted(store.blocks_of("a", 0)) == [1] and store.blocks_of("c", 0) == {}
    k, _ = store.take(StashKey("a", 0, 1))
    assert k.shape == (8,) and not store.contains(StashKey("a", 0, 1))
    assert store.nbytes == 3 * BLOCK_NBYTES and store.nbytes_of("a") == BLOCK_NBYTES
    store.remove(StashKey("b", 0, 3))
    assert store.owners() == {"a"} and store.nbytes_of("b") == 0
    store.check_integrity()
    assert store.num_evicted == 0


def test_the_oldest_blocks_are_evicted_first_and_counted():
    store = HostBlockStore(3 * BLOCK_NBYTES)
    for i in range(3):
        store.put(StashKey("a", 0, i), block(fill=float(i)))
    assert torch.equal(store.peek(StashKey("a", 0, 1))[0], torch.full((8,), 1.0))   # peeking changes no order
    store.take(StashKey("a", 0, 1))           # recalled: it leaves, making room
    store.put(StashKey("b", 0, 7), block())
    assert store.num_evicted == 0
    store.put(StashKey("b", 0, 8), block())   # full: the oldest (a0) goes
    assert not store.contains(StashKey("a", 0, 0)) and store.contains(StashKey("a", 0, 2))
    store.put(StashKey("a", 1, 5), block(16))  # two blocks' worth: a2, then b7 go
    assert [k for k in (StashKey("a", 0, 2), StashKey("b", 0, 7), StashKey("b", 0, 8), StashKey("a", 1, 5))
            if store.contains(k)] == [StashKey("b", 0, 8), StashKey("a", 1, 5)]
    assert store.num_evicted == 3
    assert store.num_evicted_of("a") == 2 and store.num_evicted_of("b") == 1
    assert store.nbytes == 3 * BLOCK_NBYTES
    store.check_integrity()


def test_a_block_larger_than_the_store_is_not_kept():
    store = HostBlockStore(BLOCK_NBYTES)
    store.put(StashKey("a", 0, 0), block())
    store.put(StashKey("a", 0, 1), block(16))
    assert store.contains(StashKey("a", 0, 0)) and not store.contains(StashKey("a", 0, 1))
    assert store.num_evicted == 1 and store.nbytes == BLOCK_NBYTES
    empty = HostBlockStore(0)
    empty.put(StashKey("a", 0, 0), block())
    assert empty.num_blocks == 0 and empty.num_evicted == 1
    empty.check_integrity()
    with pytest.raises(ValueError, match="must be >= 0 bytes"):
        HostBlockStore(-1)


def test_dropping_an_owner_frees_its_blocks_only():
    store = HostBlockStore(4 * BLOCK_NBYTES)
    for i in range(3):
        store.put(StashKey("a", i % 2, i), block())
    store.put(StashKey("b", 0, 0), block())
    store.put(StashKey("b", 0, 1), block())    # evicts a's oldest
    store.drop_owner("a")
    assert store.owners() == {"b"} and store.nbytes == 2 * BLOCK_NBYTES
    assert store.num_evicted_of("a") == 0 and store.num_evicted == 1
    store.check_integrity()
    store.drop_owner("a")                       # nothing left: no error
    store.drop_owner("b")
    assert store.num_blocks == 0 and store.nbytes == 0
    store.check_integrity()


def test_check_integrity_catches_drifted_bytes():
    store = HostBlockStore(4 * BLOCK_NBYTES)
    store.put(StashKey("a", 0, 0), block())
    store.nbytes += 1
    with pytest.raises(AssertionError, match="bytes drifted"):
        store.check_integrity()

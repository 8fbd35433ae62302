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
    store.put(StashKey("b", 0, 3), block())
    assert store.nbytes == 3 * BLOCK_NBYTES and store.num_blocks == 3
    assert store.nbytes_of("a") == 2 * BLOCK_NBYTES and store.nbytes_of("b") == BLOCK_NBYTES
    assert store.owners() == {"a", "b"}
    assert sorted(store.blocks_of("a", 0)) == [1] and store.blocks_of("c", 0) == {}
    k, _ = store.take(StashKey("a", 0, 1))
    assert k.shape == (8,) and not store.contains(StashKey("a", 0, 1))
    assert store.nbytes == 2 * BLOCK_NBYTES and store.nbytes_of("a") == BLOCK_NBYTES
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
    # two at once: a2, then b7 go
    store.put_many([StashKey("a", 1, 5), StashKey("a", 1, 6)], torch.full((2, 8), 5.0), torch.full((2, 8), 6.0))
    assert [k for k in (StashKey("a", 0, 2), StashKey("b", 0, 7), StashKey("b", 0, 8), StashKey("a", 1, 5),
                        StashKey("a", 1, 6)) if store.contains(k)] == [
        StashKey("b", 0, 8), StashKey("a", 1, 5), StashKey("a", 1, 6)]
    assert store.peek(StashKey("a", 1, 6))[0].tolist() == [5.0] * 8 and store.peek(StashKey("a", 1, 6))[1][0] == 6.0
    assert store.num_evicted == 3
    assert store.num_evicted_of("a") == 2 and store.num_evicted_of("b") == 1
    assert store.nbytes == 3 * BLOCK_NBYTES
    store.check_integrity()


def test_a_store_smaller_than_a_block_keeps_none_and_other_shapes_are_refused():
    store = HostBlockStore(BLOCK_NBYTES - 1)
    store.put(StashKey("a", 0, 0), block())
    assert store.num_blocks == 0 and store.num_evicted == 1 and store.num_evicted_of("a") == 1
    store.check_integrity()
    empty = HostBlockStore(0)
    empty.put(StashKey("a", 0, 0), block())
    assert empty.num_blocks == 0 and empty.num_evicted == 1
    empty.check_integrity()
    with pytest.raises(ValueError, match="must be >= 0 bytes"):
        HostBlockStore(-1)
    one = HostBlockStore(4 * BLOCK_NBYTES)
    one.put(StashKey("a", 0, 0), block())
    with pytest.raises(ValueError, match=r"holds blocks of \(8,\) torch.float32, got \(16,\)"):
        one.put(StashKey("a", 0, 1), block(16))
    with pytest.raises(ValueError, match="1 blocks, but 1 keys and 2 values"):
        one.put_many([StashKey("a", 0, 1)], torch.zeros(1, 8), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="need one shape and dtype"):
        one.put_many([StashKey("a", 0, 1)], torch.zeros(1, 8), torch.zeros(1, 8, dtype=torch.float16))
    assert one.num_blocks == 1
    one.check_integrity()


def test_more_blocks_than_fit_in_one_call_keep_the_newest():
    store = HostBlockStore(3 * BLOCK_NBYTES)
    keys = [StashKey("a", 0, i) for i in range(5)]
    data = torch.arange(5.0)[:, None].expand(5, 8)
    store.put_many(keys, data, -data)
    assert [k.block for k in keys if store.contains(k)] == [2, 3, 4] and store.num_evicted == 2
    assert [store.peek(k)[0][0].item() for k in keys[2:]] == [2.0, 3.0, 4.0]
    assert [store.peek(k)[1][0].item() for k in keys[2:]] == [-2.0, -3.0, -4.0]
    k, v = store.take_many([keys[4], keys[2]])
    assert k[:, 0].tolist() == [4.0, 2.0] and v[:, 0].tolist() == [-4.0, -2.0]
    assert store.num_blocks == 1
    store.check_integrity()


def test_the_pool_grows_to_the_capacity_keeping_its_blocks():
    store = HostBlockStore(200 * BLOCK_NBYTES)
    keys = [StashKey("a", i % 3, i) for i in range(150)]
    data = torch.arange(150.0)[:, None].expand(150, 8)
    for n in range(0, 150, 50):
        store.put_many(keys[n:n + 50], data[n:n + 50], data[n:n + 50] + 0.5)
    assert store.num_blocks == 150 and store.nbytes == 150 * BLOCK_NBYTES and store.num_evicted == 0
    assert all(store.peek(k)[0][0].item() == i and store.peek(k)[1][7].item() == i + 0.5 for i, k in enumerate(keys))
    store.drop_owner("a")
    store.put(StashKey("b", 0, 0), block(fill=9.0))      # a freed row is reused
    assert store.peek(StashKey("b", 0, 0))[0].tolist() == [9.0] * 8
    store.check_integrity()


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
    store.nbytes -= 1
    store._free_rows.append(store._free_rows[-1])
    with pytest.raises(AssertionError, match="pool rows lost or doubled"):
        store.check_integrity()


def test_the_row_index_follows_stashes_evictions_takes_and_reported_swaps():
    """``rows_of`` is the store's own index (the C++ decode pass trades blocks through it):
    every stash, eviction, take and drop shows in it; a swap made in place is reported with
    ``swapped``, after which the block that took the row is stashed, and the newest."""
    store = HostBlockStore(3 * BLOCK_NBYTES)
    a = [StashKey("a", 0, j) for j in range(6)]
    store.put(a[1], block(fill=1.0))
    store.put(a[4], block(fill=4.0))
    store.put(StashKey("b", 1, 0), block(fill=9.0))
    rows = store.rows_of("a", 0, 6)
    assert rows.dtype == torch.long and rows.shape[0] >= 6
    assert rows[:6].tolist() == [-1, store._rows[a[1]], -1, -1, store._rows[a[4]], -1]
    assert store.rows_of("b", 1, 1)[0] == store._rows[StashKey("b", 1, 0)]
    store.put(a[5], block(fill=5.0))                 # full: evicts the oldest, a1
    assert rows[1] == -1 and rows[5] == store._rows[a[5]] and store.num_evicted_of("a") == 1
    store.take(a[4])
    assert rows[4] == -1
    store.check_integrity()
    # block 5's row traded for block 2's content in place (as swap_pages does), then reported
    rows[2], rows[5] = rows[5].item(), -1
    store._pool[rows[2], 0] = 2.0
    store.swapped("a", 0, [(5, 2)])
    assert store.contains(a[2]) and not store.contains(a[5]) and store.peek(a[2])[0][0] == 2.0
    store.check_integrity()
    store.put(a[0], block())
    store.put(a[3], block())                          # evicts b0, then a2 is the oldest
    assert not store.contains(StashKey("b", 1, 0)) and store.contains(a[2])
    store.put(StashKey("b", 1, 1), block())
    assert not store.contains(a[2]) and rows[2] == -1
    longer = store.rows_of("a", 0, 200)              # grown: the same rows, -1 beyond
    assert longer.shape[0] >= 200 and torch.equal(longer[:6], rows[:6]) and (longer[6:] == -1).all()
    longer[0] = -1                                    # drifted from the stash
    with pytest.raises(AssertionError, match="row index and the stash disagree"):
        store.check_integrity()
    longer[0] = store._rows[a[0]]
    store.drop_owner("a")
    assert (store.rows_of("a", 0, 6) == -1).all()
    store.check_integrity()

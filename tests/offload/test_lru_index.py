"""The byte-bounded LRU index the host and disk tiers share."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.offload.lru import LRUIndex


def key(i: int) -> bytes:
    return bytes([i]) * 32


def put(index: LRUIndex, k: bytes, nbytes: int) -> list[bytes]:
    """What a tier does for a put: forget the old size, make room, add as most recent."""
    index.pop(k)
    evicted = index.evict(nbytes)
    index.add(k, nbytes)
    return evicted


def test_evicts_least_recent_first_and_touch_reorders():
    index = LRUIndex(30)
    for i in range(3):
        assert put(index, key(i), 10) == []
    assert index.touch(key(0)) and not index.touch(key(9))
    assert index.keys_lru_first() == [key(1), key(2), key(0)]
    assert put(index, key(3), 20) == [key(1), key(2)]
    assert index.keys_lru_first() == [key(0), key(3)] and index.nbytes == 30
    assert list(index.items()) == [(key(0), 10), (key(3), 20)]
    assert key(0) in index and key(1) not in index and len(index) == 2
    index.check_integrity()


def test_pop_returns_the_size_and_a_missing_key_is_none():
    index = LRUIndex(100)
    put(index, key(0), 40)
    assert index.pop(key(1)) is None
    assert index.pop(key(0)) == 40 and index.nbytes == 0
    index.check_integrity()


def test_a_value_over_the_capacity_does_not_fit_and_add_refuses_a_held_key():
    index = LRUIndex(30)
    assert index.fits(30) and not index.fits(31)
    put(index, key(0), 5)
    with pytest.raises(ValueError, match="already held"):
        index.add(key(0), 5)


def test_add_may_overshoot_until_evict_and_the_check_sees_it():
    index = LRUIndex(20)
    for i in range(3):
        index.add(key(i), 10)          # a scanned directory, oldest first
    with pytest.raises(AssertionError, match="over its capacity"):
        index.check_integrity()
    assert index.evict() == [key(0)]
    assert index.keys_lru_first() == [key(1), key(2)]
    index.check_integrity()
    index.clear()
    assert index.nbytes == 0 and len(index) == 0


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "touch", "pop"]), st.integers(0, 6), st.integers(0, 50)),
                max_size=50))
def test_matches_a_reference_lru(ops):
    index, ref = LRUIndex(50), []      # ref: (key, size), least recent first
    for op, i, size in ops:
        k = key(i)
        held = [kk for kk, _ in ref]
        if op == "put":
            ref = [(kk, s) for kk, s in ref if kk != k]
            while ref and sum(s for _, s in ref) + size > 50:
                ref.pop(0)
            ref.append((k, size))
            put(index, k, size)
        elif op == "touch":
            assert index.touch(k) == (k in held)
            if k in held:
                ref.append(ref.pop(held.index(k)))
        else:
            assert index.pop(k) == (ref[held.index(k)][1] if k in held else None)
            ref = [(kk, s) for kk, s in ref if kk != k]
        index.check_integrity()
        assert list(index.items()) == ref

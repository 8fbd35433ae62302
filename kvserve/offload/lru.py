"""Keys in least-recently-used order, each with a byte size, under a byte capacity.

The bookkeeping the host and disk tiers share: ``LRUIndex`` alone, and ``LRUTransport``,
the transport base that holds one under a lock and answers the accessors from it. Each
tier keeps its values (a dict of bytes, files) next to the index and drops a value when
the index evicts or forgets its key.

    LRU end                                    most recent end
    | k3 (4 KB) | k0 (4 KB) | k7 (2 KB) | ... | k5 (4 KB) |      nbytes = sum of sizes
      ^ evict() takes from here                   ^ add() and touch() put keys here
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Iterator, Sequence

from kvserve.offload.base import Transport


class LRUIndex:
    """Invariant (between calls): ``nbytes == sum of sizes <= capacity_bytes``.

    Not thread-safe: the tier that owns it calls it under its own lock. ``add`` alone may
    overshoot the capacity (a directory scanned at start); ``evict()`` brings it back.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self._sizes: OrderedDict[bytes, int] = OrderedDict()
        self._nbytes = 0

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __contains__(self, key: bytes) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def items(self) -> Iterator[tuple[bytes, int]]:
        """(key, size), least recently used first."""
        return iter(self._sizes.items())

    def keys_lru_first(self) -> list[bytes]:
        return list(self._sizes)

    def fits(self, nbytes: int) -> bool:
        """Whether a value of ``nbytes`` can be held at all (not larger than the capacity)."""
        return nbytes <= self.capacity_bytes

    def touch(self, key: bytes) -> bool:
        """Make ``key`` the most recent; whether it is held."""
        if key not in self._sizes:
            return False
        self._sizes.move_to_end(key)
        return True

    def pop(self, key: bytes) -> int | None:
        """Forget ``key``; its size, or None if it was not held."""
        size = self._sizes.pop(key, None)
        if size is not None:
            self._nbytes -= size
        return size

    def evict(self, nbytes: int = 0) -> list[bytes]:
        """Drop least recently used keys until ``nbytes`` more fit (or none is left); the keys dropped."""
        dropped = []
        while self._sizes and self._nbytes + nbytes > self.capacity_bytes:
            key, size = self._sizes.popitem(last=False)
            self._nbytes -= size
            dropped.append(key)
        return dropped

    def add(self, key: bytes, nbytes: int) -> None:
        """Hold ``key`` (not held now) as the most recent; call ``evict(nbytes)`` first to stay in capacity."""
        if key in self._sizes:
            raise ValueError(f"key {key.hex()[:16]} is already held; pop it first")
        self._sizes[key] = nbytes
        self._nbytes += nbytes

    def clear(self) -> None:
        self._sizes.clear()
        self._nbytes = 0

    def check_integrity(self, what: str = "LRU index") -> None:
        total = sum(self._sizes.values())
        assert self._nbytes == total, f"{what} counts {self._nbytes} bytes, holds {total}"
        assert total <= self.capacity_bytes, f"{what} holds {total} bytes over its capacity {self.capacity_bytes}"


class LRUTransport(Transport):
    """A tier whose values are bounded in bytes and evicted least recently used first.

    Holds the ``LRUIndex`` (key -> size, in LRU order) and the lock that guards it together
    with the subclass's values. Invariant (under the lock): the index and the values hold
    the same keys, each value at its indexed size. A subclass stores and reads the values
    (``get_many``, ``put_many``, ``close``) and says how to drop one (``_drop_value``) and
    how to check them (``_check_values``).
    """

    def __init__(self, capacity_bytes: int) -> None:
        self._index = LRUIndex(capacity_bytes)
        self._lock = threading.Lock()

    @abstractmethod
    def _drop_value(self, key: bytes) -> None:
        """Delete the value of ``key``, which the index has just forgotten. Caller holds the lock."""

    @abstractmethod
    def _check_values(self) -> None:
        """Assert that the values match the index (same keys and sizes). Caller holds the lock."""

    def _check_open(self) -> None:
        """Raise for a call on a closed tier; a tier usable after ``close`` keeps this no-op."""

    def _evict(self, nbytes: int) -> None:
        """Drop least recently used values until ``nbytes`` more fit. Caller holds the lock."""
        for key in self._index.evict(nbytes):
            self._drop_value(key)

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        self._check_open()
        with self._lock:
            return [key in self._index for key in keys]

    def remove(self, keys: Sequence[bytes]) -> None:
        self._check_open()
        with self._lock:
            for key in keys:
                if self._index.pop(key) is not None:
                    self._drop_value(key)

    @property
    def nbytes_used(self) -> int:
        return self._index.nbytes

    @property
    def capacity_bytes(self) -> int:
        return self._index.capacity_bytes

    def keys_lru_first(self) -> list[bytes]:
        """The keys held, least recently used first (the order evictions take)."""
        with self._lock:
            return self._index.keys_lru_first()

    def check_integrity(self) -> None:
        with self._lock:
            self._index.check_integrity(f"{self.name} tier")
            self._check_values()

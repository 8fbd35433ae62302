"""Host-memory tier: a dict of values in LRU order, bounded in bytes."""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvserve.config import HostConfig
from kvserve.offload.base import Transport
from kvserve.offload.lru import LRUIndex


class HostTransport(Transport):
    """Values in a dict, their order and sizes in an ``LRUIndex``; one lock guards both.

    Invariant: the dict and the index hold the same keys, and ``nbytes_used == sum(len(v))
    <= capacity_bytes``. A put evicts from the LRU end until the new value fits, before
    inserting it; a value larger than the whole capacity is refused without evicting
    anything.
    """

    name = "host"
    is_local = True
    loads_synchronously = True
    is_swap_target = True
    # measured in docs/offload.md (int8 SmolLM2 blocks)
    prior_read_latency_s = 0.1e-3
    prior_read_bytes_per_s = 650e6

    def __init__(self, config: HostConfig) -> None:
        self._index = LRUIndex(config.capacity_bytes)
        self._values: dict[bytes, bytes] = {}
        self._lock = threading.Lock()

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._values for key in keys]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        with self._lock:
            return [self._values[key] if self._index.touch(key) else None for key in keys]

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        stored = 0
        with self._lock:
            for key, value in items:
                if not self._index.fits(len(value)):
                    continue
                self._index.pop(key)
                for evicted in self._index.evict(len(value)):
                    del self._values[evicted]
                self._index.add(key, len(value))
                self._values[key] = value
                stored += 1
        return stored

    def remove(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                if self._index.pop(key) is not None:
                    del self._values[key]

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._values.clear()

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
            self._index.check_integrity("host tier")
            sizes = dict(self._index.items())
            assert sizes.keys() == self._values.keys(), "host tier: its index and its values hold different keys"
            wrong = [k for k, v in self._values.items() if len(v) != sizes[k]]
            assert not wrong, f"host tier indexes {len(wrong)} values at the wrong size"

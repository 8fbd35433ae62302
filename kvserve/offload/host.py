"""Host-memory tier: a dict in LRU order, bounded in bytes."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from kvserve.config import HostConfig
from kvserve.offload.base import Transport


class HostTransport(Transport):
    """Values in an OrderedDict, least recently used first; one lock guards it all.

    Invariant: ``nbytes_used == sum(len(v)) <= capacity_bytes``. A put evicts from the
    LRU end until the new value fits, before inserting it; a value larger than the whole
    capacity is refused without evicting anything.
    """

    name = "host"

    def __init__(self, config: HostConfig) -> None:
        self._capacity = config.capacity_bytes
        self._values: OrderedDict[bytes, bytes] = OrderedDict()
        self._nbytes = 0
        self._lock = threading.Lock()

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [key in self._values for key in keys]

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                value = self._values.get(key)
                if value is not None:
                    self._values.move_to_end(key)
                out.append(value)
        return out

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        stored = 0
        with self._lock:
            for key, value in items:
                if len(value) > self._capacity:
                    continue
                old = self._values.pop(key, None)
                if old is not None:
                    self._nbytes -= len(old)
                while self._nbytes + len(value) > self._capacity:
                    _, evicted = self._values.popitem(last=False)
                    self._nbytes -= len(evicted)
                self._values[key] = value
                self._nbytes += len(value)
                stored += 1
        return stored

    def remove(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                old = self._values.pop(key, None)
                if old is not None:
                    self._nbytes -= len(old)

    def close(self) -> None:
        with self._lock:
            self._values.clear()
            self._nbytes = 0

    @property
    def nbytes_used(self) -> int:
        return self._nbytes

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    def keys_lru_first(self) -> list[bytes]:
        """The keys held, least recently used first (the order evictions take)."""
        with self._lock:
            return list(self._values)

    def check_integrity(self) -> None:
        with self._lock:
            total = sum(len(v) for v in self._values.values())
            assert self._nbytes == total, f"host tier counts {self._nbytes} bytes, holds {total}"
            assert total <= self._capacity, f"host tier holds {total} bytes over its capacity {self._capacity}"

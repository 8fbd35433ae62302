"""Host-memory tier: a dict of values in LRU order, bounded in bytes."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.config import HostConfig
from kvserve.offload.lru import LRUTransport


class HostTransport(LRUTransport):
    """Values in a dict, next to the index of ``LRUTransport`` and under its lock.

    Invariant: ``nbytes_used == sum(len(v)) <= capacity_bytes``. A put evicts from the LRU
    end until the new value fits, before inserting it; a value larger than the whole
    capacity is refused without evicting anything.
    """

    name = "host"
    is_local = True
    loads_synchronously = True
    is_swap_target = True
    # measured in docs/offload.md (int8 SmolLM2 blocks)
    prior_read_latency_s = 0.1e-3
    prior_read_bytes_per_s = 650e6

    def __init__(self, config: HostConfig) -> None:
        super().__init__(config.capacity_bytes)
        self._values: dict[bytes, bytes] = {}

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
                self._evict(len(value))
                self._index.add(key, len(value))
                self._values[key] = value
                stored += 1
        return stored

    def close(self) -> None:
        with self._lock:
            self._index.clear()
            self._values.clear()

    def _drop_value(self, key: bytes) -> None:
        del self._values[key]

    def _check_values(self) -> None:
        sizes = dict(self._index.items())
        assert sizes.keys() == self._values.keys(), f"{self.name} tier: its index and its values hold different keys"
        wrong = [k for k, v in self._values.items() if len(v) != sizes[k]]
        assert not wrong, f"{self.name} tier indexes {len(wrong)} values at the wrong size"

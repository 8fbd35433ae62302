"""The block layer of a tier: payloads in, verified payloads out.

``BlockStore`` serializes each payload with its key and format tag (serialization.py)
before handing bytes to a Transport, and verifies every value it reads back. A value
that fails verification is deleted from the tier and answered as a miss: a corrupt
block is counted and logged, never returned.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from kvserve.offload.base import Transport
from kvserve.offload.serialization import HEADER_NBYTES, CorruptBlockError, Payload, decode_block, encode_block

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TierStats:
    """Counters of one tier since it was opened. Payload bytes only (headers excluded).

    ``read_seconds`` and ``write_seconds`` are wall time inside ``get`` / ``put``
    (transport, serialization and checksum included) over ``read_calls`` / ``write_calls``
    batched calls: what the load-or-recompute cost model needs to estimate a tier's
    bandwidth and per-call latency.
    """

    tier: str
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    blocks_written: int = 0
    puts_dropped: int = 0
    read_calls: int = 0
    write_calls: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0
    unavailable_periods: int = 0

    @property
    def read_bytes_per_s(self) -> float | None:
        return self.bytes_read / self.read_seconds if self.read_seconds > 0 else None

    @property
    def hit_rate(self) -> float | None:
        lookups = self.hits + self.misses
        return self.hits / lookups if lookups else None


def _plus(stats: TierStats, **deltas: float) -> TierStats:
    return replace(stats, **{name: getattr(stats, name) + delta for name, delta in deltas.items()})


class BlockStore:
    """Blocks of one KV format (``fmt_tag``) in one tier.

    Thread-safe when its transport is (all of ours are): calls may overlap, counters
    are updated under a lock once per call. ``get`` returns payloads as fresh bytes,
    safe to keep; ``put`` copies its payloads, so the caller may reuse its buffers as
    soon as it returns.
    """

    def __init__(self, transport: Transport, fmt_tag: bytes | str,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        """``timer``: seconds, for the read and write times counted (tests tick a fake one)."""
        self.transport = transport
        self._timer = timer
        self.fmt_tag = fmt_tag
        self._lock = threading.Lock()
        self._stats = TierStats(tier=transport.name)  # guarded by _lock; replaced, never mutated

    @property
    def tier(self) -> str:
        return self.transport.name

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is (probably) held; not verified, and not an access."""
        return self.transport.exists(keys)

    def get(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """Verified payload of each key, or None (absent, unreadable, or corrupt and now removed)."""
        start = self._timer()
        values = self.transport.get_many(keys)
        out: list[bytes | None] = []
        corrupt: list[bytes] = []
        for key, value in zip(keys, values):
            payload = None
            if value is not None:
                try:
                    payload = decode_block(value, key, self.fmt_tag)
                except CorruptBlockError as e:
                    logger.warning("%s tier: %s; removed, answered as a miss", self.tier, e)
                    corrupt.append(key)
            out.append(payload)
        if corrupt:
            self.transport.remove(corrupt)
        hits = sum(p is not None for p in out)
        with self._lock:
            self._stats = _plus(self._stats, hits=hits, misses=len(keys) - hits, corrupt=len(corrupt), read_calls=1,
                               bytes_read=sum(len(p) for p in out if p is not None),
                               read_seconds=self._timer() - start)
        return out

    def put(self, items: Sequence[tuple[bytes, Payload]]) -> int:
        """Store each (key, payload); returns how many the tier took (the rest are dropped, and counted)."""
        start = self._timer()
        encoded = [(key, encode_block(key, self.fmt_tag, payload)) for key, payload in items]
        stored = self.transport.put_many(encoded)
        # a transport reports a count, not which ones: bytes assume blocks of one size
        mean_nbytes = sum(len(v) - HEADER_NBYTES for _, v in encoded) / len(encoded) if encoded else 0
        with self._lock:
            self._stats = _plus(self._stats, blocks_written=stored, puts_dropped=len(items) - stored, write_calls=1,
                               bytes_written=round(stored * mean_nbytes),
                               write_seconds=self._timer() - start)
        return stored

    def remove(self, keys: Sequence[bytes]) -> None:
        self.transport.remove(keys)

    def stats(self) -> TierStats:
        with self._lock:
            stats = self._stats
        return replace(stats, unavailable_periods=self.transport.num_unavailable_periods)

    def close(self) -> None:
        self.transport.close()

    def check_integrity(self) -> None:
        self.transport.check_integrity()

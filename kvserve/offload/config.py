"""Frozen configs of the tiers, one per registry name (``host``, ``disk``, ``redis``)."""

from __future__ import annotations

from dataclasses import dataclass


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be positive, got {value}")


@dataclass(frozen=True)
class HostConfig:
    """Host (CPU) memory: an LRU dict bounded in bytes."""

    capacity_bytes: int

    def __post_init__(self) -> None:
        _positive("host tier capacity_bytes", self.capacity_bytes)


@dataclass(frozen=True)
class DiskConfig:
    """A directory of one file per block; persists across restarts.

    ``fsync`` flushes each file before it is renamed into place, so a power loss leaves
    either the whole block or none. Without it a kill -9 is still safe (the page cache
    survives the process); a power loss may leave a damaged file, which the checksum
    catches on read.
    """

    path: str
    capacity_bytes: int
    fsync: bool = True

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("disk tier needs a directory path")
        _positive("disk tier capacity_bytes", self.capacity_bytes)


@dataclass(frozen=True)
class RedisConfig:
    """A Redis server shared by engines. Keys are ``kvserve:{namespace}:{key hex}``.

    ``namespace`` should name the model and KV format so that engines that cannot use
    each other's blocks do not share a key space. The password, if any, goes in the URL
    (``redis://:secret@host:6379/0``). A server that does not answer within
    ``timeout_s`` is marked down; it is tried again after ``backoff_s``, doubling per
    failed try up to ``max_backoff_s``.
    """

    url: str
    namespace: str
    ttl_s: float | None = None
    timeout_s: float = 0.5
    backoff_s: float = 5.0
    max_backoff_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis tier url must start with redis://, rediss:// or unix://, got {self.url!r}")
        if not self.namespace or any(c.isspace() for c in self.namespace):
            raise ValueError(f"redis tier namespace must be non-empty without spaces, got {self.namespace!r}")
        if self.ttl_s is not None:
            _positive("redis tier ttl_s", self.ttl_s)
        _positive("redis tier timeout_s", self.timeout_s)
        _positive("redis tier backoff_s", self.backoff_s)
        if self.max_backoff_s < self.backoff_s:
            raise ValueError(f"redis tier max_backoff_s ({self.max_backoff_s}) is below backoff_s ({self.backoff_s})")

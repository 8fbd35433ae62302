"""The byte layer of a tier: values under 32-byte block keys.

A Transport knows nothing of blocks, formats or checksums; ``BlockStore`` (store.py)
sits on top and turns payloads into the serialized form and back. This is LMCache's
split between a storage backend and its connector.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

KEY_NBYTES = 32   # a block key: the sha256 content key kvserve/kv/prefix.py makes


class Transport(ABC):
    """Bytes under block keys, in one tier.

    Contract, for every implementation:

    * Thread-safe: any method may be called from several threads at once (the async
      wrapper runs puts and gets on a pool). A value is stored and read whole: a
      reader sees either the old value, the new one, or none, never a mix.
    * Batched: each call takes many keys, so a remote tier pays one round trip.
    * Never raises for a tier that is down, full or failing: reads answer misses,
      writes are dropped (and counted by the caller through ``put_many``'s result).
      It raises only for misuse (a key that is not 32 bytes, a closed transport).
    * A tier may lose any value at any time (eviction, TTL, restart); a hit is a
      hint that a ``get_many`` will likely succeed, not a promise.

    Traits: class attributes that decide how the engine uses a tier. Behaviour comes from
    them, never from ``name``, which is a label only (metrics, logs, the CLI word); a
    subclass inherits its parent's traits and overrides those that differ. The defaults
    describe the most cautious tier: remote, prefetched, written blindly, never a swap
    target, unmeasured.

    * ``is_local``: ``exists`` answers from this process's memory, cheap enough to call on
      the engine thread for every demotion; when the first tier is local, blocks it
      already holds are not copied off the device again.
    * ``loads_synchronously``: a read is a memory copy, so a run of hits held only by such
      tiers is loaded at admission; a run touching any other tier is prefetched while
      other requests run.
    * ``is_write_once``: a put skips keys the tier already holds (a key names one content,
      and a rewrite is costly here, e.g. an fsync).
    * ``is_swap_target``: as the first tier, it takes a preempted request's blocks at once
      when the cost model says a round trip beats recomputing them.
    * ``is_shared``: other engines read what this tier holds (a server many engines use), so
      with write-through (``EngineConfig.write_through``) every computed full block is
      written here at once rather than when the device evicts it.
    * ``prior_read_latency_s``, ``prior_read_bytes_per_s``: the cost model's estimate of a
      read call until the tier's own reads are measured (the defaults, 0 and infinity,
      make an unknown tier look free, so its first use measures it).
    """

    name: ClassVar[str]
    is_local: ClassVar[bool] = False
    loads_synchronously: ClassVar[bool] = False
    is_write_once: ClassVar[bool] = False
    is_swap_target: ClassVar[bool] = False
    is_shared: ClassVar[bool] = False
    prior_read_latency_s: ClassVar[float] = 0.0
    prior_read_bytes_per_s: ClassVar[float] = math.inf

    @abstractmethod
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key holds a value. Does not touch LRU order."""

    @abstractmethod
    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The value under each key, or None. A hit counts as an access for LRU order."""

    @abstractmethod
    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store each (key, value), replacing any old value; returns how many were stored.

        A value that cannot be stored (larger than the tier, tier down, I/O error) is
        dropped; a tier with a byte capacity evicts least recently used values first.
        """

    @abstractmethod
    def remove(self, keys: Sequence[bytes]) -> None:
        """Delete each key's value; a missing key is not an error."""

    @abstractmethod
    def close(self) -> None:
        """Release files, locks and connections. Idempotent; stored values persist where the tier is durable."""

    @property
    @abstractmethod
    def nbytes_used(self) -> int | None:
        """Bytes held (values plus their headers), or None where the tier cannot say cheaply."""

    @property
    @abstractmethod
    def capacity_bytes(self) -> int | None:
        """The byte capacity ``nbytes_used`` never exceeds, or None where the tier has no fixed one."""

    @property
    def is_available(self) -> bool:
        """False while a remote tier is down and calls are answered without trying it."""
        return True

    @property
    def num_unavailable_periods(self) -> int:
        """How many times the tier went from available to down."""
        return 0

    def check_integrity(self) -> None:
        """Raise AssertionError if the tier's own accounting is inconsistent. Tests call it."""

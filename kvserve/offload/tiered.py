"""The configured tiers in lookup order (host -> disk -> redis), as one store of blocks.

    demote(items)   write-through: every tier gets the payloads, asynchronously
    lookup(keys)    the longest leading run of keys that some tier holds
    submit_fetch    prefetch a run; the handle's ``result`` is the leading run of payloads

    keys      k0    k1    k2    k3    k4
    host      yes   no    yes   no    no
    disk      yes   yes   --    no    yes
    run       host  disk  host  (ends: k3 is in no tier; k4 cannot be used without it)

Write-through rather than write-back chains (host evicting into disk): the host tier
evicts inside its own lock with no hook, and a block dropped there would be lost. With
write-through disk and Redis hold every demoted block; a write-once tier (disk) skips
keys it already holds, since a key names one content and a rewrite costs an fsync.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvserve.config import RedisConfig, TierConfig
from kvserve.offload.async_tier import AsyncStats, AsyncTier
from kvserve.offload.base import Transport
from kvserve.offload.registry import make_transport
from kvserve.offload.serialization import Payload
from kvserve.offload.store import BlockStore, TierStats


class TierRun(NamedTuple):
    """Consecutive blocks found in the tiers: ``keys[i]`` is held by tier ``tiers[i]``."""

    keys: tuple[bytes, ...]
    tiers: tuple[int, ...]

    @property
    def num_blocks(self) -> int:
        return len(self.keys)

    def blocks_by_tier(self, num_tiers: int, num_blocks: int | None = None) -> tuple[int, ...]:
        """How many of the first ``num_blocks`` (all by default) each tier holds."""
        counts = [0] * num_tiers
        for t in self.tiers[:num_blocks]:
            counts[t] += 1
        return tuple(counts)


EMPTY_RUN = TierRun((), ())


class PendingFetch:
    """Gets in flight for one run, one call per tier that holds part of it."""

    def __init__(self, run: TierRun, futures: dict[int, cf.Future[list[bytes | None]]]) -> None:
        self.run = run
        self._futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self._futures.values())

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for every get; whether all are done."""
        return not cf.wait(list(self._futures.values()), timeout).not_done

    def result(self, timeout: float | None = None) -> list[bytes]:
        """Payloads of the run's leading blocks, up to the first miss (evicted, corrupt, tier down).

        Waits for the gets; AsyncTier futures never raise, a timeout does.
        """
        answers = {t: iter(f.result(timeout)) for t, f in self._futures.items()}
        out: list[bytes] = []
        for t in self.run.tiers:
            payload = next(answers[t])
            if payload is None:
                break
            out.append(payload)
        return out


class _WriteOnceStore(BlockStore):
    """A store whose puts skip keys it already holds (runs on the tier's worker thread)."""

    def put(self, items: Sequence[tuple[bytes, Payload]]) -> int:
        held = self.transport.exists([key for key, _ in items])
        return super().put([item for item, h in zip(items, held) if not h])


class TieredStore:
    """Tiers in lookup order. Thread-safety: call from one thread (the engine's); the
    tiers' own workers run in the background. With no tiers every call is a no-op."""

    def __init__(self, tiers: Sequence[AsyncTier]) -> None:
        self.tiers = list(tiers)
        self.names = tuple(t.store.tier for t in self.tiers)
        # each tier's traits (class attributes) decide how the engine uses it
        self.transports = tuple(t.store.transport for t in self.tiers)

    @property
    def num_tiers(self) -> int:
        return len(self.tiers)

    def demote(self, items: Sequence[tuple[bytes, bytes]], required: bool = False) -> None:
        """Submit ``items`` to every tier; returns at once (puts may be dropped, and are counted;
        ``required`` puts are queued even past a tier's ``max_pending``)."""
        if items:
            for tier in self.tiers:
                tier.submit_put(items, required=required)

    def write_through(self, items: Sequence[tuple[bytes, bytes]], tiers: Sequence[int]) -> None:
        """Submit ``items`` (newly computed blocks) to the tiers at indices ``tiers``; returns at once."""
        if items:
            for t in tiers:
                self.tiers[t].submit_put(items)

    def lookup(self, keys: Sequence[bytes]) -> TierRun:
        """The longest leading run of ``keys`` held by some tier, each by the first that holds it."""
        holder = self.holders(keys)
        n = next((i for i, h in enumerate(holder) if h is None), len(keys))
        return TierRun(tuple(keys[:n]), tuple(h for h in holder[:n] if h is not None))

    def holders(self, keys: Sequence[bytes]) -> list[int | None]:
        """Each key's first tier that holds it, or None.

        One ``contains`` per tier, on the calling thread; not an access for LRU order.
        """
        holder: list[int | None] = [None] * len(keys)
        for t, tier in enumerate(self.tiers):
            todo = [i for i, h in enumerate(holder) if h is None]
            if not todo:
                break
            for i, held in zip(todo, tier.contains([keys[i] for i in todo])):
                if held:
                    holder[i] = t
        return holder

    def submit_fetch(self, run: TierRun) -> PendingFetch:
        futures = {}
        for t in sorted(set(run.tiers)):
            futures[t] = self.tiers[t].submit_get([k for k, h in zip(run.keys, run.tiers) if h == t])
        return PendingFetch(run, futures)

    def stats(self) -> tuple[TierStats, ...]:
        return tuple(t.store.stats() for t in self.tiers)

    def async_stats(self) -> tuple[AsyncStats, ...]:
        return tuple(t.stats() for t in self.tiers)

    def flush(self) -> None:
        """Wait for every submitted put and get."""
        for tier in self.tiers:
            tier.flush()

    def close(self) -> None:
        """Finish pending puts and close every tier (releases the disk directory's lock)."""
        for tier in self.tiers:
            tier.close()

    def check_integrity(self) -> None:
        for tier in self.tiers:
            tier.store.check_integrity()


def with_namespace(tiers: Sequence[TierConfig], namespace: str) -> list[TierConfig]:
    """``tiers`` with ``namespace`` given to a Redis tier that names none."""
    return [dataclasses.replace(t, namespace=namespace) if isinstance(t, RedisConfig) and t.namespace is None else t
            for t in tiers]


def open_transports(tiers: Sequence[TierConfig], namespace: str) -> list[Transport]:
    """The transports of ``tiers``, in their (lookup) order; Redis keys under ``namespace``
    unless its config names one."""
    opened: list[Transport] = []
    try:
        for config in with_namespace(tiers, namespace):
            opened.append(make_transport(config))
    except BaseException:
        for transport in opened:   # a later tier failed to open: release the earlier ones (the disk lock)
            transport.close()
        raise
    return opened


def make_tiered_store(transports: Sequence[Transport], fmt_tag: str, write_through: bool = False,
                      timer: Callable[[], float] = time.perf_counter) -> TieredStore:
    """Tiers over ``transports`` (in lookup order) for blocks tagged ``fmt_tag``. With
    ``write_through`` the shared tiers are written once per key: a put skips keys the server
    already holds, so engines writing the same blocks send each over the wire once. ``timer``
    times each store's calls (BlockStore)."""
    def write_once(t: Transport) -> bool:
        return t.is_write_once or (write_through and t.is_shared)
    return TieredStore([AsyncTier((_WriteOnceStore if write_once(t) else BlockStore)(t, fmt_tag, timer))
                        for t in transports])

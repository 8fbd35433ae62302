"""Puts (write-back) and prefetch gets of one tier, run on a small thread pool.

The engine thread submits and moves on; a returned future resolves when the tier call
is done. Tier failures never reach the submitting thread: a failed call is counted and
logged, and its future resolves to the harmless answer (0 blocks stored, all misses).

    submit_put(items) --> in-flight map {key: payload} --> worker: store.put
                               ^   a later put of a key in it is coalesced (same key,
                               |   same content); a get of it is answered from it
    submit_get(keys)  ---------+--> worker: in-flight payloads first, then store.get

At most ``max_pending`` puts are queued or running; a put beyond that is dropped (counted)
and resolves at once, since a full queue means the tier is slower than the engine and
waiting for it would stall decoding. A ``required`` put (a pinned block being evicted: its
only copy) is queued regardless. Gets run on workers of their own, never behind a backlog of
puts and never dropped: each is a load the scheduler chose over recomputing, for a request
that waits on it (at most one per request), and a write-back queue a slow disk has filled
must not turn it into a recompute.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from kvserve.offload.serialization import Payload
from kvserve.offload.store import BlockStore

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class AsyncStats:
    puts_submitted: int = 0  # blocks
    gets_submitted: int = 0  # blocks
    coalesced: int = 0  # blocks whose put was already in flight
    dropped: int = 0  # puts refused because max_pending were pending
    inflight_hits: int = 0  # blocks a get took from a put still in flight
    errors: int = 0  # calls whose tier call raised


def _done(value: T) -> cf.Future[T]:
    future: cf.Future[T] = cf.Future()
    future.set_result(value)
    return future


class AsyncTier:
    """Asynchronous front of one BlockStore. Submit from any thread; futures never raise."""

    def __init__(self, store: BlockStore, num_workers: int = 2, max_pending: int = 64) -> None:
        if num_workers < 1 or max_pending < 1:
            raise ValueError(f"num_workers and max_pending must be >= 1, got {num_workers} and {max_pending}")
        self.store = store
        self._max_pending = max_pending
        self._pool = cf.ThreadPoolExecutor(num_workers, thread_name_prefix=f"kvserve-{store.tier}")
        self._reads = cf.ThreadPoolExecutor(num_workers, thread_name_prefix=f"kvserve-{store.tier}-read")
        # reentrant: a future that is already done runs its callback (_forget) inline
        self._lock = threading.RLock()
        self._inflight: dict[bytes, bytes] = {}
        self._pending: dict[cf.Future[Any], bool] = {}    # each call queued or running: whether a get
        self._stats = AsyncStats()
        self._closed = False

    def _count(self, **deltas: int) -> None:
        """Caller holds the lock."""
        self._stats = replace(self._stats, **{k: getattr(self._stats, k) + v for k, v in deltas.items()})

    def _submit(self, fn: Callable[[], T], fallback: T, required: bool = False,
                read: bool = False) -> cf.Future[T] | None:
        """Queue ``fn`` (a get: ``read``, on the read workers, never dropped); None if max_pending
        puts are pending (unless ``required``). Caller holds the lock."""
        if self._closed:
            raise RuntimeError(f"the async {self.store.tier} tier is closed")
        if not read and self._num_puts >= self._max_pending and not required:
            self._count(dropped=1)
            return None

        def run() -> T:
            try:
                return fn()
            except Exception:  # noqa: BLE001 - any tier failure is counted, never raised into the engine
                with self._lock:
                    self._count(errors=1)
                    first = self._stats.errors == 1
                (logger.exception if first else logger.debug)("%s tier call failed; counted", self.store.tier)
                return fallback
        future = (self._reads if read else self._pool).submit(run)
        self._pending[future] = read
        future.add_done_callback(self._forget)
        return future

    @property
    def _num_puts(self) -> int:
        return sum(not read for read in self._pending.values())

    def _forget(self, future: cf.Future[Any]) -> None:
        with self._lock:
            self._pending.pop(future, None)

    def submit_put(self, items: Sequence[tuple[bytes, Payload]], required: bool = False) -> cf.Future[int]:
        """Write ``items`` in the background; the future gives how many the tier stored.

        Payloads are copied before this returns (bytes objects are kept as they are). A
        ``required`` put is queued even when ``max_pending`` calls are pending.
        """
        owned = [(key, p if isinstance(p, bytes) else bytes(p)) for key, p in items]  # copied outside the lock
        with self._lock:
            fresh: dict[bytes, bytes] = {}
            for key, payload in owned:
                if key not in self._inflight and key not in fresh:
                    fresh[key] = payload
            self._count(puts_submitted=len(items), coalesced=len(items) - len(fresh))
            if not fresh:
                return _done(0)
            batch = list(fresh.items())

            def put() -> int:
                try:
                    return self.store.put(batch)
                finally:
                    with self._lock:
                        for key in fresh:
                            del self._inflight[key]
            future = self._submit(put, 0, required)
            if future is None:
                return _done(0)
            self._inflight.update(fresh)
            return future

    def submit_get(self, keys: Sequence[bytes]) -> cf.Future[list[bytes | None]]:
        """Read ``keys`` in the background (prefetch); the future gives payloads or None."""
        keys = list(keys)
        misses: list[bytes | None] = [None] * len(keys)

        def get() -> list[bytes | None]:
            with self._lock:
                out = [self._inflight.get(key) for key in keys]
                self._count(inflight_hits=sum(p is not None for p in out))
            todo = [i for i, p in enumerate(out) if p is None]
            if todo:
                for i, payload in zip(todo, self.store.get([keys[i] for i in todo])):
                    out[i] = payload
            return out
        with self._lock:
            self._count(gets_submitted=len(keys))
            future = self._submit(get, misses, read=True)
        assert future is not None, "a get is never dropped"
        return future

    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is held or its put is in flight (so a get would find it).

        Runs on the calling thread: one ``exists`` call on the tier for the keys not
        in flight (a dict lookup for host and disk, one round trip for Redis).
        """
        with self._lock:
            held = [key in self._inflight for key in keys]
        todo = [i for i, h in enumerate(held) if not h]
        if todo:
            for i, h in zip(todo, self.store.contains([keys[i] for i in todo])):
                held[i] = h
        return held

    def flush(self) -> None:
        """Wait until every call submitted so far has finished."""
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                return
            cf.wait(pending)

    def close(self) -> None:
        """Finish pending calls, stop the workers and close the store. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._pool.shutdown(wait=True)
        self._reads.shutdown(wait=True)
        self.store.close()

    def stats(self) -> AsyncStats:
        with self._lock:
            return self._stats

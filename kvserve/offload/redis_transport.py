"""Redis tier: blocks shared by every engine that talks to one server.

Keys are ``kvserve:{namespace}:{key hex}``; a multi-get is one ``MGET``, a multi-put
one pipeline of ``SET`` (with ``PX`` when a TTL is set). Capacity and eviction are the
server's (``maxmemory`` with ``allkeys-lru`` is the natural setting).

A server that refuses, drops or stalls a connection must not stall the engine: every
socket operation times out after ``timeout_s`` (0.5 s by default) and redis-py's own
retries are off. The first failure marks the tier down and logs once; until the
backoff expires every call answers misses / drops puts without touching the network.
The next call after it probes the server: success brings hits back (logged once),
failure doubles the backoff, up to a cap. The backoff reads an injected clock
(``time.monotonic`` by default), so tests can step it instead of sleeping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from kvserve.config import RedisConfig
from kvserve.offload.base import Transport

logger = logging.getLogger(__name__)

T = TypeVar("T")

# failures that mean "the server is not there", as opposed to a refused command
_DOWN_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


class RedisTransport(Transport):
    name = "redis"
    is_shared = True           # every engine on the server reads it: the tier write-through feeds
    # measured in docs/offload.md (int8 SmolLM2 blocks, loopback server)
    prior_read_latency_s = 0.3e-3
    prior_read_bytes_per_s = 300e6

    def __init__(self, config: RedisConfig, clock: Callable[[], float] = time.monotonic) -> None:
        """``clock``: seconds, never going back; it times the backoff only (socket timeouts are real)."""
        self._config = config
        self._clock = clock
        self._client = redis.Redis.from_url(
            config.url, socket_timeout=config.timeout_s, socket_connect_timeout=config.timeout_s,
            retry=Retry(NoBackoff(), 0), retry_on_timeout=False, health_check_interval=0)
        self._prefix = f"kvserve:{config.namespace}:".encode()
        self._px = None if config.ttl_s is None else max(1, round(config.ttl_s * 1000))
        # availability state, guarded by _state_lock; calls themselves run unlocked
        self._state_lock = threading.Lock()
        self._available = True
        self._retry_at = 0.0
        self._backoff_s = config.backoff_s
        self._down_since = 0.0
        self._num_down = 0
        self._num_errors = 0
        self._closed = False

    def _name(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode()

    # -- availability ------------------------------------------------------------
    def _call(self, what: str, fn: Callable[[], T], fallback: T) -> T:
        if self._closed:
            raise RuntimeError("redis tier is closed")
        with self._state_lock:
            if not self._available and self._clock() < self._retry_at:
                return fallback
        try:
            result = fn()
        except _DOWN_ERRORS as e:
            self._mark_down(e)
            return fallback
        except redis.RedisError as e:  # the server answered but refused (OOM, READONLY, ...)
            with self._state_lock:
                self._num_errors += 1
                first = self._num_errors == 1
            log = logger.warning if first else logger.debug
            log("redis tier %s: %s failed: %s (counted; first of its kind is logged)", self._where(), what, e)
            return fallback
        self._mark_up()
        return result

    def _where(self) -> str:
        kwargs = self._client.connection_pool.connection_kwargs
        if "path" in kwargs:
            return str(kwargs["path"])
        return f"{kwargs.get('host')}:{kwargs.get('port')}"

    def _mark_down(self, error: Exception) -> None:
        with self._state_lock:
            now = self._clock()
            if self._available:
                self._available = False
                self._num_down += 1
                self._down_since = now
                self._backoff_s = self._config.backoff_s
                logger.warning("redis tier %s is unavailable (%s); reads are misses and writes are dropped; "
                               "retrying in %.1f s", self._where(), error, self._backoff_s)
            else:
                self._backoff_s = min(self._backoff_s * 2, self._config.max_backoff_s)
            self._retry_at = now + self._backoff_s

    def _mark_up(self) -> None:
        with self._state_lock:
            if self._available:
                return
            self._available = True
            self._backoff_s = self._config.backoff_s
            down_s = self._clock() - self._down_since
        logger.warning("redis tier %s is back after %.1f s", self._where(), down_s)

    @property
    def is_available(self) -> bool:
        return self._available

    @property
    def num_unavailable_periods(self) -> int:
        return self._num_down

    # -- Transport ---------------------------------------------------------------
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        if not keys:
            return []

        def run() -> list[bool]:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(self._name(key))
            return [bool(n) for n in pipe.execute()]
        return self._call("EXISTS", run, [False] * len(keys))

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []

        def run() -> list[bytes | None]:
            # decode_responses is off: every value is bytes or None
            return [v if isinstance(v, bytes) else None for v in self._client.mget([self._name(k) for k in keys])]
        misses: list[bytes | None] = [None] * len(keys)
        return self._call("MGET", run, misses)

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        if not items:
            return 0

        def run() -> int:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items:
                pipe.set(self._name(key), value, px=self._px)
            return sum(1 for ok in pipe.execute() if ok)
        return self._call("SET", run, 0)

    def remove(self, keys: Sequence[bytes]) -> None:
        if keys:
            self._call("DEL", lambda: self._client.delete(*[self._name(k) for k in keys]), 0)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._client.close()

    def _memory_info(self) -> dict[str, Any]:
        empty: dict[str, Any] = {}
        info: dict[str, Any] = self._call("INFO", lambda: dict(self._client.info("memory")), empty)
        return info

    @property
    def nbytes_used(self) -> int | None:
        """The server's ``used_memory`` (all namespaces, one round trip), None while down."""
        used = self._memory_info().get("used_memory")
        return None if used is None else int(used)

    @property
    def capacity_bytes(self) -> int | None:
        """The server's ``maxmemory``; None when unlimited (0) or while down."""
        limit = self._memory_info().get("maxmemory")
        return int(limit) if limit else None

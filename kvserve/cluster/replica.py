"""``EngineReplica``: one engine (an ``AsyncEngine``, as the single server runs it) as a Ray
Serve deployment replica.

Its methods are what the ingress and the router call:

``generate(hint, specs, prefix)``  a stream: ``Accepted(replica)`` or ``Rejected(message)``,
                                   then the ``StreamItem``s of the requests; cancelling the
                                   stream aborts them (their blocks are freed at once)
``record_routing_stats()``         Serve's hook, polled by the controller every stats period:
                                   the digests of the block keys on the device (index.py)
``describe()``                     the ``ModelCard``: tokenizer, limits, block keys' inputs
``stats()`` ``call(fn)``           ``ReplicaStats`` for /metrics; ``fn(engine)`` between steps
``pid()``                          the process id (tests kill it)
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from ray import serve

from kvserve.cluster.wire import Accepted, Rejected, RouteHint, key_tag, pack
from kvserve.engine.engine import LLMEngine
from kvserve.engine.model_card import ModelCard
from kvserve.engine.stats import EngineStats
from kvserve.options import engine_config
from kvserve.server.async_engine import AsyncEngine, NullObserver, RequestSpec, StreamItem

MAX_PUBLISHED_BLOCKS = 1 << 16     # 512 KiB of digests per replica per publication at most


@dataclass(frozen=True)
class ReplicaStats:
    replica: str
    pid: int
    engine: EngineStats


class EngineReplica:
    def __init__(self, model: str | None, options: dict[str, Any]) -> None:
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self._async = AsyncEngine(LLMEngine(engine_config(model, **options)), NullObserver())
        self._async.start()
        self._card = self._async.model_card
        self._tag = key_tag(self._card.extra_key)
        self._version = 0
        self._published_keys: list[bytes] | None = None

    async def generate(self, hint: RouteHint, specs: list[RequestSpec], prefix: str) -> AsyncIterator[object]:
        try:
            stream = await self._async.submit(specs, prefix)
        except ValueError as e:          # bad input the engine refused: the client's 400
            yield Rejected(str(e))
            return
        yield Accepted(self.replica_id)
        try:
            async for item in stream.outputs():      # failed requests too: the ingress fails them alone
                yield StreamItem(item.choice, item.output)
        finally:
            stream.close()               # cancelled (client gone, ingress gave up): abort what is left

    async def record_routing_stats(self) -> dict[str, Any]:
        keys, stats = await self._async.call(lambda engine: (engine.cached_keys(), engine.stats()))
        keys = keys[-MAX_PUBLISHED_BLOCKS:]          # the most recently cached
        if keys != self._published_keys:             # a new version only when the set changed
            self._version += 1
            self._published_keys = keys
        return {"kv_version": self._version, "kv_key_tag": self._tag, "kv_digests": pack(keys),
                "num_waiting": stats.num_waiting, "num_running": stats.num_running}

    def describe(self) -> ModelCard:
        return self._card

    async def stats(self) -> ReplicaStats:
        return ReplicaStats(self.replica_id, os.getpid(), await self._async.call(lambda engine: engine.stats()))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        return await self._async.call(fn)

    def pid(self) -> tuple[str, int]:
        return self.replica_id, os.getpid()

    def check_health(self) -> None:
        if not self._async.is_running:
            raise RuntimeError(f"the engine thread of replica {self.replica_id} is not running")

    def __del__(self) -> None:
        self._async.stop()
        self._async.engine.close()

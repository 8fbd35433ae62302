"""``KVAwareRouter``: Ray Serve's request router for the engine replicas (docs/cluster.md).

Serve calls ``choose_replicas`` once per routing attempt with the running replicas; we
answer ranks: the replica holding the most of the request's KV first (its longest cached
prefix, plus the stored segments of a prompt given with segments: ``PrefixIndex.score``;
unless it is overloaded, ``index.choose``), then a random pair. Serve probes queue lengths and
sends the request to the least loaded replica of the first rank with room, and calls
``on_request_routed`` when a replica accepted it.

It is not FIFO (no ``FIFOMixin``): a replica chosen for a request's prefix must serve that
request, not the oldest one waiting.
"""

from __future__ import annotations

import random
import time
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, ReplicaResult, RequestRouter, RunningReplica

from kvserve.cluster.index import DEFAULT_MIN_CACHED_SHARE, PrefixIndex, choose
from kvserve.cluster.wire import Published, RouteHint, unpack

DEFAULT_MAX_IMBALANCE = 2        # ongoing requests a holder may carry beyond the least loaded replica (index.load_bound)


def published_of(stats: dict[str, Any]) -> Published | None:
    """The ``Published`` digests in a replica's routing stats (None before its first report)."""
    if "kv_version" not in stats:
        return None
    return Published(stats["kv_version"], stats["kv_key_tag"], unpack(stats["kv_digests"]))


class KVAwareRouter(RequestRouter):
    def initialize_state(self, max_imbalance: int = DEFAULT_MAX_IMBALANCE, overlay_ttl_s: float = 10.0,
                         seed: int | None = None, with_segments: bool = True,
                         min_cached_share: float = DEFAULT_MIN_CACHED_SHARE, **kwargs: Any) -> None:
        self.max_imbalance = max_imbalance
        self.min_cached_share = min_cached_share
        self.with_segments = with_segments      # False: prefix blocks only (``--routing kv-prefix``)
        self.index = PrefixIndex(overlay_ttl_s)
        self._rng = random.Random(seed)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        hint = _hint_of(pending_request)
        candidates = candidate_replicas
        if hint is not None and hint.exclude:
            # a request that failed on a replica goes elsewhere, unless nothing else is left
            candidates = [r for r in candidate_replicas if r.replica_id.unique_id not in hint.exclude] or candidates
        by_id = {r.replica_id.unique_id: r for r in candidates}
        for rid, r in by_id.items():
            self._refresh(rid, r)
        now = time.time()
        if hint is None:
            matches, min_score = dict.fromkeys(by_id, 0.0), 0.0
        else:
            matches = {rid: self.index.score(rid, hint, now, self.with_segments) for rid in by_id}
            min_score = self.min_cached_share * len(hint.digests)
        loads = {rid: self._load(r) for rid, r in by_id.items()}
        choice = choose(matches, loads, self.max_imbalance, self._rng, min_score)
        if hint is not None:
            hint.holder, hint.holder_blocks = choice.holder, choice.holder_blocks
        return [[by_id[rid] for rid in rank] for rank in choice.ranks]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID,
                          result: ReplicaResult) -> None:
        hint = _hint_of(pending_request)
        if hint is not None:
            hint.routed_to = replica_id.unique_id
            # the replica will hold the prompt's blocks before its next publication says so
            # (and the segments it has not stored yet: blending stores them first)
            self.index.note_routed(replica_id.unique_id, hint.all_digests(), time.time())

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.retain({r.replica_id.unique_id for r in replicas})

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.retain({r.unique_id for r in self.curr_replicas})

    def _refresh(self, rid: str, replica: RunningReplica) -> None:
        stats = replica.routing_stats or {}
        version = stats.get("kv_version")
        if version is not None and version != self.index.version(rid):
            published = published_of(stats)
            if published is not None:
                self.index.publish(rid, published)

    def _load(self, replica: RunningReplica) -> int:
        """Ongoing requests as Serve's queue-length cache has them (updated on every send and
        completion); a replica not in it counts as idle."""
        queue_len = self.replica_queue_len_cache.get(replica.replica_id)
        return 0 if queue_len is None else int(queue_len)


def _hint_of(pending_request: PendingRequest | None) -> RouteHint | None:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, RouteHint) else None

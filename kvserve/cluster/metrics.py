"""The ingress's ``/metrics``: the single server's request-level series, plus the fleet.

Request-level series (``kvserve_requests_total``, tokens, TTFT, ...) keep their names and
come from the outputs the ingress relays. Per-replica series come from each replica's
``EngineStats``, fetched every ``poll_s`` by a broadcast (so they are up to ``poll_s``
old); the router's outcomes and the ingress's retries are counted here as they happen.

| series | what |
| --- | --- |
| `kvserve_cluster_replicas` | replicas that answered the last poll |
| `kvserve_cluster_replica_requests{replica,state}` | waiting / loading / running: queue lengths |
| `kvserve_cluster_replica_prefix_query_tokens_total{replica}` | prompt tokens looked up |
| `kvserve_cluster_replica_prefix_hit_tokens_total{replica,tier}` | served from the device / each tier |
| `kvserve_cluster_prefix_hit_rate{replica,tier}` | hit tokens / query tokens; `replica="fleet"` sums all |
| `kvserve_cluster_routed_requests_total{replica,outcome}` | `holder`: sent to the replica holding the most of its KV (prefix and segments); `away`: a holder existed but was too loaded; `cold`: no replica held any of it |
| `kvserve_cluster_routed_to_holder_ratio` | holder / (holder + away) |
| `kvserve_cluster_retries_total`, `kvserve_cluster_replica_failures_total{replica}` | requests sent again after a replica failed before their first output; failures seen |
| `kvserve_cluster_time_to_first_output_seconds` | at the ingress: routing, queueing and prefill |
| `kvserve_cluster_replica_write_through_blocks_total{replica,tier}` | blocks written through |
| `kvserve_cluster_replica_segment_tokens_total{replica,kind}` | prompts given with segments: `reused` tokens whose KV came from a stored segment, `stored` segment tokens computed standalone and stored |
| `kvserve_cluster_tenant_cached_blocks{replica,tenant}`, `kvserve_cluster_tenant_pins{replica,tenant}` | each configured tenant's device blocks and pinned prefixes per replica, `replica="fleet"` their sum (counts only, never a key or a salt) |
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from collections.abc import Iterator
from typing import Any

from prometheus_client import Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.cluster.wire import RouteHint
from kvserve.server.metrics import TTFT_BUCKETS_S, ServerMetrics

log = logging.getLogger("kvserve.cluster")
FLEET = "fleet"


class FleetMetrics:
    """Owned by the ingress's event loop; ``server`` is the single server's ServerMetrics."""

    def __init__(self, poll_s: float = 1.0, tenants: tuple[str, ...] = ()) -> None:
        self.server = ServerMetrics(tenants)
        self.tenants = tuple(sorted(set(tenants)))
        r = self.server.registry
        self.poll_s = poll_s
        self.replica_stats: dict[str, Any] = {}      # replica id -> its ReplicaStats (last poll)
        self.outcomes: Tally[tuple[str, str]] = Tally()
        self.retries = Counter("kvserve_cluster_retries", "Requests sent again after their replica failed "
                               "before their first output", registry=r)
        self.resumes = Counter("kvserve_cluster_resumes", "Streams that went on on another replica after "
                               "theirs failed mid-stream", registry=r)
        self.failures = Counter("kvserve_cluster_replica_failures", "Replica failures seen by the ingress",
                                ["replica"], registry=r)
        self.first_output = Histogram("kvserve_cluster_time_to_first_output_seconds",
                                      "Ingress time from routing to a request's first output",
                                      buckets=TTFT_BUCKETS_S, registry=r)
        r.register(_FleetCollector(self))
        self._poller: asyncio.Task[None] | None = None

    def start(self, handle: Any) -> None:
        """Poll every replica's stats (from the ingress's running event loop)."""
        if self._poller is None:
            self._poller = asyncio.get_running_loop().create_task(self._poll(handle))

    def stop(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            self._poller = None

    def on_first_output(self, hint: RouteHint, replica: str | None, seconds: float) -> None:
        self.first_output.observe(seconds)
        served = replica or hint.routed_to or "unknown"
        if hint.holder is None:
            outcome = "cold"
        else:
            outcome = "holder" if hint.holder == served else "away"
        self.outcomes[(served, outcome)] += 1

    def on_replica_failure(self, replica: str | None, retried: bool, resumed: bool = False) -> None:
        """``retried``: the request goes to another replica; ``resumed``: it had streamed, and goes
        on there from what it streamed."""
        self.failures.labels(replica or "unknown").inc()
        if retried:
            (self.resumes if resumed else self.retries).inc()

    async def refresh(self, handle: Any) -> None:
        results = await handle.broadcast("stats").results_async(timeout_s=max(5.0, 5 * self.poll_s),
                                                                  return_exceptions=True)
        self.replica_stats = {s.replica: s for s in results if not isinstance(s, BaseException)}

    async def _poll(self, handle: Any) -> None:
        while True:
            try:
                await self.refresh(handle)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.debug("polling the replicas' stats failed", exc_info=True)
            await asyncio.sleep(self.poll_s)


class _FleetCollector(Collector):
    def __init__(self, fleet: FleetMetrics) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[Metric]:
        stats = dict(sorted(self.fleet.replica_stats.items()))
        yield GaugeMetricFamily("kvserve_cluster_replicas", "Engine replicas that answered the last poll", len(stats))
        queues = GaugeMetricFamily("kvserve_cluster_replica_requests", "Requests per replica and state",
                                   labels=["replica", "state"])
        queries = CounterMetricFamily("kvserve_cluster_replica_prefix_query_tokens",
                                      "Prompt tokens looked up in the prefix cache", labels=["replica"])
        hits = CounterMetricFamily("kvserve_cluster_replica_prefix_hit_tokens",
                                   "Prompt tokens served from a cache tier", labels=["replica", "tier"])
        rates = GaugeMetricFamily("kvserve_cluster_prefix_hit_rate", "Prompt tokens served from a cache tier "
                                  "over those looked up; replica=fleet sums every replica", labels=["replica", "tier"])
        written = CounterMetricFamily("kvserve_cluster_replica_write_through_blocks",
                                      "Computed blocks a replica wrote through to a shared tier",
                                      labels=["replica", "tier"])
        segments = CounterMetricFamily("kvserve_cluster_replica_segment_tokens",
                                       "Prompts given with segments: tokens whose KV a stored segment gave (reused), "
                                       "segment tokens computed standalone and stored (stored)",
                                       labels=["replica", "kind"])
        fleet_query = 0
        fleet_hits: Tally[str] = Tally()
        for replica, s in stats.items():
            e = s.engine
            for state, n in (("waiting", e.num_waiting), ("loading", e.num_loading), ("running", e.num_running)):
                queues.add_metric([replica, state], n)
            queries.add_metric([replica], e.prefix_query_tokens)
            per_tier = {"device": e.prefix_hit_tokens, **{t.tier: t.hit_tokens for t in e.tiers}}
            for tier, n in per_tier.items():
                hits.add_metric([replica, tier], n)
                rates.add_metric([replica, tier], n / e.prefix_query_tokens if e.prefix_query_tokens else 0.0)
                fleet_hits[tier] += n
            for t in e.tiers:
                written.add_metric([replica, t.tier], t.write_through_blocks)
            segments.add_metric([replica, "reused"], e.blend.reused_tokens)
            segments.add_metric([replica, "stored"], e.blend.stored_tokens)
            fleet_query += e.prefix_query_tokens
        for tier, n in fleet_hits.items():
            rates.add_metric([FLEET, tier], n / fleet_query if fleet_query else 0.0)
        rates.add_metric([FLEET, "all"], sum(fleet_hits.values()) / fleet_query if fleet_query else 0.0)
        yield from (queues, queries, hits, rates, written, segments)
        if self.fleet.tenants:
            yield from _tenant_metrics(stats, self.fleet.tenants)
        routed = CounterMetricFamily("kvserve_cluster_routed_requests", "Requests by the replica that served them "
                                     "and the routing outcome (holder, away, cold)", labels=["replica", "outcome"])
        for (replica, outcome), n in sorted(self.fleet.outcomes.items()):
            routed.add_metric([replica, outcome], n)
        yield routed
        by_outcome: Tally[str] = Tally()
        for (_, outcome), n in self.fleet.outcomes.items():
            by_outcome[outcome] += n
        decided = by_outcome["holder"] + by_outcome["away"]
        yield GaugeMetricFamily("kvserve_cluster_routed_to_holder_ratio", "Requests sent to the replica holding "
                                "the most of their KV, over those some replica held",
                                by_outcome["holder"] / decided if decided else 0.0)


def _tenant_metrics(stats: dict[str, Any], tenants: tuple[str, ...]) -> Iterator[Metric]:
    """Each tenant's share of each replica's device cache, and of the fleet's: counts only."""
    blocks = GaugeMetricFamily("kvserve_cluster_tenant_cached_blocks", "Device KV blocks holding a key of the "
                               "tenant's namespaces (used or not), per replica; replica=fleet sums them",
                               labels=["replica", "tenant"])
    pinned = GaugeMetricFamily("kvserve_cluster_tenant_pins", "The tenant's pinned prefixes per replica; "
                               "replica=fleet sums them", labels=["replica", "tenant"])
    fleet_blocks: Tally[str] = Tally()
    fleet_pins: Tally[str] = Tally()
    for replica, s in stats.items():
        cached, pins = dict(s.engine.kv_cached_blocks_by_tenant), dict(s.engine.pins.pins_by_tenant)
        for tenant in tenants:
            blocks.add_metric([replica, tenant], cached.get(tenant, 0))
            pinned.add_metric([replica, tenant], pins.get(tenant, 0))
            fleet_blocks[tenant] += cached.get(tenant, 0)
            fleet_pins[tenant] += pins.get(tenant, 0)
    for tenant in tenants:
        blocks.add_metric([FLEET, tenant], fleet_blocks[tenant])
        pinned.add_metric([FLEET, tenant], fleet_pins[tenant])
    yield from (blocks, pinned)

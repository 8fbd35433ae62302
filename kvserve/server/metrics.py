"""Prometheus metrics: an engine observer fed once per step, rendered by ``GET /metrics``.

Request-level series (tokens, time to first token, per-token latency) are updated from
the step's outputs; engine-level series (queues, KV usage, prefix hits) are read from
the last ``EngineStats`` snapshot when scraped. Each server has its own registry: no
process-global state, so several servers (tests) can live in one process.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvserve.engine.outputs import RequestOutput
from kvserve.engine.stats import EngineStats
from kvserve.offload.cost import CostSnapshot

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS_S = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0)
E2E_BUCKETS_S = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class _Progress(NamedTuple):
    num_tokens: int
    last_token_time: float


class _StatsCollector(Collector):
    """Engine-level series from the latest snapshot (set by the engine thread); per tenant for
    ``tenants`` (the server's, none without tenants)."""

    def __init__(self, tenants: tuple[str, ...] = ()) -> None:
        self.stats: EngineStats | None = None
        self.tenants = tenants

    def collect(self) -> Iterator[Metric]:
        s = self.stats
        if s is None:
            return
        yield GaugeMetricFamily("kvserve_num_requests_waiting", "Requests waiting to be admitted", s.num_waiting)
        yield GaugeMetricFamily("kvserve_num_requests_running", "Requests in the running batch", s.num_running)
        yield GaugeMetricFamily("kvserve_kv_cache_usage_ratio",
                                "Fraction of KV blocks referenced by running requests", s.kv_usage)
        yield GaugeMetricFamily("kvserve_kv_blocks", "KV blocks in the device pool", s.kv_num_blocks)
        yield GaugeMetricFamily("kvserve_kv_free_blocks", "KV blocks free or evictable", s.kv_num_free_blocks)
        yield GaugeMetricFamily("kvserve_kv_cached_blocks", "KV blocks holding a prefix-cache key",
                                s.kv_num_cached_blocks)
        by_kind = GaugeMetricFamily("kvserve_kv_used_blocks",
                                    "KV blocks running requests hold, by the attention kind of their layer group "
                                    "(full; sliding: only the blocks a window reaches)", labels=["kind"])
        for kind, num in s.kv_used_blocks_by_kind:
            by_kind.add_metric([kind], num)
        yield by_kind
        yield CounterMetricFamily("kvserve_engine_steps", "Engine steps run", s.num_steps)
        yield CounterMetricFamily("kvserve_preemptions", "Requests preempted", s.num_preemptions)
        yield CounterMetricFamily("kvserve_kv_evicted_blocks", "Cached blocks evicted for reuse",
                                  s.num_evicted_blocks)
        yield CounterMetricFamily("kvserve_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache",
                                  s.prefix_query_tokens)
        hits = CounterMetricFamily("kvserve_prefix_cache_hit_tokens", "Prompt tokens served from a cache tier",
                                   labels=["tier"])
        hits.add_metric(["device"], s.prefix_hit_tokens)
        for t in s.tiers:
            hits.add_metric([t.tier], t.hit_tokens)
        yield hits
        b = s.budgets
        yield CounterMetricFamily("kvserve_kv_budget_compactions", "Compactions of budgeted requests' KV",
                                  b.num_compactions)
        yield GaugeMetricFamily("kvserve_kv_budget_host_bytes",
                                "Bytes of blocks arkvale (or a zip format's prompts) holds in host memory",
                                b.host_nbytes)
        yield CounterMetricFamily("kvserve_kv_budget_host_evicted_blocks",
                                  "Blocks arkvale's host store dropped for room (no longer recallable), or finer "
                                  "copies a zip format's prompt dropped with no room to hold them",
                                  b.num_host_evictions)
        yield from _pin_metrics(s)
        if self.tenants:
            yield from _tenant_metrics(s, self.tenants)
        yield from _blend_metrics(s)
        yield from _spec_metrics(s)
        yield from _tier_metrics(s)


def _tenant_metrics(s: EngineStats, tenants: tuple[str, ...]) -> Iterator[Metric]:
    """Each tenant's share of the device cache: counts only (never a key or a salt)."""
    cached = dict(s.kv_cached_blocks_by_tenant)
    pins = dict(s.pins.pins_by_tenant)
    blocks = GaugeMetricFamily("kvserve_tenant_cached_blocks", "Device KV blocks holding a key of the tenant's "
                               "namespaces (used or not)", labels=["tenant"])
    pinned = GaugeMetricFamily("kvserve_tenant_pins", "The tenant's pinned prefixes", labels=["tenant"])
    for tenant in tenants:
        blocks.add_metric([tenant], cached.get(tenant, 0))
        pinned.add_metric([tenant], pins.get(tenant, 0))
    yield from (blocks, pinned)


def _blend_metrics(s: EngineStats) -> Iterator[Metric]:
    b = s.blend
    yield CounterMetricFamily("kvserve_blend_requests", "Segmented prompts blended (kvserve/blend/)", b.num_blended)
    yield CounterMetricFamily("kvserve_blend_declined_requests",
                              "Segmented prompts the cost model sent to a full prefill", b.num_declined)
    yield CounterMetricFamily("kvserve_blend_reused_tokens", "Prompt tokens whose KV came from stored segments",
                              b.reused_tokens)
    yield CounterMetricFamily("kvserve_blend_recomputed_tokens", "Reused segment tokens that blending recomputed",
                              b.recomputed_tokens)
    yield CounterMetricFamily("kvserve_blend_computed_tokens",
                              "Blended prompts' tokens computed in full (neither cached nor reused)",
                              b.computed_tokens)
    yield CounterMetricFamily("kvserve_segment_stored_tokens", "Segment tokens computed standalone and stored",
                              b.stored_tokens)


def _spec_metrics(s: EngineStats) -> Iterator[Metric]:
    """Speculative decoding's counters, labelled by proposer (none when the engine does not speculate)."""
    if s.spec is None:
        return
    for name, doc, value in (
            ("kvserve_spec_drafts", "Chunks that carried drafted tokens", s.spec.num_drafts),
            ("kvserve_spec_draft_tokens", "Drafted tokens checked by the model", s.spec.num_draft_tokens),
            ("kvserve_spec_accepted_tokens", "Drafted tokens accepted", s.spec.num_accepted_tokens),
            ("kvserve_spec_rejected_tokens", "Drafted tokens rejected",
             s.spec.num_draft_tokens - s.spec.num_accepted_tokens),
            ("kvserve_spec_skipped_drafts", "Drafts not made because they would not pay (kvserve/speculative/cost.py)",
             s.spec.num_skipped)):
        family = CounterMetricFamily(name, doc, labels=["method"])
        family.add_metric([s.spec.method], value)
        yield family


def _pin_metrics(s: EngineStats) -> Iterator[Metric]:
    """Pinned prefixes (docs/server.md, "Cache control")."""
    p = s.pins
    yield GaugeMetricFamily("kvserve_pins", "Pinned prefixes", p.num_pins)
    yield GaugeMetricFamily("kvserve_pinned_blocks", "Device KV blocks holding a pinned key", p.num_pinned_blocks)
    yield GaugeMetricFamily("kvserve_pin_covered_blocks", "Distinct block keys the pins cover (on the device or not)",
                            p.num_pinned_keys)
    yield GaugeMetricFamily("kvserve_pin_limit_blocks", "Most block keys pins may cover (max_pinned_fraction)",
                            p.max_pinned_blocks)
    yield CounterMetricFamily("kvserve_pin_hit_tokens", "Prompt tokens served from pinned device blocks",
                              s.pin_hit_tokens)
    yield CounterMetricFamily("kvserve_pin_expirations", "Pins whose retention time ran out", p.num_expired)
    yield CounterMetricFamily("kvserve_pinned_evicted_blocks",
                              "Pinned blocks evicted for room (demoted to the offload tiers when there are any)",
                              p.num_evicted_blocks)


def _tier_metrics(s: EngineStats) -> Iterator[Metric]:
    """Offload tiers (host, disk, redis), one label value each; nothing when none is configured."""
    if not s.tiers:
        return
    loaded = CounterMetricFamily("kvserve_offload_loaded_tokens",
                                 "Tokens loaded from an offload tier instead of recomputed", labels=["tier"])
    moved = CounterMetricFamily("kvserve_offload_bytes", "Payload bytes moved between the device and a tier",
                                labels=["tier", "direction"])
    seconds = CounterMetricFamily("kvserve_offload_load_seconds",
                                  "Engine time spent waiting for and writing tier loads", labels=["tier"])
    corrupt = CounterMetricFamily("kvserve_offload_corrupt_blocks",
                                  "Blocks that failed verification (removed, recomputed)", labels=["tier"])
    dropped = CounterMetricFamily("kvserve_offload_dropped_writes",
                                  "Blocks a tier did not store (full queue, tier down, too large)", labels=["tier"])
    written_through = CounterMetricFamily("kvserve_offload_write_through_blocks",
                                          "Computed blocks written to a shared tier at once (write-through)",
                                          labels=["tier"])
    yield GaugeMetricFamily("kvserve_num_requests_loading", "Admitted requests waiting for their tier reads",
                            s.num_loading)
    yield CounterMetricFamily("kvserve_offload_swapped_blocks", "Blocks of preempted requests demoted at once",
                              s.num_swapped_blocks)
    if s.cost is not None:
        yield from _cost_metrics(s.cost)
    for t in s.tiers:
        loaded.add_metric([t.tier], t.loaded_tokens)
        moved.add_metric([t.tier, "load"], t.bytes_loaded)
        moved.add_metric([t.tier, "store"], t.store.bytes_written)
        seconds.add_metric([t.tier], t.load_seconds)
        corrupt.add_metric([t.tier], t.store.corrupt)
        dropped.add_metric([t.tier], t.store.puts_dropped)
        written_through.add_metric([t.tier], t.write_through_blocks)
    yield from (loaded, moved, seconds, corrupt, dropped, written_through)


class ServerMetrics:
    """The server's metrics; an ``EngineObserver`` (its ``on_*`` run on the engine thread).
    ``tenants``: the server's tenants, each with series of its own (counts only)."""

    def __init__(self, tenants: tuple[str, ...] = ()) -> None:
        self.tenants = frozenset(tenants)
        r = self.registry = CollectorRegistry()
        self.requests = Counter("kvserve_requests", "Engine requests ended, by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("kvserve_prompt_tokens", "Prompt tokens of requests that started", registry=r)
        self.cached_prompt_tokens = Counter("kvserve_cached_prompt_tokens",
                                            "Prompt tokens served from a cache tier", registry=r)
        self.generation_tokens = Counter("kvserve_generation_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram("kvserve_time_to_first_token_seconds", "Time from engine arrival to first token",
                              buckets=TTFT_BUCKETS_S, registry=r)
        self.token_latency = Histogram("kvserve_time_per_output_token_seconds",
                                       "Time between consecutive tokens of a request",
                                       buckets=TOKEN_BUCKETS_S, registry=r)
        self.e2e = Histogram("kvserve_e2e_request_latency_seconds", "Time from engine arrival to finish",
                             buckets=E2E_BUCKETS_S, registry=r)
        self.api_errors = Counter("kvserve_api_errors", "Error responses, by status", ["status"], registry=r)
        self.tenant_requests = Counter("kvserve_tenant_requests", "Engine requests a tenant's calls started",
                                       ["tenant"], registry=r)
        self.tenant_prompt_tokens = Counter("kvserve_tenant_prompt_tokens", "Prompt tokens of a tenant's requests",
                                            ["tenant"], registry=r)
        self.tenant_resets = Counter("kvserve_tenant_cache_resets", "POST /v1/cache/reset calls of a tenant "
                                     "(each drops that tenant's blocks only)", ["tenant"], registry=r)
        for tenant in sorted(self.tenants):      # every tenant's series from the start, at 0
            for counter in (self.tenant_requests, self.tenant_prompt_tokens, self.tenant_resets):
                counter.labels(tenant)
        self._stats = _StatsCollector(tuple(sorted(self.tenants)))
        r.register(self._stats)
        self._progress: dict[str, _Progress] = {}   # engine thread only

    def on_step(self, stats: EngineStats, outputs: list[RequestOutput], now: float) -> None:
        self._stats.stats = stats
        self.observe_outputs(outputs, now)

    def observe_outputs(self, outputs: list[RequestOutput], now: float) -> None:
        """Request-level series from outputs (a cluster's ingress feeds those it relays)."""
        for out in outputs:
            seen = self._progress.get(out.request_id)
            new_tokens = len(out.token_ids) - (seen.num_tokens if seen else 0)
            self.generation_tokens.inc(new_tokens)
            if seen is None:
                self.prompt_tokens.inc(out.num_prompt_tokens)
                self.cached_prompt_tokens.inc(out.num_cached_tokens)
                if out.ttft is not None:
                    self.ttft.observe(out.ttft)
            elif new_tokens > 0:
                gap = (now - seen.last_token_time) / new_tokens
                for _ in range(new_tokens):
                    self.token_latency.observe(gap)
            if out.finished:
                self._progress.pop(out.request_id, None)
                self.requests.labels(out.finish_reason or "unknown").inc()
                if out.e2e_latency is not None:
                    self.e2e.observe(out.e2e_latency)
            else:
                self._progress[out.request_id] = _Progress(len(out.token_ids), now)

    def on_abort(self, request_id: str) -> None:
        self._progress.pop(request_id, None)
        self.requests.labels("abort").inc()

    def on_failed(self, request_id: str) -> None:
        """A request that ended without a finished output (a cluster's replica failed under it)."""
        self._progress.pop(request_id, None)
        self.requests.labels("error").inc()

    def on_error(self, status: int) -> None:
        self.api_errors.labels(str(status)).inc()

    def on_submitted(self, tenant: str, num_requests: int, num_prompt_tokens: int) -> None:
        """A call of ``tenant`` started ``num_requests`` engine requests (event loop)."""
        if tenant in self.tenants:
            self.tenant_requests.labels(tenant).inc(num_requests)
            self.tenant_prompt_tokens.labels(tenant).inc(num_prompt_tokens)

    def on_cache_reset(self, tenant: str) -> None:
        if tenant in self.tenants:
            self.tenant_resets.labels(tenant).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _cost_metrics(c: CostSnapshot) -> Iterator[Metric]:
    """The load-or-recompute model: its estimates and its decisions."""
    if c.prefill_tokens_per_s is not None:
        yield GaugeMetricFamily("kvserve_offload_prefill_tokens_per_second",
                                "Measured prefill speed (moving average over prefill steps)", c.prefill_tokens_per_s)
    latency = GaugeMetricFamily("kvserve_offload_tier_latency_seconds", "Estimated read latency per call",
                                labels=["tier", "measured"])
    bandwidth = GaugeMetricFamily("kvserve_offload_tier_bandwidth_bytes_per_second", "Estimated read bandwidth",
                                  labels=["tier", "measured"])
    for t in c.tiers:
        measured = "true" if t.is_measured else "false"
        latency.add_metric([t.tier, measured], t.latency_s)
        bandwidth.add_metric([t.tier, measured], t.bytes_per_s)
    runs = CounterMetricFamily("kvserve_offload_runs", "Runs of tier hits, by decision", labels=["decision"])
    runs.add_metric(["load"], c.runs_loaded)
    runs.add_metric(["cut"], c.runs_cut)
    runs.add_metric(["probe"], c.runs_probed)
    yield from (latency, bandwidth, runs)
    yield CounterMetricFamily("kvserve_offload_recomputed_blocks",
                              "Tier hits recomputed because loading them was estimated slower", c.blocks_recomputed)

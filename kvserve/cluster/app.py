"""The Serve application: N engine replicas behind the KV-aware router, and the ingress."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ray import serve
from ray.serve.deployment import Application

from kvserve.cluster.index import DEFAULT_MIN_CACHED_SHARE, ROUTINGS
from kvserve.cluster.ingress import Ingress
from kvserve.cluster.replica import EngineReplica
from kvserve.cluster.router import DEFAULT_MAX_IMBALANCE, KVAwareRouter  # imported here so its module is known
from kvserve.server.serving import ServerSettings

APP_NAME = "kvserve"
ENGINE_DEPLOYMENT = "EngineReplica"


@dataclass(frozen=True)
class ClusterConfig:
    """How the engines are deployed (docs/cluster.md, "Sizing")."""

    num_replicas: int = 2
    replica_cpus: float = 1.0               # Ray CPUs per engine replica (fractions share a node's cores)
    replica_gpus: float = 0.0
    ingress_replicas: int = 1
    ingress_cpus: float = 0.25
    routing: str = "kv"
    max_imbalance: int = DEFAULT_MAX_IMBALANCE
    min_cached_share: float = DEFAULT_MIN_CACHED_SHARE
    stats_period_s: float = 1.0             # how often replicas publish their block digests
    max_ongoing_requests: int = 64          # per engine replica: requests it batches at once
    max_attempts: int = 3                   # sends of a request whose replica fails before its first output

    def __post_init__(self) -> None:
        if self.num_replicas < 1 or self.ingress_replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.num_replicas} engines, {self.ingress_replicas} ingresses")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {self.routing!r}")
        if self.replica_cpus < 0 or self.replica_gpus < 0 or self.ingress_cpus < 0:
            raise ValueError("CPUs and GPUs per replica must be >= 0")
        if not 0.0 <= self.min_cached_share <= 1.0:
            raise ValueError(f"min_cached_share must be in [0, 1], got {self.min_cached_share}")
        if self.max_imbalance < 0 or self.stats_period_s <= 0 or self.max_ongoing_requests < 1 or self.max_attempts < 1:
            raise ValueError("max_imbalance >= 0, stats_period_s > 0, max_ongoing_requests >= 1, max_attempts >= 1")


def build_application(model: str | None, engine_options: dict[str, Any], settings: ServerSettings,
                      cluster: ClusterConfig) -> Application:
    router: dict[str, Any] = {"request_routing_stats_period_s": cluster.stats_period_s}
    if cluster.routing != "pow2":
        router |= {"request_router_class": f"{KVAwareRouter.__module__}.{KVAwareRouter.__name__}",
                   "request_router_kwargs": {"max_imbalance": cluster.max_imbalance,
                                             "overlay_ttl_s": max(10.0, 5 * cluster.stats_period_s),
                                             "with_segments": cluster.routing == "kv",
                                             "min_cached_share": cluster.min_cached_share}}
    actor: dict[str, Any] = {"num_cpus": cluster.replica_cpus}
    if cluster.replica_gpus:
        actor["num_gpus"] = cluster.replica_gpus
    engines = serve.deployment(
        name=ENGINE_DEPLOYMENT, num_replicas=cluster.num_replicas, ray_actor_options=actor,
        max_ongoing_requests=cluster.max_ongoing_requests, request_router_config=router,
        health_check_period_s=2.0, graceful_shutdown_timeout_s=5.0,
        logging_config={"enable_access_log": False})(EngineReplica).bind(model, engine_options)
    ingress = serve.deployment(
        name="Ingress", num_replicas=cluster.ingress_replicas, ray_actor_options={"num_cpus": cluster.ingress_cpus},
        max_ongoing_requests=1024)(Ingress)
    return ingress.bind(engines, settings, poll_s=cluster.stats_period_s, max_attempts=cluster.max_attempts)

"""The ingress deployment: kvserve/server's app (routes, auth, errors, streaming, /metrics)
over a ``ReplicaClient`` instead of an engine in the process."""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.handle import DeploymentHandle

from kvserve.cluster.client import ReplicaClient
from kvserve.cluster.metrics import FleetMetrics
from kvserve.engine.model_card import ModelCard
from kvserve.server.app import build_app
from kvserve.server.serving import ServerSettings, ServingContext


@serve.ingress()
class Ingress:
    async def __init__(self, engines: DeploymentHandle, settings: ServerSettings,  # type: ignore[misc]
                       poll_s: float = 1.0, max_attempts: int = 3) -> None:   # Serve awaits an async __init__
        card: ModelCard = await engines.describe.remote()    # tokenizer, limits, block keys' inputs
        self.fleet = FleetMetrics(poll_s, settings.tenants)
        self.client = ReplicaClient(engines, card, self.fleet, max_attempts)
        self.ctx = ServingContext(self.client, settings, self.fleet.server)

    def __serve_build_asgi_app__(self) -> Any:
        return build_app(self.ctx, self.client.start, self.client.stop)

"""The ingress's fleet series from replicas' stats, without Ray: each configured tenant's share of
each replica's device cache and of the fleet's, as counts."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import generate_latest
from tiny import random_tokens, tiny_model

from kvserve import LLM, CacheControl, SamplingParams
from kvserve.cluster.metrics import FleetMetrics

ONE = SamplingParams(max_tokens=1, temperature=0.0)


def series(fleet: FleetMetrics) -> dict[str, float]:
    out = {}
    for line in generate_latest(fleet.server.registry).decode().splitlines():
        if line.startswith("kvserve_cluster_tenant_"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_each_tenants_blocks_and_pins_per_replica_and_in_the_fleet() -> None:
    loaded = tiny_model()
    one = LLM(loaded=loaded, num_kv_blocks=64, block_size=16)
    two = LLM(loaded=loaded, num_kv_blocks=64, block_size=16)
    one.generate(random_tokens(40, 1), ONE, cache=CacheControl(tenant="a"))    # 2 full blocks of a's
    two.generate(random_tokens(70, 2), ONE, cache=CacheControl(tenant="a"))    # 4 of a's
    two.generate(random_tokens(20, 3), ONE, cache=CacheControl(tenant="b"))    # 1 of b's
    two.engine.pin(random_tokens(20, 3), tenant="b")
    fleet = FleetMetrics(tenants=("b", "a", "c"))
    fleet.replica_stats = {"r1": SimpleNamespace(engine=one.engine.stats()),
                           "r2": SimpleNamespace(engine=two.engine.stats())}
    got = series(fleet)
    blocks = {(r, t): got[f'kvserve_cluster_tenant_cached_blocks{{replica="{r}",tenant="{t}"}}']
              for r in ("r1", "r2", "fleet") for t in ("a", "b", "c")}
    assert blocks == {("r1", "a"): 2, ("r1", "b"): 0, ("r1", "c"): 0, ("r2", "a"): 4, ("r2", "b"): 1,
                      ("r2", "c"): 0, ("fleet", "a"): 6, ("fleet", "b"): 1, ("fleet", "c"): 0}
    assert got['kvserve_cluster_tenant_pins{replica="r2",tenant="b"}'] == 1
    assert got['kvserve_cluster_tenant_pins{replica="fleet",tenant="b"}'] == 1
    assert got['kvserve_cluster_tenant_pins{replica="fleet",tenant="a"}'] == 0


def test_no_tenant_series_without_tenants() -> None:
    assert series(FleetMetrics()) == {}

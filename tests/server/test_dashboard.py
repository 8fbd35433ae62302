"""The Grafana dashboard (docs/grafana/kvserve.json) queries only what /metrics exports.

A server with a host tier serves a few requests (a hit, an error), then its /metrics is
parsed: every series name the dashboard's queries use must be among the samples, and
every label it groups by must be on them. So a renamed metric breaks this test, not the
dashboard in someone's Grafana.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from live_server import MODEL, running_server

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "kvserve.json"
NAME = re.compile(r"\bkvserve_[a-zA-Z0-9_]+")
GROUPING = re.compile(r"\b(?:by|ignoring|on|without)\s*\(([^)]*)\)")
SCRAPE_LABELS = {"instance", "job"}     # added by Prometheus, not by the server


def dashboard_queries() -> list[str]:
    board = json.loads(DASHBOARD.read_text())
    out = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            out.extend(t["expr"] for t in p.get("targets", []))
            walk(p.get("panels", []))

    walk(board["panels"])
    for var in board["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            out.append(query["query"])
        if var.get("definition"):
            out.append(var["definition"])
    return out


def exported_series(text: str) -> dict[str, set[str]]:
    """Sample name -> the label names its samples carry."""
    series: dict[str, set[str]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(\{([^}]*)\})?\s", line)
        assert m, line
        labels = {pair.split("=", 1)[0] for pair in re.findall(r'(\w+="(?:[^"\\]|\\.)*")', m[3] or "")}
        series.setdefault(m[1], set()).update(labels)
    return series


@pytest.fixture(scope="module")
def metrics_text(default_model) -> str:
    with (running_server(default_model, num_kv_blocks=24, host_cache_gb=0.05) as server,
          httpx.Client(base_url=server.url, timeout=60) as http):
        prompt = "The harbour town woke slowly; boats knocked against the pier and gulls argued " * 3
        for _ in range(2):   # the second is a prefix hit
            assert http.post("/v1/completions", json={"model": MODEL, "prompt": prompt,
                                                      "max_tokens": 2}).status_code == 200
        assert http.post("/v1/completions", json={"model": MODEL, "prompt": ""}).status_code == 400
        return http.get("/metrics").text


def test_every_series_the_dashboard_queries_is_exported(metrics_text):
    series = exported_series(metrics_text)
    queries = dashboard_queries()
    used = {name for q in queries for name in NAME.findall(q)}
    assert used, "no kvserve series in the dashboard"
    missing = sorted(used - set(series))
    assert not missing, f"the dashboard queries series /metrics does not export: {missing}"
    for q in queries:
        names = NAME.findall(q)
        labels = set().union(*(series[n] for n in names)) if names else set()
        for group in GROUPING.findall(q):
            for label in (g.strip() for g in group.split(",") if g.strip()):
                assert label in labels | SCRAPE_LABELS, f"{q!r} groups by {label!r}, which {names} do not carry"


def test_the_dashboard_covers_what_operators_look_at():
    used = {name for q in dashboard_queries() for name in NAME.findall(q)}
    for name in ("kvserve_prefix_cache_hit_tokens_total", "kvserve_time_to_first_token_seconds_bucket",
                 "kvserve_num_requests_waiting", "kvserve_num_requests_running", "kvserve_kv_cache_usage_ratio",
                 "kvserve_preemptions_total", "kvserve_offload_bytes_total", "kvserve_kv_budget_compactions_total",
                 "kvserve_pinned_blocks", "kvserve_pin_hit_tokens_total", "kvserve_pin_expirations_total"):
        assert name in used, name


def test_the_dashboard_is_well_formed():
    board = json.loads(DASHBOARD.read_text())
    assert (board["uid"], board["title"]) == ("kvserve", "kvserve")
    assert [v["name"] for v in board["templating"]["list"]] == ["datasource", "instance"]
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in board["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        area = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not area & cells, f"panel {p['title']!r} overlaps another"
        cells |= area
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
            assert all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])

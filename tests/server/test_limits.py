"""Clear limits: constraints that allow no output get a 400 naming the field before anything is
queued, without the grammar engine's state; bodies must be declared JSON (415); the KV figures
are on /metrics from start-up."""

from __future__ import annotations

import httpx
import pytest
from live_server import MODEL, running_server


@pytest.fixture(scope="module")
def server(default_model):
    with running_server(default_model, num_kv_blocks=32) as s:
        yield s


def test_kv_figures_are_on_metrics_before_any_request(server):
    assert server.metric("kvserve_kv_blocks") == 32 and server.metric("kvserve_kv_free_blocks") == 32


@pytest.mark.parametrize(("field", "value"), [
    ("structured_outputs", {"regex": r"[^\s\S]"}),
    ("structured_outputs", {"grammar": 'start: start "a"'}),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}),
])
def test_a_constraint_that_allows_no_output_is_a_400(server, field, value):
    r = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4, field: value},
                   timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and "allows no output" in error["message"]
    assert "<state>" not in error["message"] and "Parser" not in error["message"]
    assert server.metric("kvserve_num_requests_waiting") == 0


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded"])
def test_a_body_not_declared_json_is_a_415(server, content_type):
    headers = {} if content_type is None else {"content-type": content_type}
    r = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 1}', headers=headers)
    assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type"
    ok = httpx.post(f"{server.url}/v1/completions", content=b'{"prompt": "Hi", "max_tokens": 1}',
                    headers={"content-type": "application/json; charset=utf-8"}, timeout=60)
    assert ok.status_code == 200

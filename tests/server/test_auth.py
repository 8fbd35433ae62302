"""An API key, when set, is required as a Bearer token on /v1; /health and /metrics stay open."""

from __future__ import annotations

import httpx
import openai
import pytest
from live_server import MODEL, running_server

KEY = "s3cret-key"


@pytest.fixture(scope="module")
def server(default_model):
    with running_server(default_model, api_key=KEY) as s:
        yield s


def test_openai_client_refused_without_the_key(server):
    with (openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0) as client,
          pytest.raises(openai.AuthenticationError) as e):
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    assert e.value.status_code == 401
    assert e.value.body["type"] == "authentication_error" and e.value.body["code"] == "invalid_api_key"


def test_openai_client_accepted_with_the_key(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0) as client:
        r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
        assert r.usage.completion_tokens == 1
        assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.parametrize("headers", [{}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
                                     {"Authorization": f"Bearer {KEY}x"}, {"Authorization": "Bearer"}])
def test_raw_requests_without_a_valid_bearer_token(server, headers):
    for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("POST", "/v1/cache/reset")]:
        r = httpx.request(method, f"{server.url}{path}", headers=headers, json={"prompt": "Hi"})
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["type"] == "authentication_error"


def test_health_and_metrics_stay_open(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert "kvserve_requests_total" in httpx.get(f"{server.url}/metrics").text

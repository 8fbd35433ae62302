"""Clear limits: constraints that allow no output get a 400 naming the field before anything is
queued, without the grammar engine's state; bodies must be declared JSON (415); the KV figures
are on /metrics from start-up; a KV cache that cannot hold one request of the context window
is refused at start, or the window lowered to fit, and a request without max_tokens runs."""

from __future__ import annotations

import httpx
import pytest
from live_server import MODEL, running_server


@pytest.fixture(scope="module")
def server(default_model):
    # 32 blocks of 16 hold one request of the 512-token window exactly: kvserve serve's check passes
    with running_server(default_model, num_kv_blocks=32, max_model_len_fit="refuse") as s:
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


def test_a_pool_that_holds_the_window_keeps_it(server):
    assert httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"] == 512


def test_kvserve_serve_refuses_a_pool_that_cannot_hold_its_window(capsys, monkeypatch):
    """`kvserve serve` checks the pool against the window before it listens: SmolLM2's 512-token
    window here needs 32 blocks of 16, and 8 are given."""
    from kvserve.cli import main

    def listen(*args, **kwargs):
        raise AssertionError("the server started")

    monkeypatch.setattr("uvicorn.run", listen)
    assert main(["serve", "--num-kv-blocks", "8", "--max-model-len", "512", "--port", "1"]) == 2
    err = capsys.readouterr().err
    assert "one request of max_model_len 512 tokens needs up to 32 blocks" in err and "8 blocks of 16" in err
    assert "--max-model-len 128" in err and "--num-kv-blocks 32" in err and "--max-model-len-fit lower" in err


def test_a_lowered_window_serves_a_request_without_max_tokens(default_model):
    with running_server(default_model, num_kv_blocks=8, max_model_len=512, max_model_len_fit="lower") as s:
        assert httpx.get(f"{s.url}/v1/models").json()["data"][0]["max_model_len"] == 128
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Count from one to a hundred."}],
                "temperature": 0, "ignore_eos": True}           # no max_tokens: the rest of the window
        r = httpx.post(f"{s.url}/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        assert r.json()["usage"]["total_tokens"] == 128

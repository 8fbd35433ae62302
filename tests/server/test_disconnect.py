"""A client that goes away cancels its request: the engine aborts it and frees its blocks."""

from __future__ import annotations

import time

import httpx
import pytest
from live_server import MODEL, running_server

ABORTS = 'kvserve_requests_total{finish_reason="abort"}'
LONG = {"model": MODEL, "max_tokens": 300, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(default_model):
    with running_server(default_model) as s:
        yield s


def wait_for(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "Tell me a long story about the sea.", **LONG}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Tell me a long story."}], "n": 2, **LONG}),
])
def test_disconnect_mid_stream_frees_blocks(server, path, body):
    aborts = server.metric(ABORTS)
    with (httpx.Client(base_url=server.url, timeout=30) as http,
          http.stream("POST", path, json={**body, "stream": True}) as r):
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 4:   # still reading: the request runs and holds blocks
                assert server.metric("kvserve_num_requests_running") >= 1
                assert server.metric("kvserve_kv_cache_usage_ratio") > 0
                break
        # leaving the loop abandons the stream: httpx closes the connection mid-response
    server.wait_idle()
    wait_for(lambda: server.metric(ABORTS) == aborts + body.get("n", 1))
    assert server.metric("kvserve_kv_free_blocks") == server.metric("kvserve_kv_blocks")
    server.ctx.engine.engine.check_integrity()   # the engine thread is idle (blocked on its queue)


def test_disconnect_while_waiting_for_a_full_response(server):
    aborts = server.metric(ABORTS)
    body = {"prompt": "Tell me a long story about the sea.", **LONG}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    wait_for(lambda: server.metric(ABORTS) == aborts + 1)
    server.wait_idle()
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert r.status_code == 200

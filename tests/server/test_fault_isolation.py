"""One request's failure never fails another: three streams survive a poisoned neighbour.

The poison is injected, not found (tests/poison.py), so the test keeps proving
isolation whatever the sampler fixes. The issue's original crashers (tiny temperature /
top_p) are checked too.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
from live_server import MODEL, running_server
from poison import POISON, install_poison

from kvserve.server.cli import resolve_api_key

STREAM = {"model": MODEL, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def server(default_model):
    with running_server(default_model, num_kv_blocks=128) as s:
        install_poison(s.ctx.engine.engine)
        yield s


def read_stream(url: str, body: dict, out: dict) -> None:
    events = []
    with httpx.Client(timeout=120) as http, http.stream("POST", url, json=body) as r:
        out["status"] = r.status_code
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                out["num_events"] = len(events)
    out["events"], out["end"] = events, time.monotonic()


def test_three_streams_survive_a_poisoned_neighbour(server):
    url = f"{server.url}/v1/completions"
    streams = [{} for _ in range(3)]
    threads = [threading.Thread(target=read_stream, args=(url, {**STREAM, "prompt": p}, out))
               for p, out in zip(["Once upon a time", "The sea is", "def main():"], streams)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while not all(s.get("num_events", 0) >= 3 for s in streams):   # all three are mid-answer
        assert time.monotonic() < deadline
        time.sleep(0.02)
    steps = server.metric("kvserve_engine_steps_total")
    plain = httpx.post(url, json={"model": MODEL, "prompt": "Hi", "max_tokens": 8, **POISON}, timeout=60)
    failed_at = time.monotonic()
    streamed: dict = {}
    read_stream(url, {**STREAM, "prompt": "Hi", **POISON}, streamed)
    for t in threads:
        t.join(120)

    assert plain.status_code == 500, plain.text
    error = plain.json()["error"]
    assert error["type"] == "server_error" and "poisoned grammar" in error["message"]
    assert streamed["status"] == 200 and "poisoned grammar" in json.loads(streamed["events"][-1])["error"]["message"]
    for s in streams:
        assert s["status"] == 200 and s["events"][-1] == "[DONE]"
        chunks = [json.loads(e) for e in s["events"][:-1]]
        assert not any("error" in c for c in chunks)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert s["end"] > failed_at            # still running when their neighbour failed
    assert server.metric("kvserve_engine_steps_total") - steps < 40   # they shared steps with it
    assert server.metric('kvserve_requests_total{finish_reason="error"}') == 2
    server.wait_idle()
    server.ctx.engine.engine.check_integrity()
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_a_failed_model_step_fails_its_requests_and_the_server_keeps_serving(server, monkeypatch):
    engine = server.ctx.engine.engine
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(out):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device fell over")
        return real(out)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 500 and "device fell over" in r.json()["error"]["message"]
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    server.wait_idle()
    engine.check_integrity()


@pytest.mark.parametrize("extra", [{"temperature": 1e-38}, {"top_p": 1e-300}, {"temperature": 1e-38, "top_p": 1e-300},
                                   {"top_k": 10**9}, {"temperature": 2.0, "top_p": 5e-324}])
def test_the_original_crashers_now_answer(server, extra):
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] in ("length", "stop")


def test_head_on_health_and_metrics(server):
    for path in ("/health", "/metrics"):
        r = httpx.head(f"{server.url}{path}")
        assert r.status_code == 200 and r.content == b""


def test_an_empty_api_key_means_no_authentication(monkeypatch):
    monkeypatch.setenv("KVSERVE_API_KEY", "from-env")
    assert resolve_api_key("") is None
    assert resolve_api_key(None) == "from-env"
    assert resolve_api_key("k") == "k"
    monkeypatch.setenv("KVSERVE_API_KEY", "")
    assert resolve_api_key(None) is None


# a constraint that builds and walks its first 32 tokens, then fails past llguidance's lexer
# limit once the answer reaches its tail: the client's input, found only while generating
PREAMBLE = ("Once upon a time there was a tiny robot who lived in a small house by the sea, and every morning it "
            "walked along the shore to count the waves and the shells before the sun rose over the hills. ")
LATE = {"structured_outputs": {"regex": PREAMBLE + "a{1000000}"}}


@pytest.mark.parametrize("route,body", [
    ("completions", {"prompt": "Hi", "structured_outputs": {"regex": "a{1000000}"}}),
    ("chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                          "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                              "type": "object", "properties": {"a": {"type": "string", "pattern": "^a{1000000}$"}},
                              "required": ["a"]}}}}),
    ("completions", {"prompt": "Hi", "structured_outputs": {"grammar": 'start: "x" big\nbig: /a{1000000}/'}}),
])
def test_a_constraint_past_the_grammar_engines_limits_is_a_400_before_queueing(server, route, body):
    steps = server.metric("kvserve_engine_steps_total")
    r = httpx.post(f"{server.url}/v1/{route}", json={"model": MODEL, "max_tokens": 8, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] in ("structured_outputs", "response_format")
    assert "limit of the grammar engine" in error["message"] and "initial_lexer_fuel 1,000,000" in error["message"]
    assert "<state>" not in error["message"] and "non-verbose" not in error["message"]
    assert server.metric("kvserve_engine_steps_total") == steps        # nothing ran


def test_a_constraint_failing_mid_answer_ends_that_request_alone(server):
    url = f"{server.url}/v1/completions"
    streams = [{} for _ in range(2)]
    threads = [threading.Thread(target=read_stream, args=(url, {**STREAM, "max_tokens": 90, "prompt": p}, out))
               for p, out in zip(["Once upon a time", "The sea is"], streams)]
    for t in threads:
        t.start()
    errors_before = server.metric('kvserve_api_errors_total{status="400"}')
    failed_before = server.metric('kvserve_requests_total{finish_reason="error"}')
    body = {"model": MODEL, "prompt": "Tell me a story.", "max_tokens": 80, "temperature": 0, **LATE}
    plain = httpx.post(url, json=body, timeout=120)
    streamed: dict = {}
    read_stream(f"{server.url}/v1/chat/completions",
                {**{k: v for k, v in body.items() if k != "prompt"}, "stream": True,
                 "messages": [{"role": "user", "content": "Tell me a story."}]}, streamed)
    for t in threads:
        t.join(120)

    assert plain.status_code == 400, plain.text           # not a 500: the client's constraint failed
    error = plain.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "constraint_failed"
    assert "output constraint failed" in error["message"] and 'finish_reason "error"' in error["message"]
    assert "initial_lexer_fuel" in error["message"]
    assert streamed["status"] == 200
    chunks = [json.loads(e) for e in streamed["events"]]
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[:-1] if c.get("choices"))
    assert text == PREAMBLE[:len(text)] and len(text) > 100            # it streamed the answer up to the tail
    assert chunks[-2]["choices"][0]["finish_reason"] == "error"
    assert chunks[-1]["error"]["code"] == "constraint_failed" and "[DONE]" not in streamed["events"]
    for s in streams:                                                   # the others' streams are intact
        assert s["status"] == 200 and s["events"][-1] == "[DONE]"
        assert json.loads(s["events"][-2])["choices"][0]["finish_reason"] == "length"
    assert server.metric('kvserve_api_errors_total{status="400"}') == errors_before + 2   # client errors
    assert server.metric('kvserve_requests_total{finish_reason="error"}') == failed_before + 2
    server.wait_idle()
    server.ctx.engine.engine.check_integrity()

"""Bad input over raw HTTP: an OpenAI-style 4xx naming the problem, and the server still serves."""

from __future__ import annotations

import json

import httpx
import pytest
from live_server import MODEL, running_server

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
USER = [{"role": "user", "content": "Hi"}]
LONG_PROMPT = "word " * 600          # > max_model_len (512) tokens
POOL_BUSTER = "word " * 300          # fits the context (512) but not the 16-block (256-token) pool


@pytest.fixture(scope="module")
def server(default_model):
    with running_server(default_model, num_kv_blocks=16) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def expect_error(r: httpx.Response, status: int, words: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == type_
    assert words.lower() in error["message"].lower(), error["message"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code


def still_serves(http: httpx.Client) -> None:
    r = http.post(CMPL, json={"model": MODEL, "prompt": "Hello", "max_tokens": 1})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


CASES = [
    # (path, body, status, words in the message, param, code)
    (CMPL, b'{"prompt": "Hi", "max_tokens": ', 400, "malformed JSON", None, None),
    (CMPL, b"[1, 2]", 400, "JSON object", None, None),
    (CMPL, {"max_tokens": 1}, 400, "prompt is required", "prompt", None),
    (CMPL, {"prompt": "Hi", "max_tokens": "5"}, 400, "max_tokens", "max_tokens", None),
    (CMPL, {"prompt": "Hi", "temperature": "hot"}, 400, "temperature", "temperature", None),
    (CMPL, {"prompt": 5}, 400, "prompt must be a string", "prompt", None),
    (CMPL, {"prompt": [1.5]}, 400, "list of token ids", "prompt", None),
    (CMPL, {"prompt": "Hi", "max_token": 3}, 400, "unknown field 'max_token'", "max_token", None),
    (CMPL, {"prompt": "Hi", "max_tokens": -1}, 400, "greater than or equal to 0", "max_tokens", None),
    (CMPL, {"prompt": "Hi", "max_tokens": 0}, 400, "only with echo", "max_tokens", None),
    (CMPL, {"prompt": "Hi", "max_tokens": 10**9}, 400, "context window", "max_tokens", "context_length_exceeded"),
    (CMPL, {"prompt": "Hi", "n": 0}, 400, "greater than or equal to 1", "n", None),
    (CMPL, {"prompt": "Hi", "n": 1000}, 400, "less than or equal to 16", "n", None),
    (CMPL, {"prompt": ["Hi"] * 100, "n": 16}, 400, "prompts x n", "n", None),
    (CMPL, {"prompt": LONG_PROMPT, "max_tokens": 1}, 400, "context window", "prompt", "context_length_exceeded"),
    (CMPL, {"prompt": POOL_BUSTER, "max_tokens": 1}, 400, "KV blocks", None, None),
    (CMPL, {"prompt": ""}, 400, "prompt is empty", "prompt", None),
    (CMPL, {"prompt": []}, 400, "prompt is empty", "prompt", None),
    (CMPL, {"prompt": [10**9]}, 400, "out of range", "prompt", None),
    (CMPL, {"prompt": "Hi", "model": "gpt-4"}, 404, "'gpt-4' does not exist", "model", "model_not_found"),
    (CMPL, {"prompt": "Hi", "logprobs": 100}, 400, "logprobs", "logprobs", None),
    (CMPL, {"prompt": "Hi", "stop": ["a", "b", "c", "d", "e"]}, 400, "at most 4", "stop", None),
    (CMPL, {"prompt": "Hi", "stop": [""]}, 400, "non-empty", "stop", None),
    (CMPL, {"prompt": "Hi", "top_p": 0}, 400, "greater than 0", "top_p", None),
    (CMPL, {"prompt": "Hi", "seed": 2**70}, 400, "less than or equal to", "seed", None),
    (CMPL, {"prompt": "Hi", "presence_penalty": 0.5}, 400, "not supported", "presence_penalty", None),
    (CMPL, {"prompt": "Hi", "stream_options": {"include_usage": True}}, 400, "only allowed when stream",
     "stream_options", None),
    (CHAT, {"messages": []}, 400, "at least one message", "messages", None),
    (CHAT, {"messages": "Hi"}, 400, "messages must be a list", "messages", None),
    (CHAT, {"messages": [{"role": "robot", "content": "Hi"}]}, 400, "messages.0.role", "messages", None),
    (CHAT, {"messages": [{"role": "user", "content": 3}]}, 400, "messages.0.content must be a string", "messages",
     None),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "content must be a string or a list",
     "messages", None),
    (CHAT, {"messages": USER, "model": "nope"}, 404, "does not exist", "model", "model_not_found"),
    (CHAT, {"messages": USER, "max_tokens": 0}, 400, "greater than or equal to 1", "max_tokens", None),
    (CHAT, {"messages": USER, "max_completion_tokens": 10**6}, 400, "context window", "max_completion_tokens",
     "context_length_exceeded"),
    (CHAT, {"messages": [{"role": "user", "content": LONG_PROMPT}]}, 400, "context window", "messages",
     "context_length_exceeded"),
    (CHAT, {"messages": USER, "top_logprobs": 2}, 400, "requires logprobs", "top_logprobs", None),
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools are not supported", "tools", None),
    (CHAT, {"messages": USER, "n": "2"}, 400, "n:", "n", None),
]


@pytest.mark.parametrize(("path", "body", "status", "words", "param", "code"), CASES,
                         ids=[f"{i}-{c[0].rsplit('/', 1)[-1]}-{c[3][:24]}" for i, c in enumerate(CASES)])
def test_bad_request_then_good(http, path, body, status, words, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    expect_error(r, status, words, param, code=code)
    still_serves(http)


def test_body_too_large(http):
    big = json.dumps({"prompt": "x" * (1 << 20)}).encode()
    expect_error(http.post(CMPL, content=big), 413, "larger than", code="request_too_large")

    def chunks():   # no content-length: the limit holds while reading
        for _ in range(17):
            yield b" " * (1 << 16)

    expect_error(http.post(CMPL, content=chunks()), 413, "larger than")
    still_serves(http)


def test_unknown_route_and_method(http):
    expect_error(http.get("/v1/nothing"), 404, "not found", type_="not_found_error")
    expect_error(http.get(CMPL), 405, "method not allowed")
    still_serves(http)


def test_error_metrics_counted(server, http):
    before = server.metric('kvserve_api_errors_total{status="400"}')
    http.post(CMPL, json={"prompt": "Hi", "n": 0})
    assert server.metric('kvserve_api_errors_total{status="400"}') == before + 1

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
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


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
    (CMPL, {"prompt": "Hi", "presence_penalty": 2.5}, 400, "less than or equal to 2", "presence_penalty", None),
    (CMPL, {"prompt": "Hi", "frequency_penalty": -3}, 400, "greater than or equal to -2", "frequency_penalty", None),
    (CMPL, {"prompt": "Hi", "repetition_penalty": 0}, 400, "greater than 0", "repetition_penalty", None),
    (CMPL, {"prompt": "Hi", "logit_bias": {"abc": 1}}, 400, "token ids", "logit_bias", None),
    (CMPL, {"prompt": "Hi", "logit_bias": {"5": 500}}, 400, "[-100, 100]", "logit_bias", None),
    (CMPL, {"prompt": "Hi", "logit_bias": {"99999999": 1}}, 400, "out of range", "logit_bias", None),
    (CMPL, {"prompt": "Hi", "min_tokens": -1}, 400, "greater than or equal to 0", "min_tokens", None),
    (CMPL, {"prompt": "Hi", "max_tokens": 2, "min_tokens": 5}, 400, "must not exceed max_tokens", None, None),
    (CMPL, {"prompt": "Hi", "structured_outputs": {"regex": "[a-"}}, 400, "unclosed character class",
     "structured_outputs", None),
    (CMPL, {"prompt": "Hi", "structured_outputs": {"json": {"type": "objekt"}}}, 400, "invalid type",
     "structured_outputs", None),
    (CMPL, {"prompt": "Hi", "structured_outputs": {"json": "{not json"}}, 400, "not valid JSON",
     "structured_outputs", None),
    (CMPL, {"prompt": "Hi", "structured_outputs": {"choice": []}}, 400, "non-empty list", "structured_outputs", None),
    (CMPL, {"prompt": "Hi", "structured_outputs": {"grammar": "start: foo"}}, 400, "unknown name",
     "structured_outputs", None),
    (CMPL, {"prompt": "Hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400, "exactly one",
     "structured_outputs", None),
    (CMPL, {"prompt": "Hi", "structured_outputs": {"whitespace_pattern": " "}}, 400,
     "unknown field 'structured_outputs.whitespace_pattern'", "structured_outputs.whitespace_pattern", None),
    (CMPL, {"prompt": "Hi", "guided_json": {"type": "object"}}, 400, "unknown field 'guided_json'", "guided_json",
     None),
    (CMPL, {"prompt": "Hi", "suffix": "x"}, 400, "suffix is not supported", "suffix", None),
    (CMPL, {"prompt": "Hi", "user": "u1", "metadata": {"a": "b"}, "store": False, "service_tier": "auto"}, 200, "",
     None, None),
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
    (CHAT, {"messages": USER, "tools": [{"type": "function"}]}, 400, "tools.0.function is required", "tools", None),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "a b"}}]}, 400,
     "should match pattern", "tools", None),
    (CHAT, {"messages": USER, "tools": [TOOL, TOOL]}, 400, "given twice", "tools", None),
    (CHAT, {"messages": USER, "tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     400, "'nope', which is not in tools", "tool_choice", None),
    (CHAT, {"messages": USER, "tool_choice": "required"}, 400, "needs tools", "tool_choice", None),
    (CHAT, {"messages": USER, "tools": [TOOL], "tool_choice": "sometimes"}, 400, "tool_choice must be", "tool_choice",
     None),
    (CHAT, {"messages": USER, "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}],
            "tool_choice": "required"}, 400, "tools: structured json: type must be", "tools", None),
    (CHAT, {"messages": USER, "tools": [TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     400, "drop response_format", "response_format", None),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema"}}, 400, "needs json_schema.schema",
     "response_format", None),
    (CHAT, {"messages": USER, "response_format": {"type": "xml"}}, 400, "response_format.type", "response_format",
     None),
    (CHAT, {"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "array", "minItems": "two"}}}}, 400, "minitems", "response_format", None),
    (CHAT, {"messages": USER, "response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, 400,
     "one output constraint", "structured_outputs", None),
    (CHAT, {"messages": [*USER, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}, 400,
     "arguments must be JSON", "messages", None),
    (CHAT, {"messages": USER, "functions": [{"name": "f"}]}, 400, "unknown field 'functions'", "functions", None),
    (CHAT, {"messages": USER, "parallel_tool_calls": False, "user": "u", "prompt_cache_key": "k",
            "safety_identifier": "s"}, 200, "", None, None),
    (CHAT, {"messages": USER, "n": "2"}, 400, "n:", "n", None),
]


@pytest.mark.parametrize(("path", "body", "status", "words", "param", "code"), CASES,
                         ids=[f"{i}-{c[0].rsplit('/', 1)[-1]}-{c[3][:24]}" for i, c in enumerate(CASES)])
def test_bad_request_then_good(http, path, body, status, words, param, code):
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    if status == 200:   # accepted fields: shorten the answer
        content = json.dumps({**body, "max_tokens": 1}).encode()
    r = http.post(path, content=content, headers={"content-type": "application/json"})
    if status == 200:
        assert r.status_code == 200, r.text
    else:
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

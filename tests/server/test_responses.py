"""``POST /v1/responses`` against a live server: the same engine path as chat (text, usage,
constraints, salts), the official ``openai`` client's Responses API, streaming events, and
the options it refuses."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from live_server import MODEL, running_server
from poison import POISON, install_poison
from pydantic import BaseModel

RESP = "/v1/responses"
CHAT = "/v1/chat/completions"
QUESTION = "What is 2+2?"          # greedy: a 12-token answer, then end of sequence
LONG_QUESTION = "Name a colour."   # greedy: an 18-token answer
GREEDY = {"model": MODEL, "temperature": 0}
HEAD = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
TAIL = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
PET_SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(default_model):
    with running_server(default_model) as s:
        install_poison(s.ctx.engine.engine)   # only requests asking for the regex "poison" fail
        yield s
        s.wait_idle()
        s.ctx.engine.engine.check_integrity()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def respond(http: httpx.Client, **body) -> dict:
    r = http.post(RESP, json={**GREEDY, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(http: httpx.Client, messages: list[dict], max_tokens: int, **body) -> dict:
    r = http.post(CHAT, json={**GREEDY, "messages": messages, "max_tokens": max_tokens, **body})
    assert r.status_code == 200, r.text
    return r.json()


def text_of(response: dict) -> str:
    (item,) = response["output"]
    (part,) = item["content"]
    assert part == {"type": "output_text", "text": part["text"], "annotations": []}
    return part["text"]


def sse_events(http: httpx.Client, **body) -> list[tuple[str, dict]]:
    """The (event name, payload) pairs of a streamed response."""
    events = []
    with http.stream("POST", RESP, json={**GREEDY, **body, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        blocks = "".join(r.iter_text()).split("\n\n")
    assert blocks[-1] == ""
    for block in blocks[:-1]:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        events.append((event[7:], json.loads(data[6:])))
    return events


@pytest.mark.parametrize("question, max_tokens, status", [(QUESTION, 32, "completed"),
                                                          (LONG_QUESTION, 16, "incomplete")])
def test_greedy_text_and_usage_equal_chat(http, question, max_tokens, status):
    messages = [{"role": "user", "content": question}]
    respond(http, input=question, max_output_tokens=max_tokens)   # both below see the prompt cached
    c = chat(http, messages, max_tokens)
    r = respond(http, input=question, max_output_tokens=max_tokens)
    assert text_of(r) == c["choices"][0]["message"]["content"] != ""
    assert c["choices"][0]["finish_reason"] == {"completed": "stop", "incomplete": "length"}[status]
    assert r["status"] == r["output"][0]["status"] == status
    cu = c["usage"]
    assert r["usage"] == {"input_tokens": cu["prompt_tokens"],
                          "input_tokens_details": {"cached_tokens": cu["prompt_tokens_details"]["cached_tokens"]},
                          "output_tokens": cu["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": cu["total_tokens"]}
    assert r["usage"]["input_tokens_details"]["cached_tokens"] == 32   # the prompt's two full blocks


def test_message_items_are_chat_messages(http):
    messages = [{"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."},
                {"role": "user", "content": "Another one?"}]
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a "},
                                                             {"type": "input_text", "text": "colour."}]},
             {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
              "content": [{"type": "output_text", "text": "Blue.", "annotations": []}]},
             {"role": "user", "content": "Another one?"}]
    c = chat(http, messages, 16)
    r = respond(http, input=items, max_output_tokens=16)
    assert text_of(r) == c["choices"][0]["message"]["content"]
    assert r["usage"]["input_tokens"] == c["usage"]["prompt_tokens"]
    # developer is system, as in chat
    c = chat(http, [{"role": "system", "content": "Be brief."}, *messages[:1]], 16)
    r = respond(http, input=[{"role": "developer", "content": "Be brief."}, *items[:1]], max_output_tokens=16)
    assert text_of(r) == c["choices"][0]["message"]["content"]


def test_instructions_are_the_leading_system_message(http):
    system = "Answer in French."
    c = chat(http, [{"role": "system", "content": system}, {"role": "user", "content": "Hi"}], 16)
    r = respond(http, instructions=system, input="Hi", max_output_tokens=16)
    assert text_of(r) == c["choices"][0]["message"]["content"]
    assert r["usage"]["input_tokens"] == c["usage"]["prompt_tokens"]
    assert r["instructions"] == system
    plain = chat(http, [{"role": "user", "content": "Hi"}], 16)
    assert plain["usage"]["prompt_tokens"] != c["usage"]["prompt_tokens"]   # the default system prompt is replaced


def test_response_object(http, server):
    lengths = server.metric('kvserve_requests_total{finish_reason="length"}')
    r = respond(http, input=LONG_QUESTION, max_output_tokens=8, top_p=0.5, metadata={"k": "v"})
    assert r["id"].startswith("resp_") and len(r["id"]) == 5 + 32
    assert r["output"][0]["id"].startswith("msg_") and r["output"][0]["id"] != r["id"][5:]
    assert {k: v for k, v in r.items() if k not in ("id", "created_at", "completed_at", "output", "usage")} == {
        "object": "response", "status": "incomplete", "incomplete_details": {"reason": "max_output_tokens"},
        "error": None, "model": MODEL, "instructions": None, "max_output_tokens": 8, "temperature": 0.0,
        "top_p": 0.5, "text": {"format": {"type": "text"}}, "tools": [], "tool_choice": "none",
        "parallel_tool_calls": False, "truncation": "disabled", "store": False, "background": False,
        "metadata": {"k": "v"}, "user": None}
    assert r["completed_at"] >= r["created_at"] > 0
    assert {k: v for k, v in r["output"][0].items() if k not in ("id", "content")} == {
        "type": "message", "status": "incomplete", "role": "assistant"}
    assert r["usage"]["output_tokens"] == 8
    # the request counts go through the same metrics as chat's
    assert server.metric('kvserve_requests_total{finish_reason="length"}') == lengths + 1


def test_openai_client(client, http):
    expected = text_of(respond(http, input=QUESTION, max_output_tokens=32))
    r = client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=32, temperature=0)
    assert isinstance(r, openai.types.responses.Response)
    assert r.output_text == expected and r.status == "completed" and r.incomplete_details is None
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.output_tokens == 12 and r.usage.input_tokens_details.cached_tokens == 32
    assert r.usage.total_tokens == r.usage.input_tokens + 12
    # an earlier output item passed back as input, as the SDK serializes it
    follow = client.responses.create(model=MODEL, input=[{"role": "user", "content": QUESTION}, *r.output,
                                                         {"role": "user", "content": "And 3+3?"}],
                                     max_output_tokens=16, temperature=0)
    c = chat(http, [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": expected},
                    {"role": "user", "content": "And 3+3?"}], 16)
    assert follow.output_text == c["choices"][0]["message"]["content"]


def test_openai_client_streaming(client, http):
    expected = text_of(respond(http, input=QUESTION, max_output_tokens=32))
    events = list(client.responses.create(model=MODEL, input=QUESTION, max_output_tokens=32, temperature=0,
                                          stream=True))
    types = [e.type for e in events]
    num_deltas = len(types) - len(HEAD) - len(TAIL) - 1
    assert num_deltas >= 2
    assert types == HEAD + ["response.output_text.delta"] * num_deltas + TAIL + ["response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = events[len(HEAD):len(HEAD) + num_deltas]
    assert "".join(d.delta for d in deltas) == events[-4].text == events[-1].response.output_text == expected
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.usage is None
    assert final.id == created.id and final.status == "completed" and final.usage.output_tokens == 12
    item_id = events[2].item.id
    assert events[2].item.status == "in_progress" and events[2].item.content == []
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0
               for e in [events[3], *deltas, events[-4], events[-3]])
    assert all(e.logprobs == [] for e in [*deltas, events[-4]])
    assert events[3].part.text == "" and events[-3].part.text == expected
    assert events[-2].item.id == final.output[0].id == item_id and events[-2].item.status == "completed"
    # the SDK's stream helper accumulates the same response
    with client.responses.stream(model=MODEL, input=QUESTION, max_output_tokens=32, temperature=0) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        assert stream.get_final_response().output_text == streamed == expected


def test_stream_wire_format_and_incomplete_end(http):
    expected = respond(http, input=LONG_QUESTION, max_output_tokens=8)
    events = sse_events(http, input=LONG_QUESTION, max_output_tokens=8)
    assert all(name == payload["type"] for name, payload in events)
    assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
    assert [n for n, _ in events][-4:] == [*TAIL, "response.incomplete"]   # OpenAI's end for a cut response
    final = events[-1][1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert text_of(final) == text_of(expected) == "".join(p["delta"] for n, p in events if n.endswith(".delta"))
    assert final["usage"] == expected["usage"]


def test_max_output_tokens_reached(client):
    r = client.responses.create(model=MODEL, input=LONG_QUESTION, max_output_tokens=4, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 4 and r.max_output_tokens == 4


def test_json_schema_format(http, client):
    fmt = {"type": "json_schema", "name": "pet", "schema": PET_SCHEMA, "strict": True}
    r = respond(http, input="Describe a pet as JSON.", max_output_tokens=32, text={"format": fmt})
    assert r["status"] == "completed" and r["text"] == {"format": fmt}
    pet = json.loads(text_of(r))
    assert set(pet) == {"name", "age"} and isinstance(pet["name"], str) and isinstance(pet["age"], int)
    r = respond(http, input="Describe a pet as JSON.", max_output_tokens=64, text={"format": {"type": "json_object"}})
    assert r["status"] == "completed" and isinstance(json.loads(text_of(r)), dict)

    class Pet(BaseModel):
        name: str
        age: int

    parsed = client.responses.parse(model=MODEL, input="Describe a pet as JSON.", text_format=Pet,
                                    max_output_tokens=32, temperature=0)
    assert isinstance(parsed.output_parsed, Pet) and parsed.output_parsed.model_dump() == pet


def test_cache_salt_applies_as_in_chat(http):
    messages = [{"role": "user", "content": QUESTION}]
    respond(http, input=QUESTION, max_output_tokens=1)                    # unsalted blocks cached
    salted = respond(http, input=QUESTION, max_output_tokens=1, cache_salt="tenant-a")
    assert salted["usage"]["input_tokens_details"]["cached_tokens"] == 0
    c = chat(http, messages, 1, cache_salt="tenant-a")                    # finds the response's salted blocks
    assert c["usage"]["prompt_tokens_details"]["cached_tokens"] == 32


def test_stream_failure_ends_with_an_error_event(http, client, server):
    events = sse_events(http, input="Hi", max_output_tokens=16, **POISON)
    name, error = events[-1]
    assert name == "error" and [n for n, _ in events[:len(HEAD)]] == HEAD
    assert error == {"type": "error", "code": "server_error", "param": None, "sequence_number": len(events) - 1,
                     "message": error["message"]}
    assert "poisoned grammar" in error["message"]
    sdk_events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=16, temperature=0,
                                              stream=True, extra_body=POISON))
    assert sdk_events[-1].type == "error" and "poisoned grammar" in sdk_events[-1].message
    r = http.post(RESP, json={"input": "Hi", "max_output_tokens": 16, **POISON})
    assert r.status_code == 500 and "poisoned grammar" in r.json()["error"]["message"]
    server.wait_idle()


def test_disconnect_mid_stream_aborts(http, server):
    aborts = server.metric('kvserve_requests_total{finish_reason="abort"}')
    body = {**GREEDY, "input": "Tell me a long story.", "max_output_tokens": 300, "ignore_eos": True, "stream": True}
    with http.stream("POST", RESP, json=body) as r:
        for line in r.iter_lines():
            if '"response.output_text.delta"' in line and line.startswith("data: "):
                assert server.metric("kvserve_num_requests_running") == 1
                break
    server.wait_idle()
    assert server.metric('kvserve_requests_total{finish_reason="abort"}') == aborts + 1
    assert server.metric("kvserve_kv_free_blocks") == server.metric("kvserve_kv_blocks")


REFUSED = [
    # (extra body fields, param, words in the message)
    ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools", "tools"),
    ({"tool_choice": "required"}, "tool_choice", "no tools"),
    ({"previous_response_id": "resp_123"}, "previous_response_id", "keeps no responses"),
    ({"conversation": "conv_123"}, "conversation", "keeps no responses"),
    ({"store": True}, "store", "store true is not supported"),
    ({"background": True}, "background", "none is kept"),
    ({"reasoning": {"effort": "low"}}, "reasoning", "no reasoning mode"),
    ({"include": ["message.output_text.logprobs"]}, "include", "nothing extra"),
    ({"truncation": "auto"}, "truncation", "only 'disabled'"),
    ({"top_logprobs": 2}, "top_logprobs", "no logprobs"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt templates"),
    ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
    ({"max_output_tokens": 600}, "max_output_tokens", "context window"),
    ({"frobnicate": 1}, "frobnicate", "unknown field 'frobnicate'"),
    ({"stop": ["x"]}, "stop", "unknown field 'stop'"),
    ({"response_format": {"type": "json_object"}}, "response_format", "unknown field"),
    ({"text": {"format": {"type": "json_schema", "schema": PET_SCHEMA}}}, "text.format", "needs name"),
    ({"text": {"format": {"type": "json_schema", "name": "pet"}}}, "text.format", "needs schema"),
    ({"text": {"format": {"type": "text", "name": "pet"}}}, "text.format", "go with type json_schema"),
    ({"text": {"format": {"type": "json_object"}}, "structured_outputs": {"regex": "a+"}}, "structured_outputs",
     "one output constraint"),
    ({"text": {"verbosity": "low"}}, "text.verbosity", "unknown field"),
    ({"model": "gpt-4o"}, "model", "does not exist"),
]


@pytest.mark.parametrize("extra, param, words", REFUSED)
def test_refused_fields_name_themselves(http, server, extra, param, words):
    errors = server.metric('kvserve_api_errors_total{status="400"}')
    r = http.post(RESP, json={"input": "Hi", **extra})
    assert r.status_code == (404 if param == "model" else 400), r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    if param != "model":
        assert server.metric('kvserve_api_errors_total{status="400"}') == errors + 1


@pytest.mark.parametrize("body, param, words", [
    ({}, "input", "input is required"),
    ({"input": []}, "input", "at least one message"),
    ({"input": 5}, "input", "input must be a string or a list"),
    ({"input": [{"role": "user"}]}, "input", "input.0.content is required"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": "4"}]}, "input", "should be 'message'"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input",
     "input.0.content must be a string or a list"),
    ({"input": [{"role": "tool", "content": "4"}]}, "input", "input.0.role"),
])
def test_bad_input(http, body, param, words):
    r = http.post(RESP, json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param and words in r.json()["error"]["message"]


def test_neutral_values_of_refused_fields_are_accepted(http):
    r = respond(http, input=QUESTION, max_output_tokens=32, store=False, tools=[], tool_choice="none", include=[],
                truncation="disabled", background=False, top_logprobs=0, parallel_tool_calls=True, user="u")
    assert r["status"] == "completed" and text_of(r) == text_of(respond(http, input=QUESTION, max_output_tokens=32))
    assert r["parallel_tool_calls"] is True and r["user"] == "u"


def test_openapi_lists_the_body(http):
    spec = http.get("/openapi.json").json()
    body = spec["paths"][RESP]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ResponsesRequest"}
    model = spec["components"]["schemas"]["ResponsesRequest"]
    assert model["additionalProperties"] is False and model["required"] == ["input"]
    assert {"input", "instructions", "max_output_tokens", "text", "cache_salt", "seed"} <= set(model["properties"])
    assert not {"stop", "n", "response_format", "messages"} & set(model["properties"])

"""Structured outputs, tools and sampling extras through the official ``openai`` client."""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import re

import jsonschema
import openai
import pytest
from live_server import MODEL, running_server

from kvserve.model.tokenizer import Tokenizer

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 3},
    },
    "required": ["name", "age", "colour", "tags"],
    "additionalProperties": False,
}
TOPICS = ["a pilot", "a baker", "a child", "a poet", "a nurse", "a farmer", "a judge", "a sailor", "a chef",
          "a student", "a painter", "a miner", "a doctor", "a singer", "a king", "a robot", "a teacher", "a monk",
          "a diver", "a clown"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 12}},
                                       "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(default_model):
    with running_server(default_model, num_kv_blocks=256) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def chat(client, **kw):
    return client.chat.completions.create(model=MODEL, **{"max_tokens": 80, "temperature": 0, **kw})


def test_json_schema_responses_validate_for_20_prompts(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def ask(topic: str):
        return chat(client, messages=[{"role": "user", "content": f"Describe {topic} as JSON."}], response_format=fmt)

    with cf.ThreadPoolExecutor(20) as pool:   # all at once: they batch together
        replies = list(pool.map(ask, TOPICS))
    for r in replies:
        assert r.choices[0].finish_reason == "stop", r.choices[0].message.content
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)


def test_json_object_and_vllm_structured_outputs(client):
    r = chat(client, messages=[{"role": "user", "content": "Reply with a JSON object with a key 'ok'."}],
             response_format={"type": "json_object"}, max_tokens=120)
    assert r.choices[0].message.content.startswith("{")
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    choice = client.completions.create(model=MODEL, prompt="Is the sky green? Answer:", max_tokens=8,
                                       extra_body={"structured_outputs": {"choice": ["yes", "no", "maybe"]}})
    assert choice.choices[0].text in ("yes", "no", "maybe") and choice.choices[0].finish_reason == "stop"
    regex = client.completions.create(model=MODEL, prompt="Call me on", max_tokens=24, temperature=0.8, seed=3,
                                      extra_body={"structured_outputs": {"regex": r"\+44 [0-9]{4} [0-9]{6}"}})
    assert re.fullmatch(r"\+44 [0-9]{4} [0-9]{6}", regex.choices[0].text)
    lark = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=8, extra_body={
        "structured_outputs": {"grammar": 'start: "A" digit digit\ndigit: /[0-9]/'}})
    assert re.fullmatch(r"A[0-9]{2}", lark.choices[0].text)
    schema = client.completions.create(model=MODEL, prompt="A person:", max_tokens=80, temperature=0,
                                       extra_body={"structured_outputs": {"json": PERSON}})
    jsonschema.validate(json.loads(schema.choices[0].text), PERSON)


def test_constrained_and_plain_requests_batch_without_interfering(client, server):
    plain = {"prompt": "The capital of France is", "max_tokens": 12, "temperature": 0,
             "extra_body": {"ignore_eos": True}}
    alone = client.completions.create(model=MODEL, **plain).choices[0].text
    steps = server.metric("kvserve_engine_steps_total")
    with cf.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(client.completions.create, model=MODEL, **plain)]
        futures += [pool.submit(client.completions.create, model=MODEL, prompt=f"Number {i}:", max_tokens=12,
                                extra_body={"structured_outputs": {"regex": "[0-9]{12}"}}) for i in range(3)]
        outs = [f.result() for f in futures]
    assert outs[0].choices[0].text == alone                          # its row was never masked
    assert all(re.fullmatch("[0-9]{12}", o.choices[0].text) for o in outs[1:])
    assert server.metric("kvserve_engine_steps_total") - steps < 4 * 13   # they shared steps


def test_required_tool_call_parses_into_the_tools_arguments(client):
    r = chat(client, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert calls and all(c.type == "function" and c.id.startswith("call_") for c in calls)
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CLOCK)}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_named_tool_call_streams_and_history_is_accepted(client):
    named = {"type": "function", "function": {"name": "get_time"}}
    r = chat(client, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named)
    call = r.choices[0].message.tool_calls[0]
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), CLOCK["function"]["parameters"])

    chunks = list(chat(client, messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named, stream=True))
    deltas = [c.choices[0] for c in chunks if c.choices]
    streamed = [tc for d in deltas for tc in (d.delta.tool_calls or [])]
    assert len(streamed) == 1 and streamed[0].function.name == "get_time"
    assert streamed[0].function.arguments == call.function.arguments and deltas[-1].finish_reason == "tool_calls"

    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
               {"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'}]
    answer = chat(client, messages=history, tools=[WEATHER, CLOCK], max_tokens=8)
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None


def test_auto_and_none_give_text_with_smollm2(client, default_model):
    assert not default_model.tokenizer.template_declares_tools   # so auto behaves as none
    for tool_choice in ("auto", "none"):
        r = chat(client, messages=ASK, tools=[WEATHER], tool_choice=tool_choice, max_tokens=6)
        assert r.choices[0].message.tool_calls is None and r.choices[0].message.content


def test_logit_bias_moves_greedy_to_the_runner_up(client, default_model):
    kw = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 1, "temperature": 0, "logprobs": 2}
    first = client.completions.create(**kw).choices[0].logprobs.top_logprobs[0]
    best, runner_up = sorted(first, key=first.get, reverse=True)
    best_id = default_model.tokenizer.encode(best)
    assert len(best_id) == 1
    biased = client.completions.create(**kw, logit_bias={str(best_id[0]): -100}).choices[0]
    assert biased.text == runner_up
    boosted = client.completions.create(**{**kw, "logprobs": None}, logit_bias={"1234": 100}).choices[0]
    assert boosted.text == default_model.tokenizer.decode([1234])


def test_penalties_and_min_tokens(client):
    base = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 60}
    short = chat(client, **base)
    assert short.choices[0].finish_reason == "stop"
    n = short.usage.completion_tokens
    longer = chat(client, **base, extra_body={"min_tokens": n + 5})
    assert longer.usage.completion_tokens >= n + 5
    loop = {"model": MODEL, "prompt": "one one one one one one", "max_tokens": 12, "temperature": 0, "logprobs": 0}

    def distinct_tokens(**extra) -> int:
        r = client.completions.create(**loop, extra_body={"ignore_eos": True, **extra})
        tokens = r.choices[0].logprobs.tokens
        assert len(tokens) == 12
        return len(set(tokens))

    plain = distinct_tokens()
    assert plain < 12                                   # greedy repeats itself
    assert distinct_tokens(frequency_penalty=2.0, presence_penalty=2.0) > plain
    assert distinct_tokens(repetition_penalty=2.0) > plain


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nYou may call these tools:\n{% for t in tools %}{{ t.function | tojson }}\n"
    "{% endfor %}Call one as <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>.<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HERMES_CALL = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}", "unit": "celsius"\}\}</tool_call>'


@pytest.fixture(scope="module")
def hermes_client(default_model):
    """The default model behind a chat template that declares tools (Hermes style)."""
    tokenizer = Tokenizer.from_json(json.dumps({**json.loads(default_model.tokenizer.to_json()),
                                                "chat_template": HERMES_TEMPLATE}))
    with (running_server(dataclasses.replace(default_model, tokenizer=tokenizer), num_kv_blocks=64) as s,
          openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0, timeout=120) as c):
        yield c


def test_auto_reads_hermes_calls_when_the_template_declares_tools(hermes_client):
    kw = {"messages": ASK, "tools": [WEATHER, CLOCK], "max_tokens": 60}
    shown = chat(hermes_client, **kw, tool_choice="auto", extra_body={"structured_outputs": {"regex": HERMES_CALL}})
    hidden = chat(hermes_client, **kw, tool_choice="none", max_completion_tokens=4)
    assert shown.usage.prompt_tokens > hidden.usage.prompt_tokens + 20        # the template rendered the tools
    choice = shown.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    chunks = list(chat(hermes_client, **kw, tool_choice="auto", stream=True,
                       extra_body={"structured_outputs": {"regex": r"Sure\. " + HERMES_CALL}}))
    deltas = [c.choices[0] for c in chunks if c.choices]
    assert "".join(d.delta.content or "" for d in deltas) == "Sure."
    assert [tc.function.name for d in deltas for tc in d.delta.tool_calls or []] == ["get_weather"]
    assert deltas[-1].finish_reason == "tool_calls"
    plain = chat(hermes_client, **kw, tool_choice="auto", max_completion_tokens=4)   # no call: text, as written
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content

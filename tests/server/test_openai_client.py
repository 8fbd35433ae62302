"""The official ``openai`` client against a live server: what clients and harnesses rely on."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
from live_server import MODEL, running_server

SYSTEM = ("You are a helpful assistant for a small bookshop. You answer questions about opening hours, "
          "orders and recommendations. Be polite, concise and accurate in every answer you give.")


@pytest.fixture(scope="module")
def server(default_model):
    with running_server(default_model) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c


def test_models(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_completion_text_and_usage(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0)
    assert r.object == "text_completion" and r.model == MODEL
    assert len(r.choices) == 1 and r.choices[0].finish_reason == "length" and r.choices[0].text
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 3 and r.usage.total_tokens == 8


def test_completion_prompt_forms_and_n(client, default_model):
    ids = default_model.tokenizer.encode("The capital of France is")
    by_text = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=2, temperature=0)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=2, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    batch = client.completions.create(model=MODEL, prompt=[ids, [ids[0]]], max_tokens=2, n=2, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == by_text.choices[0].text
    assert batch.usage.prompt_tokens == len(ids) + 1 and batch.usage.completion_tokens == 8


def test_seeded_sampling_repeats_and_choices_differ(client):
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 4, "temperature": 1.0, "seed": 7, "n": 2}
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]


def test_chat_and_streaming_with_usage(client):
    messages = [{"role": "user", "content": "Name a colour."}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=4, temperature=0)
    assert full.choices[0].message.role == "assistant" and full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens == 4
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_completion_streaming(client):
    full = client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=4, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="One, two, three,", max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 4


def test_stop_string_is_never_streamed(client):
    prompt = "Count: 1, 2, 3, 4,"
    text = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0).choices[0].text
    at = next(i for i in range(2, len(text) - 2) if text.find(text[i:i + 2]) == i)
    stop = text[at:at + 2]
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0, stop=[stop],
                                            stream=True))
    streamed = "".join(c.choices[0].text for c in chunks)
    assert streamed == text[:at] and chunks[-1].choices[0].finish_reason == "stop"


def test_echo_logprobs_as_lm_eval_reads_them(client):
    prompt = "The quick brown fox jumps over the lazy dog"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
    c, n_prompt = r.choices[0], r.usage.prompt_tokens
    lp = c.logprobs
    assert c.text.startswith(prompt) and len(lp.tokens) == n_prompt + 1 == len(lp.token_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 and math.isfinite(x) for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens) == c.text and lp.text_offset[0] == 0
    assert lp.text_offset == sorted(lp.text_offset)
    # greedy: the generated token is its position's best
    top = lp.top_logprobs[-1]
    assert max(top, key=top.get) == lp.tokens[-1]
    # lm-eval's loglikelihood of a continuation: sum over [ctxlen:-1]
    assert sum(lp.token_logprobs[3:-1]) < 0
    # max_tokens=0 with echo scores the prompt alone
    r0 = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0)
    assert r0.choices[0].text == prompt and r0.usage.completion_tokens == 0
    assert r0.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:-1], abs=1e-4)


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    assert content[0].top_logprobs[0].logprob == pytest.approx(content[0].logprob)   # greedy
    assert bytes(b for t in content for b in t.bytes).decode() == r.choices[0].message.content


def test_cached_tokens_rise_on_repeated_prefix(client, server):
    httpx.post(f"{server.url}/v1/cache/reset").raise_for_status()
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "When do you open?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages[1]["content"] = "Do you sell gift cards?"
    second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 32 <= cached < second.usage.prompt_tokens and cached % 16 == 0
    reset = httpx.post(f"{server.url}/v1/cache/reset").json()
    assert reset["reset"] and reset["num_dropped_blocks"] >= cached // 16
    third = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert third.usage.prompt_tokens_details.cached_tokens == 0
    assert server.metric('kvserve_prefix_cache_hit_tokens_total{tier="device"}') >= cached


def test_concurrent_requests_batch_together(client, server):
    import concurrent.futures as cf

    steps = server.metric("kvserve_engine_steps_total")
    with cf.ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: client.completions.create(
            model=MODEL, prompt=f"Story {i}:", max_tokens=6, temperature=0, extra_body={"ignore_eos": True}),
            range(4)))
    assert all(o.usage.completion_tokens == 6 for o in outs)
    assert server.metric("kvserve_engine_steps_total") - steps < 4 * 6   # shared steps
    server.wait_idle()
    server.ctx.engine.engine.check_integrity()   # the engine thread is idle (blocked on its queue)

"""Cache control over HTTP: cache_control breakpoints, cache_priority, /v1/cache/pin and unpin,
limits, expiry on a stepped clock, metrics. The default model; a 24-block pool, pins limited
to a quarter of it (6 blocks)."""

from __future__ import annotations

import random

import httpx
import pytest
from fake_clock import FakeClock
from live_server import MODEL, running_server

CHAT = "/v1/chat/completions"
CMPL = "/v1/completions"
SYSTEM = ("You are the assistant of a small bookshop by the harbour. Answer questions about opening hours, "
          "orders and recommendations, politely and briefly.")


@pytest.fixture(scope="module")
def clock():
    return FakeClock()


@pytest.fixture(scope="module")
def server(default_model, clock):
    with running_server(default_model, clock=clock, num_kv_blocks=24, max_pinned_fraction=0.25,
                        max_pin_ttl_s=600) as s:
        yield s


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
        assert c.post("/v1/cache/unpin", json={"all": True}).status_code == 200   # the next test starts unpinned


def chat(http: httpx.Client, user: str, system_pin: dict | None = None, **extra) -> dict:
    system: dict = {"role": "system", "content": SYSTEM}
    if system_pin is not None:
        system["cache_control"] = system_pin
    r = http.post(CHAT, json={"model": MODEL, "messages": [system, {"role": "user", "content": user}],
                              "max_tokens": 2, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def flood(http: httpx.Client, seed: int, count: int = 3) -> None:
    """Distinct token-id prompts of 17 blocks each: together they evict every unpinned block."""
    rng = random.Random(seed)
    for _ in range(count):
        r = http.post(CMPL, json={"model": MODEL, "prompt": [rng.randrange(1000, 40000) for _ in range(270)],
                                  "max_tokens": 1})
        assert r.status_code == 200, r.text


def system_tokens(server) -> int:
    """Full-block tokens of the system message rendered alone (what a breakpoint on it pins)."""
    tok = server.ctx.tokenizer
    n = len(tok.encode(tok.apply_chat_template([{"role": "system", "content": SYSTEM}], add_generation_prompt=False)))
    return n // 16 * 16


def test_a_breakpoint_pins_the_system_prompt_through_a_flood(server, http):
    pinned = system_tokens(server)
    assert pinned >= 16
    hits_before = server.metric("kvserve_pin_hit_tokens_total")
    chat(http, "When do you open on Sundays?", {"type": "pin", "ttl": 120})
    [pin] = http.get("/v1/cache/pins").json()["data"]
    assert (pin["num_tokens"], pin["device_tokens"], pin["expires_in"]) == (pinned, pinned, 120)
    assert len(pin["block_keys"]) == pinned // 16 and all(len(k) == 64 for k in pin["block_keys"])
    flood(http, seed=1)
    other = chat(http, "Unrelated: do you sell maps of the coast?")   # no breakpoint: the pin holds anyway
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == pinned
    assert server.metric("kvserve_pin_hit_tokens_total") - hits_before == pinned
    assert server.metric("kvserve_pins") == 1
    assert server.metric("kvserve_pinned_blocks") == pinned // 16
    assert server.metric("kvserve_pin_limit_blocks") == 6
    server.ctx.engine.engine.check_integrity()


def test_pin_and_unpin_by_messages_and_by_token_ids(server, http):
    r = http.post("/v1/cache/pin", json={"messages": [{"role": "system", "content": SYSTEM}], "ttl": 30})
    assert r.status_code == 200, r.text
    body = r.json()
    pinned = system_tokens(server)
    assert (body["object"], body["pinned"], body["num_tokens"], body["device_tokens"]) == (
        "cache.pin", True, pinned, pinned)
    flood(http, seed=2)
    assert chat(http, "Is there parking?")["usage"]["prompt_tokens_details"]["cached_tokens"] == pinned
    r = http.post("/v1/cache/unpin", json={"messages": [{"role": "system", "content": SYSTEM}]})
    assert r.status_code == 200 and r.json()["pinned"] is False and r.json()["num_tokens"] == pinned
    r = http.post("/v1/cache/unpin", json={"messages": [{"role": "system", "content": SYSTEM}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "pin_not_found"
    flood(http, seed=3)
    assert chat(http, "Is there parking?")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # token ids, with a breakpoint: the first 32 tokens
    ids = list(range(2000, 2040))
    r = http.post("/v1/cache/pin", json={"prompt": ids, "num_tokens": 32, "warm": False})
    assert r.status_code == 200 and (r.json()["num_tokens"], r.json()["device_tokens"]) == (32, 0)
    assert http.post("/v1/cache/unpin", json={"prompt": ids[:32]}).status_code == 200


def test_an_expired_pin_is_evicted_like_any_block(server, http, clock):
    expired = server.metric("kvserve_pin_expirations_total")
    chat(http, "Do you ship abroad?", {"type": "pin", "ttl": 60})
    clock.now += 61
    flood(http, seed=4)
    assert http.get("/v1/cache/pins").json()["data"] == []
    assert chat(http, "Do you ship abroad?")["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert server.metric("kvserve_pin_expirations_total") - expired == 1


def test_completions_pin_and_priority(server, http):
    ids = [random.Random(5).randrange(1000, 40000) for _ in range(40)]
    r = http.post(CMPL, json={"model": MODEL, "prompt": ids, "max_tokens": 1, "cache_priority": "high",
                              "cache_control": {"type": "pin", "ttl": 30, "num_tokens": 20}})
    assert r.status_code == 200, r.text
    assert [p["num_tokens"] for p in http.get("/v1/cache/pins").json()["data"]] == [16]
    flood(http, seed=6)
    r = http.post(CMPL, json={"model": MODEL, "prompt": ids, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 32   # pinned block + the high one
    assert http.post("/v1/cache/unpin", json={"prompt": ids[:16]}).status_code == 200


@pytest.mark.parametrize(("path", "body", "status", "words", "code"), [
    ("/v1/cache/pin", {"prompt": list(range(3000, 3112))}, 400,
     "pinning 7 more blocks would make 7 pinned, over this engine's limit of 6 of 24 blocks", "pin_limit_exceeded"),
    ("/v1/cache/pin", {"prompt": list(range(3000, 3032)), "ttl": 601}, 400, "ttl must be in (0, 600]", None),
    ("/v1/cache/pin", {"prompt": list(range(3000, 3010))}, 400, "nothing to pin: the prefix has 10 tokens", None),
    ("/v1/cache/pin", {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}]}, 400, "exactly one", None),
    ("/v1/cache/pin", {}, 400, "exactly one", None),
    ("/v1/cache/pin", {"prompt": "Hi", "ttl": 0}, 400, "greater than 0", None),
    ("/v1/cache/pin", {"prompt": "Hi", "model": "gpt-4"}, 404, "does not exist", "model_not_found"),
    ("/v1/cache/unpin", {"prompt": list(range(3000, 3032))}, 404, "no pin covers exactly", "pin_not_found"),
    (CMPL, {"prompt": list(range(3000, 3112)), "max_tokens": 1, "cache_control": {"type": "pin"}}, 400,
     "over this engine's limit of 6 of 24 blocks", None),
    (CMPL, {"prompt": "Hi", "cache_control": {"type": "ephemeral"}}, 400, "cache_control.type", None),
    (CMPL, {"prompt": "Hi", "cache_control": {"type": "pin", "ttl": 5, "extra": 1}}, 400,
     "unknown field 'cache_control.extra'", None),
    (CMPL, {"prompt": "Hi", "cache_priority": "urgent"}, 400, "cache_priority", None),
    (CHAT, {"messages": [{"role": "user", "content": f"Hi {i}", "cache_control": {"type": "pin"}} for i in range(5)]},
     400, "at most 4 messages may carry cache_control", None),
    ("/v1/cache/unpin", {"all": True, "prompt": "Hi"}, 400, "give no prompt", None),
    (CHAT, {"messages": [{"role": "user", "content": "Hi " * 40, "cache_control": {"type": "pin", "ttl": 9999}}],
            "max_tokens": 1}, 400, "ttl must be in (0, 600]", None),
])
def test_bad_cache_control_gets_a_4xx_and_pins_nothing(http, path, body, status, words, code):
    r = http.post(path, json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert words.lower() in error["message"].lower(), error["message"]
    if code is not None:
        assert error["code"] == code
    assert http.get("/v1/cache/pins").json()["data"] == []


def test_the_cache_routes_need_the_api_key(default_model):
    with running_server(default_model, api_key="k", num_kv_blocks=24) as s:
        assert httpx.post(f"{s.url}/v1/cache/pin", json={"prompt": "Hi"}).status_code == 401
        assert httpx.get(f"{s.url}/v1/cache/pins").status_code == 401

"""The cluster on this machine: 2 engine replicas at fractional CPUs on a local Ray, a Redis
started here on loopback, the ingress on a free loopback port.

One cluster serves the whole module (it takes ~15 s to start); the tests run in file order,
the kill -9 last.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from live_server import running_server
from offload.redis_server import RedisServer, free_port
from poison import POISON, install_poison
from test_bad_input import CASES
from test_blend import DOC_A, DOC_B

from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams
from kvserve.server.async_engine import RequestSpec, StreamItem
from kvserve.server.serving import ServerSettings

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from kvserve.cluster.app import APP_NAME, ENGINE_DEPLOYMENT, ClusterConfig, build_application
from kvserve.cluster.local_ray import local_ray_options
from kvserve.cluster.wire import Accepted, RouteHint, digests, key_tag

MODEL = "SmolLM2-135M-Instruct"
ENGINE = {"num_kv_blocks": 24, "max_model_len": 512, "max_num_seqs": 2}   # 384 tokens of KV per replica
GREEDY = {"temperature": 0, "max_tokens": 8}


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("redis"))
    srv.start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def cluster(redis_url):
    ray.init(**local_ray_options(2, 96), log_to_driver=False)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        options = {**ENGINE, "redis_url": redis_url.url, "redis_backoff_s": 0.5, "write_through": True}
        config = ClusterConfig(num_replicas=2, replica_cpus=0.5, ingress_cpus=0.1, stats_period_s=0.5,
                               max_ongoing_requests=16)
        serve.run(build_application(None, options, ServerSettings(MODEL), config), name=APP_NAME, route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: metrics(url).get("kvserve_cluster_replicas", 0) == 2, 60)
        yield url
    finally:
        serve.shutdown()
        ray.shutdown()


def wait_for(check, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.1)


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def routed(url: str, outcome: str) -> dict[str, float]:
    """Requests per replica that got ``outcome`` (holder, away, cold)."""
    out = {}
    for name, value in metrics(url).items():
        if name.startswith("kvserve_cluster_routed_requests_total{") and f'outcome="{outcome}"' in name:
            out[name.split('replica="')[1].split('"')[0]] = value
    return out


def chat(url: str, messages: list[dict[str, str]]) -> dict:
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": messages, **GREEDY}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def conversation(tag: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": f"[{tag}] You are a patient tutor who answers in one sentence. " * 3},
            {"role": "user", "content": f"[{tag}] Why is the sky blue during the day and red at sunset?"}]


def test_turn_two_lands_on_the_replica_that_served_turn_one(cluster):
    messages = conversation("turn2")
    cold_before = routed(cluster, "cold")
    first = chat(cluster, messages)
    holder = next(r for r, n in routed(cluster, "cold").items() if n > cold_before.get(r, 0))
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "And on Mars?"}]
    holder_before = routed(cluster, "holder")
    second = chat(cluster, messages)
    assert routed(cluster, "holder").get(holder, 0) == holder_before.get(holder, 0) + 1
    # its history is cached there: every full block of turn 1's prompt at least
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= first["usage"]["prompt_tokens"] // 16 * 16


def test_a_prompt_with_segments_goes_to_the_replica_that_stored_them(cluster):
    """Another preamble and the documents in another order: no prefix block in common, so
    only the segments the first request stored make a replica the holder."""
    def complete(prompt: str, segments: list[str]) -> None:
        body = {"model": MODEL, "prompt": prompt, "segments": segments, **GREEDY}
        r = httpx.post(f"{cluster}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text

    cold_before = routed(cluster, "cold")
    complete(f"[segments] Notes:\n{DOC_A}\n{DOC_B}\nWho runs the bakery?", [DOC_A, DOC_B])
    holder = next(r for r, n in routed(cluster, "cold").items() if n > cold_before.get(r, 0))
    holder_before = routed(cluster, "holder")
    complete(f"Read these first, please.\n{DOC_B}\n{DOC_A}\nWhat did the keeper write?", [DOC_B, DOC_A])
    assert routed(cluster, "holder").get(holder, 0) == holder_before.get(holder, 0) + 1
    stored = f'kvserve_cluster_replica_segment_tokens_total{{kind="stored",replica="{holder}"}}'
    wait_for(lambda: metrics(cluster).get(stored, 0) == 48 + 32, 10)    # the documents' full blocks (55, 45 tokens)


def test_with_the_holder_excluded_the_other_replica_serves_it_from_redis(cluster, default_model):
    messages = conversation("redis")
    cold_before = routed(cluster, "cold")
    chat(cluster, messages)
    holder = next(r for r, n in routed(cluster, "cold").items() if n > cold_before.get(r, 0))
    messages.append({"role": "user", "content": "Say it again, shorter."})
    tok = default_model.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True))
    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)
    card = handle.describe.remote().result()
    hint = RouteHint(digests(card.block_keys(ids)), key_tag(card.extra_key), exclude=frozenset({holder}))
    before = {s.replica: s.engine for s in handle.broadcast("stats").results()}
    time.sleep(1.0)    # the holder's write-through puts finish in the background
    items = list(handle.options(method_name="generate", stream=True).remote(
        hint, [RequestSpec(ids, SamplingParams(**GREEDY))], "excluded"))
    served = items[0]
    assert isinstance(served, Accepted) and served.replica != holder
    final = items[-1]
    assert isinstance(final, StreamItem) and final.output.finished
    after = {s.replica: s.engine for s in handle.broadcast("stats").results()}
    tier_hits = after[served.replica].tier_hit_tokens - before[served.replica].tier_hit_tokens
    assert final.output.num_cached_tokens == tier_hits > 0           # from Redis: its device had none of it
    cold = LLM(loaded=default_model, enable_prefix_caching=False, num_kv_blocks=64, max_model_len=512)
    assert final.output.token_ids == cold.generate([ids], SamplingParams(**GREEDY))[0].token_ids


def test_a_bad_request_gets_the_single_servers_4xx(cluster, default_model):
    cases = [(path, body) for path, body, *_ in CASES]
    cases.append(("/v1/completions", {"prompt": "word " * 450, "max_tokens": 1}))   # the engine refuses: KV blocks
    with running_server(default_model, **ENGINE) as single:
        for path, body in cases:
            content = body if isinstance(body, bytes) else json.dumps(body).encode()
            answers = [httpx.post(base + path, content=content, headers={"content-type": "application/json"},
                                  timeout=60) for base in (single.url, cluster)]
            assert answers[0].status_code == answers[1].status_code, (body, answers[1].text)
            if answers[0].status_code >= 400:
                assert answers[0].json() == answers[1].json(), body
    assert "KV blocks" in answers[1].json()["error"]["message"]
    r = httpx.get(f"{cluster}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"


def test_a_request_that_fails_while_generating_fails_alone(cluster):
    import poison
    ray.cloudpickle.register_pickle_by_value(poison)       # the replicas cannot import tests/
    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)
    handle.broadcast("call", install_poison).results()
    url = f"{cluster}/v1/completions"
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 8, "temperature": 0}
    poisoned = httpx.post(url, json={**body, **POISON}, timeout=60)
    assert poisoned.status_code == 500, poisoned.text      # as on one server: the request's own error
    error = poisoned.json()["error"]
    assert error["type"] == "server_error" and "poisoned grammar" in error["message"]
    ok = httpx.post(url, json=body, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8


def test_metrics_per_replica_and_fleet(cluster):
    m = metrics(cluster)
    assert m['kvserve_cluster_prefix_hit_rate{replica="fleet",tier="all"}'] > 0
    assert m["kvserve_cluster_routed_to_holder_ratio"] > 0
    assert sum(v for k, v in m.items() if k.startswith("kvserve_cluster_replica_requests{")) >= 0
    assert any(k.startswith('kvserve_cluster_replica_prefix_hit_tokens_total{') and 'tier="redis"' in k for k in m)
    assert m['kvserve_requests_total{finish_reason="length"}'] >= 3     # the single server's series, too


def test_cache_routes_run_on_every_replica(cluster):
    system = [{"role": "system", "content": "[pins] A pinned system prompt for every replica. " * 4}]
    pin = httpx.post(f"{cluster}/v1/cache/pin", json={"messages": system, "ttl": 60}, timeout=60)
    assert pin.status_code == 200 and pin.json()["pinned"] and pin.json()["block_keys"], pin.text
    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)
    assert [s.engine.pins.num_pins for s in handle.broadcast("stats").results()] == [1, 1]
    pins = httpx.get(f"{cluster}/v1/cache/pins", timeout=30).json()["data"]
    assert [p["block_keys"] for p in pins] == [pin.json()["block_keys"]]
    assert httpx.post(f"{cluster}/v1/cache/unpin", json={"all": True}, timeout=30).status_code == 200
    reset = httpx.post(f"{cluster}/v1/cache/reset", timeout=30).json()
    assert reset["reset"] is True and reset["num_dropped_blocks"] >= len(pin.json()["block_keys"])


def test_redis_down_leaves_the_cluster_serving(cluster, redis_url):
    redis_url.stop()
    try:
        answer = chat(cluster, conversation("no-redis"))
        assert answer["usage"]["completion_tokens"] == GREEDY["max_tokens"]
    finally:
        redis_url.start()


async def _stream(client: httpx.AsyncClient, i: int, log: dict[int, dict], max_tokens: int = 24) -> None:
    entry = log[i] = {"tokens": 0, "error": None, "done": False}
    body = {"model": MODEL, "prompt": f"Request {i}: count slowly from one to one hundred.", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            data = line.removeprefix("data: ")
            if data == "[DONE]":
                entry["done"] = True
            elif line.startswith("data: "):
                event = json.loads(data)
                if "error" in event:
                    entry["error"] = event["error"]["message"]
                elif event["choices"] and event["choices"][0]["text"]:
                    entry["tokens"] += 1


def test_a_stream_whose_replica_dies_goes_on_elsewhere_with_the_same_tokens(cluster):
    """The replica streaming a greedy request is killed after its 10th chunk: the ingress sends
    the request, with the tokens it streamed, to the other replica, and the client reads one
    stream, the same text as the whole request run without a failure."""
    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)
    body = {"model": MODEL, "prompt": "Resume test: count slowly from one to one hundred.", "max_tokens": 300,
            "temperature": 0, "ignore_eos": True, "logprobs": 1}
    whole = httpx.post(f"{cluster}/v1/completions", json=body, timeout=180).json()["choices"][0]
    before = metrics(cluster)
    chunks: list[dict] = []

    async def run() -> None:
        async with httpx.AsyncClient(base_url=cluster, timeout=180) as client, \
                client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            assert r.status_code == 200
            killed = False
            async for line in r.aiter_lines():
                data = line.removeprefix("data: ")
                if not line.startswith("data: ") or data == "[DONE]":
                    continue
                event = json.loads(data)
                assert "error" not in event, event
                chunks.append(event["choices"][0])
                if len(chunks) == 10 and not killed:
                    stats = await asyncio.to_thread(lambda: handle.broadcast("stats").results())
                    running = [s.pid for s in stats if s.engine.num_running > 0]
                    assert len(running) == 1, "the request is running on one replica"
                    os.kill(running[0], signal.SIGKILL)
                    killed = True
            assert killed

    asyncio.run(run())
    assert "".join(c["text"] for c in chunks) == whole["text"]
    streamed_tokens = [t for c in chunks for t in c["logprobs"]["tokens"]]
    assert streamed_tokens == whole["logprobs"]["tokens"]
    assert chunks[-1]["finish_reason"] == "length"
    after = metrics(cluster)
    assert after["kvserve_cluster_resumes_total"] == before["kvserve_cluster_resumes_total"] + 1
    assert after.get('kvserve_requests_total{finish_reason="error"}', 0) == \
        before.get('kvserve_requests_total{finish_reason="error"}', 0)
    wait_for(lambda: metrics(cluster).get("kvserve_cluster_replicas", 0) == 2, 120)   # Serve replaces it


def test_kill_9_loses_no_request(cluster):
    handle = serve.get_deployment_handle(ENGINE_DEPLOYMENT, app_name=APP_NAME)
    before = metrics(cluster)
    log: dict[int, dict] = {}
    victim = ""

    async def holding_waiters() -> tuple[str, int]:
        """A replica with requests waiting for a seat (8 requests, 2 x 2 seats: one has some)."""
        for _ in range(200):
            stats = await asyncio.to_thread(lambda: handle.broadcast("stats").results())
            waiting = [(s.replica, s.pid) for s in stats if s.engine.num_waiting > 0]
            if waiting:
                return min(waiting)
            await asyncio.sleep(0.05)
        raise AssertionError("no replica held a waiting request")

    async def run() -> None:
        nonlocal victim
        async with httpx.AsyncClient(base_url=cluster, timeout=180) as client:
            # 8 requests on 2 replicas of 2 seats each: some run (and stream), the rest wait; each
            # runs long enough (150 tokens) that the waiting ones still wait when the victim dies
            tasks = [asyncio.ensure_future(_stream(client, i, log, max_tokens=150)) for i in range(8)]
            while not any(e["tokens"] for e in log.values()):
                await asyncio.sleep(0.05)
            victim, victim_pid = await holding_waiters()
            os.kill(victim_pid, signal.SIGKILL)
            await asyncio.gather(*tasks)

    asyncio.run(run())
    for i, entry in log.items():        # retried if it had not started, resumed if it had: none lost
        assert entry["error"] is None and entry["done"] and entry["tokens"] > 0, (i, entry)
    after = metrics(cluster)
    assert after["kvserve_cluster_retries_total"] > before["kvserve_cluster_retries_total"]   # some were waiting there
    # the router stops sending to it: later requests all succeed, none routed to the dead replica
    served = {k: v for k, v in after.items() if k.startswith("kvserve_cluster_routed_requests_total{")
              and victim in k}
    for i in range(4):
        chat(cluster, conversation(f"after-kill-{i}"))
    later = metrics(cluster)
    assert {k: later[k] for k in served} == served

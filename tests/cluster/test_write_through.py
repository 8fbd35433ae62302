"""Write-through: computed full blocks reach the shared tier at once, so another engine
sharing it gets its history, which it does not when blocks reach Redis only on eviction."""

from __future__ import annotations

import pytest
import redis

from kvserve.llm import LLM
from kvserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
OPTIONS = {"num_kv_blocks": 64, "max_model_len": 512}
CHAT = [{"role": "system", "content": "You are a careful assistant who answers briefly. " * 6},
        {"role": "user", "content": "Name three rivers of Europe and say where each one meets the sea."}]


def redis_keys(url: str) -> list[bytes]:
    client = redis.Redis.from_url(url)
    try:
        return list(client.scan_iter("kvserve:*"))
    finally:
        client.close()


def test_another_engine_finds_the_history_only_with_write_through(default_model, redis_server):
    url = redis_server.url
    # without write-through a block reaches Redis when the device evicts it: nothing here is evicted
    first, second = (LLM(loaded=default_model, redis_url=url, cache_salt="back", **OPTIONS) for _ in range(2))
    cold = first.chat(CHAT, GREEDY)[0]
    first.engine.kv.flush_tiers()
    assert second.chat(CHAT, GREEDY)[0].num_cached_tokens == 0
    assert redis_keys(url) == []

    a, b = (LLM(loaded=default_model, redis_url=url, write_through=True, **OPTIONS) for _ in range(2))
    out_a = a.chat(CHAT, GREEDY)[0]
    a.engine.kv.flush_tiers()
    num_full = len(out_a.prompt_token_ids) // 16
    assert a.engine.stats().tiers[0].write_through_blocks >= num_full
    assert len(redis_keys(url)) >= num_full
    out_b = b.chat(CHAT, GREEDY)[0]
    redis_tier = b.engine.stats().tiers[0]
    assert out_b.num_cached_tokens == redis_tier.hit_tokens > 0          # every hit came from Redis
    assert out_b.token_ids == out_a.token_ids == cold.token_ids             # as a cold run
    b.engine.kv.flush_tiers()
    # once per key across engines: b wrote through only the blocks it computed, not those it loaded
    num_b_blocks = (len(out_b.prompt_token_ids) + len(out_b.token_ids) - 1) // 16
    assert redis_tier.write_through_blocks <= num_b_blocks - out_b.num_cached_tokens // 16
    written = a.engine.stats().tiers[0].store.blocks_written + b.engine.stats().tiers[0].store.blocks_written
    assert len(redis_keys(url)) == written
    for llm in (first, second, a, b):
        llm.engine.check_integrity()
        llm.engine.close()


def test_write_through_needs_a_shared_tier(default_model, tmp_path):
    with pytest.raises(ValueError, match="write_through needs a shared offload tier"):
        LLM(loaded=default_model, write_through=True, **OPTIONS)
    with pytest.raises(ValueError, match="write_through needs a shared tier"):
        LLM(loaded=default_model, write_through=True, host_cache_gb=0.1, **OPTIONS)

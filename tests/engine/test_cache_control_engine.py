"""Cache control in the engine: pinned prefixes, retention classes, limits, expiry, tiers.

A tiny random model, a 16-block device pool of 16 tokens, pins limited to a quarter of it
(4 blocks); time comes from a stepped clock, never from sleeping.
"""

from __future__ import annotations

import random

import pytest
from fake_clock import FakeClock
from tiny import tiny_model

from kvserve import LLM, SamplingParams
from kvserve.cache_control import CacheControl, PrefixPin
from kvserve.kv.pins import PinLimitError, PinNotFoundError

POOL = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
SYSTEM = [random.Random(7).randrange(128) for _ in range(48)]          # three full blocks
OTHER = [random.Random(8).randrange(128) for _ in range(48)]           # an unpinned prefix
QUESTION = [5, 6, 7, 8, 9, 10, 11]


@pytest.fixture(scope="module")
def loaded():
    return tiny_model()


def make_llm(loaded, clock: FakeClock, **options) -> LLM:
    return LLM(loaded=loaded, num_kv_blocks=POOL, max_pinned_fraction=0.25, max_pin_ttl_s=600, clock=clock,
               **options)


def flood(llm: LLM, count: int = 6, seed: int = 0) -> None:
    """Requests of 13 blocks each, one at a time: together they evict every unpinned block."""
    rng = random.Random(100 + seed)
    for _ in range(count):
        llm.generate([rng.randrange(128) for _ in range(200)], GREEDY)
        llm.engine.check_integrity()


def device_block_ids(llm: LLM, tokens: list[int]) -> list[int | None]:
    pool = llm.engine.kv._pool
    keys = llm.engine.kv.prefix_keys(tokens)
    out = []
    for i, k in enumerate(keys):
        block = pool.lookup(k, tuple(tokens[16 * i:16 * i + 16]))
        out.append(None if block is None else block.block_id)
    return out


def test_a_pinned_system_prompt_stays_a_device_hit_under_a_flood(loaded):
    clock = FakeClock()
    llm = make_llm(loaded, clock)
    info = llm.pin(SYSTEM, ttl_s=60)
    assert (info.num_tokens, info.num_device_blocks, info.expires_in_s) == (48, 3, 60)
    assert len(info.block_keys) == 3
    pinned_ids = device_block_ids(llm, SYSTEM)
    assert None not in pinned_ids
    llm.generate(OTHER + QUESTION, GREEDY)                  # an unpinned prefix, cached too
    flood(llm)
    clock.now += 59
    again = llm.generate(SYSTEM + QUESTION, GREEDY)[0]
    other = llm.generate(OTHER + QUESTION, GREEDY)[0]
    assert again.num_cached_tokens == 48 and other.num_cached_tokens == 0
    assert device_block_ids(llm, SYSTEM) == pinned_ids       # the very same blocks
    s = llm.engine.stats()
    assert s.pin_hit_tokens == 48
    assert (s.pins.num_pins, s.pins.num_pinned_keys, s.pins.num_pinned_blocks) == (1, 3, 3)
    assert (s.pins.max_pinned_blocks, s.pins.num_evicted_blocks, s.pins.num_expired) == (4, 0, 0)
    llm.engine.check_integrity()


def test_an_expired_pin_is_evictable_again(loaded):
    clock = FakeClock()
    llm = make_llm(loaded, clock)
    llm.pin(SYSTEM, ttl_s=60)
    clock.now += 60
    flood(llm)
    assert llm.generate(SYSTEM + QUESTION, GREEDY)[0].num_cached_tokens == 0
    s = llm.engine.stats()
    assert (s.pins.num_pins, s.pins.num_expired, s.pin_hit_tokens) == (0, 1, 0)
    llm.engine.check_integrity()


def test_pinning_again_extends_and_unpin_releases(loaded):
    clock = FakeClock()
    llm = make_llm(loaded, clock)
    llm.pin(SYSTEM, ttl_s=60)
    clock.now += 50
    assert llm.pin(SYSTEM, ttl_s=60).expires_in_s == 60    # the same pin, due 60 s from now
    clock.now += 50
    assert [p.num_tokens for p in llm.pins()] == [48]
    info = llm.unpin(SYSTEM)
    assert info.num_tokens == 48 and llm.pins() == []
    with pytest.raises(PinNotFoundError, match="no pin covers exactly this prefix"):
        llm.unpin(SYSTEM)
    flood(llm)
    assert llm.generate(SYSTEM + QUESTION, GREEDY)[0].num_cached_tokens == 0
    llm.engine.check_integrity()


def test_pins_over_the_limit_are_refused_and_change_nothing(loaded):
    llm = make_llm(loaded, FakeClock())
    llm.pin(SYSTEM)                                         # 3 of the 4 blocks allowed
    with pytest.raises(PinLimitError, match="pinning 2 more blocks would make 5 pinned, over this engine's "
                                            "limit of 4 of 16 blocks"):
        llm.pin(OTHER[:32], warm=False)
    with pytest.raises(ValueError, match="ttl must be in"):
        llm.pin(OTHER[:16], ttl_s=601)
    with pytest.raises(ValueError, match="nothing to pin: the prefix has 15 tokens"):
        llm.pin(OTHER[:15])
    with pytest.raises(PinLimitError):
        llm.generate(OTHER + QUESTION, GREEDY, cache=CacheControl(pins=(PrefixPin(32),)))
    assert not llm.engine.has_unfinished
    assert [p.num_tokens for p in llm.pins()] == [48]
    assert llm.engine.stats().pins.num_pinned_keys == 3
    with pytest.raises(PinLimitError, match="pinning is off"):
        LLM(loaded=loaded, num_kv_blocks=POOL, max_pinned_fraction=0).pin(SYSTEM)
    llm.engine.check_integrity()


def test_a_request_field_pins_its_prefix_up_to_the_breakpoint(loaded):
    clock = FakeClock()
    llm = make_llm(loaded, clock)
    cache = CacheControl(pins=(PrefixPin(num_tokens=50, ttl_s=30),))   # 50 tokens: the 3 full blocks
    first = llm.generate(SYSTEM + [1, 2] + QUESTION, GREEDY, cache=cache)[0]
    assert first.num_cached_tokens == 0
    assert [p.num_tokens for p in llm.pins()] == [48]
    flood(llm)
    assert llm.generate(SYSTEM + QUESTION, GREEDY)[0].num_cached_tokens == 48
    # a prefix shorter than a block pins nothing, silently (as Anthropic's minimum length)
    llm.generate(OTHER[:20], GREEDY, cache=CacheControl(pins=(PrefixPin(num_tokens=10),)))
    assert len(llm.pins()) == 1
    with pytest.raises(ValueError, match="a pin covers 99 tokens, but the prompt has 20"):
        llm.generate(OTHER[:20], GREEDY, cache=CacheControl(pins=(PrefixPin(num_tokens=99),)))
    llm.engine.check_integrity()


def test_a_high_priority_prefix_outlives_normal_traffic(loaded):
    llm = make_llm(loaded, FakeClock())
    llm.generate(SYSTEM + QUESTION, GREEDY, cache=CacheControl(priority="high"))
    llm.generate(OTHER + QUESTION, GREEDY)
    flood(llm)
    assert llm.generate(SYSTEM + QUESTION, GREEDY)[0].num_cached_tokens == 48
    assert llm.generate(OTHER + QUESTION, GREEDY)[0].num_cached_tokens == 0
    with pytest.raises(ValueError, match="cache priority must be one of normal, high"):
        CacheControl(priority="urgent")
    llm.engine.check_integrity()


def test_greedy_tokens_are_those_of_a_cold_run(loaded):
    cold = LLM(loaded=loaded, enable_prefix_caching=False).generate(SYSTEM + QUESTION, GREEDY)[0]
    llm = make_llm(loaded, FakeClock())
    llm.pin(SYSTEM)
    flood(llm)
    hit = llm.generate(SYSTEM + QUESTION, GREEDY)[0]
    assert hit.num_cached_tokens == 48 and hit.token_ids == cold.token_ids


def test_a_pinned_block_that_must_go_is_demoted_and_comes_back_from_the_host_tier(loaded):
    clock = FakeClock()
    with LLM(loaded=loaded, num_kv_blocks=8, max_pinned_fraction=0.5, host_cache_gb=1 / 1024, clock=clock) as llm:
        cold = llm.generate(SYSTEM + QUESTION, GREEDY)[0]
        llm.reset_prefix_cache()
        llm.engine.kv.flush_tiers()
        llm.pin(SYSTEM, ttl_s=60)
        host = llm.engine.stats().tiers[0]
        assert host.store.blocks_written == 0                 # nothing demoted yet
        llm.generate([random.Random(3).randrange(128) for _ in range(127)], ONE)   # needs all 8 blocks
        llm.engine.kv.flush_tiers()
        s = llm.engine.stats()
        assert s.pins.num_evicted_blocks == 3 and s.pins.num_pinned_blocks == 0
        assert s.tiers[0].store.blocks_written >= 3
        again = llm.generate(SYSTEM + QUESTION, GREEDY)[0]
        assert again.num_cached_tokens == 48 and again.token_ids == cold.token_ids
        s = llm.engine.stats()
        assert s.tiers[0].hit_tokens == 48 and s.prefix_hit_tokens == 0
        assert s.pins.num_pinned_blocks == 3                  # pinned again on the device
        llm.engine.check_integrity()

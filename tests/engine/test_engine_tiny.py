"""End-to-end engine behaviour on a tiny random-weight model."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny import tiny_model

from kvserve import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return tiny_model()


def prompts_with_shared_prefixes(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    system = [rng.randrange(128) for _ in range(37)]
    doc = [rng.randrange(128) for _ in range(70)]
    out = []
    for i in range(10):
        head = system if i % 2 == 0 else system + doc
        out.append(head + [rng.randrange(128) for _ in range(rng.randrange(1, 30))])
    out.append([rng.randrange(128) for _ in range(5)])
    return out


def test_greedy_tokens_identical_with_prefix_caching_on_and_off(loaded):
    prompts = prompts_with_shared_prefixes()
    cold = LLM(loaded=loaded, enable_prefix_caching=False, max_num_batched_tokens=48)
    warm = LLM(loaded=loaded, enable_prefix_caching=True, max_num_batched_tokens=48)
    ref = cold.generate(prompts, GREEDY)
    assert all(o.num_cached_tokens == 0 for o in ref)
    first = warm.generate(prompts[:3], GREEDY)      # warm the cache with some of them
    got = warm.generate(prompts, GREEDY)            # a mix of hits and misses
    assert [o.token_ids for o in first] == [o.token_ids for o in ref[:3]]
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    cached = [o.num_cached_tokens for o in got]
    # prompts seen before hit every full block but the one holding their last token
    assert cached[:3] == [(len(p) - 1) // 16 * 16 for p in prompts[:3]]
    # the others share at least the system prompt's two full blocks
    assert all(c >= 32 for c in cached[3:-1])
    assert cached[-1] == 0
    warm.engine.check_integrity()
    assert warm.engine.kv.num_free_blocks == warm.engine.kv.num_blocks


def test_chunked_prefill_matches_one_shot_prefill(loaded):
    prompts = prompts_with_shared_prefixes(1)
    one_shot = LLM(loaded=loaded, max_num_batched_tokens=4096, enable_prefix_caching=False)
    chunked = LLM(loaded=loaded, max_num_batched_tokens=16, enable_prefix_caching=False)
    assert ([o.token_ids for o in one_shot.generate(prompts, GREEDY)]
            == [o.token_ids for o in chunked.generate(prompts, GREEDY)])


def test_small_pool_preempts_and_still_gives_the_same_tokens(loaded):
    prompts = prompts_with_shared_prefixes(2)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    big = LLM(loaded=loaded, enable_prefix_caching=False)
    small = LLM(loaded=loaded, num_kv_blocks=12, enable_prefix_caching=False, max_num_batched_tokens=64)
    ref = big.generate(prompts, params)
    got = small.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert small.engine.scheduler.num_preemptions > 0
    assert sum(o.num_preemptions for o in got) == small.engine.scheduler.num_preemptions
    small.engine.check_integrity()


def test_seeded_sampling_is_reproducible_and_top_k_1_is_greedy(loaded):
    llm = LLM(loaded=loaded)
    prompt = list(range(20))
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=7, ignore_eos=True)
    a = llm.generate([prompt, prompt], [p, p])
    b = llm.generate(prompt, p)
    assert a[0].token_ids == a[1].token_ids == b[0].token_ids
    other = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=8, ignore_eos=True))
    assert other[0].token_ids != a[0].token_ids
    greedy = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    topk1 = llm.generate(prompt, SamplingParams(max_tokens=10, temperature=0.8, top_k=1, seed=3,
                                                ignore_eos=True))
    assert topk1[0].token_ids == greedy[0].token_ids


def test_stop_token_ids_and_max_tokens(loaded):
    llm = LLM(loaded=loaded)
    prompt = list(range(20))
    ref = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert ref.finish_reason == "length" and len(ref.token_ids) == 8
    stop_at = ref.token_ids[3]
    first = ref.token_ids.index(stop_at)
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop_at]))[0]
    assert out.token_ids == ref.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at


def test_logprobs_are_log_softmax_of_the_chosen_tokens(loaded):
    llm = LLM(loaded=loaded)
    out = llm.generate(list(range(10)), SamplingParams(max_tokens=4, temperature=0.0, logprobs=3))[0]
    assert len(out.logprobs) == 4
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp.token_id == tok
        assert len(lp.top) == 3
        assert lp.top[0][0] == tok                      # greedy picks the best
        assert lp.logprob == pytest.approx(lp.top[0][1])
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_prompt_logprobs_same_whole_or_chunked_and_skip_cache(loaded):
    prompt = list(range(3, 60))
    p = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=2)
    whole = LLM(loaded=loaded).generate(prompt, p)[0]
    chunked_llm = LLM(loaded=loaded, max_num_batched_tokens=16)
    chunked_llm.generate(prompt, SamplingParams(max_tokens=1))   # fill the prefix cache
    chunked = chunked_llm.generate(prompt, p)[0]
    assert chunked.num_cached_tokens == 0
    assert whole.prompt_logprobs[0] is None and len(whole.prompt_logprobs) == len(prompt)
    for a, b in zip(whole.prompt_logprobs[1:], chunked.prompt_logprobs[1:]):
        assert a.token_id == b.token_id
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert [lp.token_id for lp in whole.prompt_logprobs[1:]] == prompt[1:]


def test_bad_input_is_rejected_and_other_requests_carry_on(loaded):
    llm = LLM(loaded=loaded, max_model_len=64)
    engine = llm.engine
    good = engine.add_request(list(range(10)), GREEDY)
    bad_inputs = [
        ([], "prompt is empty"),
        (list(range(64)), "context window is 64 tokens"),
        ([1, 2, 500], "out of range"),
        ([1, -1], "out of range"),
        ("text", "no tokenizer"),
    ]
    for prompt, message in bad_inputs:
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], GREEDY, request_id=good)
    with pytest.raises(ValueError, match="no prompts"):
        llm.generate([])
    with pytest.raises(ValueError, match="1 SamplingParams for 2 prompts"):
        llm.generate([[1], [2]], [GREEDY])
    for kwargs, message in [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                            ({"top_k": -2}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
                            ({"logprobs": 99}, "logprobs"), ({"stop": [""]}, "stop")]:
        with pytest.raises(ValueError, match=message):
            SamplingParams(**kwargs)
    done = []
    while engine.has_unfinished:
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == [good] and len(done[0].token_ids) == 12
    engine.check_integrity()


def test_request_needing_more_blocks_than_the_pool_is_rejected(loaded):
    llm = LLM(loaded=loaded, num_kv_blocks=4, block_size=16)
    with pytest.raises(ValueError, match="needs up to 5 KV blocks"):
        llm.generate(list(range(60)), SamplingParams(max_tokens=10))
    assert llm.generate(list(range(50)), SamplingParams(max_tokens=10))[0].finish_reason == "length"


def test_unknown_engine_option_is_named(loaded):
    with pytest.raises(ValueError, match="unknown engine option 'kv_cache_gigs'"):
        LLM(loaded=loaded, kv_cache_gigs=1)
    with pytest.raises(ValueError, match="scheduling policy"):
        LLM(loaded=loaded, scheduling_policy="random")


def test_abort_frees_blocks(loaded):
    llm = LLM(loaded=loaded)
    e = llm.engine
    rid = e.add_request(list(range(40)), GREEDY)
    e.step()
    assert e.kv.num_free_blocks < e.kv.num_blocks
    e.abort(rid)
    assert not e.has_unfinished
    assert e.kv.num_free_blocks == e.kv.num_blocks
    e.check_integrity()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 70), st.integers(1, 20), st.booleans(), st.integers(0, 3)),
                min_size=1, max_size=8),
       st.integers(6, 14), st.integers(8, 64), st.sampled_from(["fcfs", "lpm", "priority"]))
def test_random_workloads_keep_pool_invariants(loaded, reqs, num_blocks, budget, policy):
    """Random prompts, lengths, aborts and a tight pool: invariants hold every step,
    every request finishes, and nothing leaks."""
    llm = LLM(loaded=loaded, num_kv_blocks=num_blocks, block_size=8, max_num_batched_tokens=budget,
              scheduling_policy=policy, max_wait_steps=4)
    e = llm.engine
    ids = []
    for n, max_tokens, share, prio in reqs:
        prompt = ([5] * 20 + list(range(n)))[:n] if share else list(range(100 - n, 100))
        if e.kv.num_blocks_needed(n + max_tokens) > num_blocks:
            continue
        ids.append(e.add_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                       ignore_eos=True), priority=prio))
    finished = set()
    for step in range(2000):
        if not e.has_unfinished:
            break
        for out in e.step():
            if out.finished:
                finished.add(out.request_id)
        e.check_integrity()
        if step == 3 and len(ids) > 1 and ids[-1] not in finished:
            e.abort(ids[-1])
            finished.add(ids[-1])
    assert finished == set(ids)
    assert e.kv.num_free_blocks == num_blocks


def test_stats_count_prefix_hits_and_blocks(loaded):
    llm = LLM(loaded=loaded, num_kv_blocks=20, block_size=16)
    llm.generate(list(range(40)), SamplingParams(max_tokens=2))
    llm.generate(list(range(40)), SamplingParams(max_tokens=2))
    s = llm.engine.stats()
    assert (s.prefix_query_tokens, s.prefix_hit_tokens) == (80, 32)
    assert s.prefix_hit_rate == 0.4
    assert (s.num_waiting, s.num_running, s.kv_num_blocks, s.kv_num_free_blocks) == (0, 0, 20, 20)
    assert s.kv_num_cached_blocks == 2 and s.kv_usage == 0.0

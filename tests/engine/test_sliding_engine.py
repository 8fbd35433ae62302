"""A model with sliding-window layers through the engine (tiny Gemma 3: five layers of window 8,
then a full one; blocks of 4): the sliding groups hold only their windows' blocks, prefix hits
and preemption give the cold run's tokens, and what cannot run yet is refused, saying why."""

from __future__ import annotations

import random

import pytest
from model.test_gemma3 import tiny_gemma3
from offload.tiers_util import TickTimer

from kvserve import LLM, CacheControl, SamplingParams
from kvserve.config import DiskConfig, HostConfig
from kvserve.engine.engine import LLMEngine
from kvserve.offload.disk import DiskTransport
from kvserve.offload.host import HostTransport
from kvserve.request import Request

NUM_BLOCKS = 2000        # (the default 1 GiB holds a million blocks of this model: slow to set up)
GREEDY = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return tiny_gemma3(seed=7)[0]


def prompts(seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    history = [rng.randrange(128) for _ in range(41)]
    return [history + [rng.randrange(128) for _ in range(rng.randrange(1, 12))] for _ in range(4)] + \
        [[rng.randrange(128) for _ in range(50)]]


def test_the_groups_and_their_storage(loaded) -> None:
    engine = LLM(kv_format="native", loaded=loaded, block_size=4, kv_cache_memory_gb=1 / 1024).engine
    kv = engine.kv
    assert [(g.layers, g.window) for g in kv.groups] == [((5,), None), ((0,), 8), ((1,), 8), ((2,), 8), ((3,), 8),
                                                         ((4,), 8)]
    # a block holds one layer (4 tokens x 2 KV heads x 16 x float32, keys and values: 1 KiB): 1 MiB
    # gives 1,024 blocks, six times the blocks of all six layers
    assert kv.num_blocks == 1024 and engine.runner.cache.nbytes == 1 << 20


def test_sliding_groups_hold_their_window_as_a_request_decodes(loaded) -> None:
    llm = LLM(loaded=loaded, block_size=4, max_num_batched_tokens=8, num_kv_blocks=NUM_BLOCKS)
    engine: LLMEngine = llm.engine
    prompt = list(range(1, 41))
    engine.add_request(prompt, SamplingParams(max_tokens=25, temperature=0.0, ignore_eos=True), request_id="r")
    seen = 0
    while engine.has_unfinished:
        engine.step()
        tables = [engine.kv.block_ids("r", g) for g in range(6)]
        if not tables[0]:
            break
        num_computed = next(r for r in engine.scheduler.running if r.request_id == "r").num_computed_tokens
        # the full group holds every block of its context; each sliding group the blocks its
        # next query (at num_computed, seeing num_computed - 7 ..) reads, and what the step added
        first = max(0, num_computed - 7) // 4
        for table in tables[1:]:
            held = [i for i, b in enumerate(table) if b]
            assert held == list(range(first, len(table))), (num_computed, table)
            assert len(held) <= 4
        assert len(tables[0]) == -(-num_computed // 4) or len(tables[0]) == -(-(num_computed + 1) // 4)
        seen += 1
        engine.check_integrity()
    assert seen > 20


def test_prefix_hits_give_the_cold_tokens(loaded) -> None:
    batch = prompts(0)
    cold = LLM(loaded=loaded, block_size=4, enable_prefix_caching=False, max_num_batched_tokens=16,
               num_kv_blocks=NUM_BLOCKS)
    warm = LLM(loaded=loaded, block_size=4, max_num_batched_tokens=16, num_kv_blocks=NUM_BLOCKS)
    ref = cold.generate(batch, GREEDY)
    warm.generate(batch[:1], GREEDY)
    got = warm.generate(batch, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    # the first prompt again: every full block but the last token's; the others share the history
    assert got[0].num_cached_tokens == (len(batch[0]) - 1) // 4 * 4
    assert all(o.num_cached_tokens >= 40 for o in got[1:4]) and got[4].num_cached_tokens == 0
    warm.engine.check_integrity()
    assert warm.engine.kv.num_free_blocks == warm.engine.kv.num_blocks


@pytest.mark.parametrize("kv_format", ["int8", "fp16", "k=kivi2g16,v=int8", "kivi2g16"])
def test_quantized_formats_keep_their_guarantee_over_layer_groups(loaded, kv_format) -> None:
    """In a quantized format (KIVI's keys keep each group's open block in a residual row), a
    prefix hit gives exactly the cold run's tokens in that format, and every row is given back.
    (Before prefill chunks ended on block boundaries under whole-block formats, KIVI on both
    halves gave other tokens here: its results depended on how the budget cut the prompts.)"""
    batch = prompts(2)
    cold = LLM(loaded=loaded, block_size=4, kv_format=kv_format, enable_prefix_caching=False,
               num_kv_blocks=NUM_BLOCKS, max_num_batched_tokens=16)
    warm = LLM(loaded=loaded, block_size=4, kv_format=kv_format, num_kv_blocks=NUM_BLOCKS, max_num_batched_tokens=16)
    ref = cold.generate(batch, GREEDY)
    warm.generate(batch[:1], GREEDY)
    got = warm.generate(batch, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert got[0].num_cached_tokens == (len(batch[0]) - 1) // 4 * 4
    warm.engine.check_integrity()
    assert warm.engine.kv.residual.num_free_rows == warm.engine.kv.residual.num_rows


def test_a_small_pool_preempts_and_gives_the_same_tokens(loaded) -> None:
    batch = prompts(1)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    ref = LLM(loaded=loaded, block_size=4, enable_prefix_caching=False, num_kv_blocks=NUM_BLOCKS).generate(batch, params)
    # 5 requests of up to 92 tokens: each holds its 23 full blocks and 5 x 4 sliding ones at most
    small = LLM(loaded=loaded, block_size=4, num_kv_blocks=70, max_num_batched_tokens=16)
    got = small.generate(batch, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert small.engine.scheduler.num_preemptions > 0
    small.engine.check_integrity()


def generate_flushing(llm: LLM, prompt: list[int]) -> None:
    """Run ``prompt`` to its end, waiting for the tier's writes after each step: a queue that a
    slow disk has filled drops demotions (by design), so what the tier holds would otherwise
    depend on the machine."""
    engine = llm.engine
    engine.add_request(prompt, GREEDY)
    while engine.has_unfinished:
        engine.step()
        engine.kv.flush_tiers()
        assert all(m.dropped_calls == 0 for m in engine.kv.stats().tiers)


@pytest.mark.parametrize("tier", ["host", "disk", "damaged-disk"])
def test_a_history_evicted_to_a_tier_and_loaded_back_gives_the_cold_tokens(loaded, tier, tmp_path) -> None:
    """The device pool holds about one conversation: others evict it, its blocks (every group's,
    keyed apart) going to the tier; its next turn loads its full blocks and its sliding groups'
    last window back, and answers as a cold run does. With every file on disk damaged, the load
    fails its checks: the turn is computed whole, into the blocks held for that, and answers the same."""
    rng = random.Random(3)
    history = [rng.randrange(128) for _ in range(60)]
    others = [[rng.randrange(128) for _ in range(60)] for _ in range(3)]
    turn = history + [rng.randrange(128) for _ in range(5)]
    ref = LLM(loaded=loaded, block_size=4, enable_prefix_caching=False,
              num_kv_blocks=NUM_BLOCKS).generate(turn, GREEDY)[0]
    transport = HostTransport(HostConfig(capacity_bytes=1 << 22)) if tier == "host" else \
        DiskTransport(DiskConfig(path=str(tmp_path / "disk"), capacity_bytes=1 << 22))
    damaged = tier == "damaged-disk"
    llm = LLM(loaded=loaded, block_size=4, num_kv_blocks=150, max_num_batched_tokens=16, tiers=[transport],
              timer=TickTimer())     # load or recompute: by ticks, not by this machine's disk
    for prompt in [history] + others:       # each leaves 90 blocks cached: the history's are evicted,
        generate_flushing(llm, prompt)       # demoted to the tier
    assert llm.engine.kv.match_prefix(Request("probe", turn, SamplingParams(), arrival_seq=0)).num_device_blocks == 0
    if damaged:
        for path in (tmp_path / "disk").rglob("*.blk"):
            data = bytearray(path.read_bytes())
            data[-1] ^= 0xFF
            path.write_bytes(bytes(data))
    got = llm.generate(turn, GREEDY)[0]
    assert got.token_ids == ref.token_ids
    assert got.num_cached_tokens == (0 if damaged else 60)      # all 15 full blocks of the history
    metrics = llm.engine.kv.stats().tiers[0]
    assert metrics.hit_tokens == (0 if damaged else 60)
    assert damaged == (metrics.store.corrupt > 0)
    llm.engine.check_integrity()


def test_a_pin_keeps_the_full_blocks_and_the_last_window_of_its_prefix(loaded) -> None:
    """A pinned 60-token prefix: its 15 full-group blocks and each sliding group's last window
    (blocks 13 and 14: a query at 60 sees 53..60) wait behind every other cached block, so a
    burst of other prompts evicts the rest and the prefix still hits whole."""
    rng = random.Random(4)
    prefix = [rng.randrange(128) for _ in range(60)]
    llm = LLM(loaded=loaded, block_size=4, num_kv_blocks=150, max_num_batched_tokens=16)
    info = llm.engine.pin(prefix)
    assert info.num_tokens == 60 and len(info.block_keys) == 15 + 5 * 2
    llm.generate(prefix + [1], GREEDY)
    for _ in range(4):
        llm.generate([rng.randrange(128) for _ in range(60)], GREEDY)
    assert llm.engine.kv._pool.num_evicted_blocks > 0
    turn = prefix + [rng.randrange(128) for _ in range(3)]
    assert llm.generate(turn, GREEDY)[0].num_cached_tokens == 60
    llm.engine.check_integrity()


def test_what_cannot_run_yet_is_refused_saying_why(loaded) -> None:
    with pytest.raises(ValueError, match="sliding-window layers keeps only its windows"):
        LLM(loaded=loaded, kv_budget=64, num_kv_blocks=NUM_BLOCKS)
    llm = LLM(loaded=loaded, block_size=4, num_kv_blocks=NUM_BLOCKS)
    with pytest.raises(ValueError, match="sliding-window layers keeps only its windows"):
        llm.generate([1, 2, 3], SamplingParams(max_tokens=2, kv_budget=32))
    with pytest.raises(ValueError, match="use \"ngram\""):
        LLM(loaded=loaded, speculative_config={"method": "self"})
    with pytest.raises(ValueError, match="zip:"):
        LLM(loaded=loaded, kv_format="zip:hi=int8,lo=kivi2g16,salient=0.2")
    # speculation by prompt lookup verifies in the batch, as any step: it runs
    ngram = LLM(loaded=loaded, block_size=4, num_kv_blocks=NUM_BLOCKS, speculative_config={"method": "ngram"})
    plain = LLM(loaded=loaded, block_size=4, num_kv_blocks=NUM_BLOCKS)
    prompt = [5, 6, 7, 8] * 6
    assert (ngram.generate(prompt, GREEDY)[0].token_ids == plain.generate(prompt, GREEDY)[0].token_ids)


def test_a_tenants_reset_drops_its_blocks_in_every_group_only(loaded) -> None:
    """Each layer group's blocks are cached under the request's tenant: one tenant's reset drops
    its blocks in every group and no other tenant's, which still hits as before."""
    llm = LLM(loaded=loaded, block_size=4, num_kv_blocks=NUM_BLOCKS)
    prompt = prompts(3)[0]
    cold = {t: llm.generate([prompt], GREEDY, cache=CacheControl(tenant=t))[0] for t in ("alice", "bob")}
    pool = llm.engine.kv._pool
    by_tenant = pool.cached_blocks_by_tenant()
    assert by_tenant["alice"] == by_tenant["bob"] > len(prompt) // 4      # more than one group's blocks
    assert llm.engine.reset_prefix_cache("bob") == by_tenant["bob"]
    assert pool.cached_blocks_by_tenant() == {"alice": by_tenant["alice"]}
    warm = {t: llm.generate([prompt], GREEDY, cache=CacheControl(tenant=t))[0] for t in ("alice", "bob")}
    assert warm["alice"].num_cached_tokens > 0 and warm["bob"].num_cached_tokens == 0
    assert all(warm[t].token_ids == cold[t].token_ids for t in cold)
    llm.engine.check_integrity()


def test_the_window_is_fitted_to_what_a_request_holds_with_sliding_layers(loaded) -> None:
    """``max_model_len_fit="lower"`` counts blocks as a request holds them: its sliding groups
    their window and a chunk only (5 blocks each here), the full group every block."""
    llm = LLM(loaded=loaded, block_size=4, max_num_batched_tokens=8, num_kv_blocks=100, max_model_len_fit="lower")
    # 100 blocks = 5 sliding groups x 5 + 75 of the full group: 300 tokens, not the 66 of whole layers
    assert llm.engine.max_model_len == 300 and llm.engine.kv.max_blocks_held(300) == 100
    out = llm.generate([prompts(4)[0]], SamplingParams(max_tokens=None, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 300
    llm.engine.check_integrity()

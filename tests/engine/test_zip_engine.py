"""The engine under precision by saliency (``zip:`` KV formats; docs/kv_formats.md): which blocks
keep their finer copy, the kernel against the torch path, what is refused, tiers."""

from __future__ import annotations

import math
import random

import pytest
from tiny import tiny_model

from kvserve import LLM, SamplingParams

SPEC = "zip:hi=int8,lo=kivi2g8,salient=0.25"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return tiny_model()


def _prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(128) for _ in range(35)]
    return [shared + [rng.randrange(128) for _ in range(n)] for n in (1, 9, 20, 31)] + [[3, 4, 5]]


def test_the_engine_keeps_the_finer_copies_of_each_requests_most_salient_blocks(loaded):
    llm = LLM(loaded=loaded, kv_format=SPEC, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    e = llm.engine
    assert e.runner.backend.name == "cpu"
    prompt = _prompts()[3]
    rid = e.add_request(prompt, GREEDY)
    refined_before: set[int] = set()
    held: set[int] = set()          # dropped while the prompt's chunks ran: held aside, by block index
    num_full_before, checked, regraded = 0, 0, False
    while e.has_unfinished:
        e.step()
        state = e.kv.budgets.get(rid)
        if state is None:
            break
        table = e.kv.block_ids(rid)
        num_full = state.num_recorded // 4
        score = e.kv.budgets.block_saliency(rid, num_full)
        top = set(sorted(range(num_full), key=lambda i: (-float(score[i]), i))[:math.ceil(0.25 * num_full)])
        refined = {i for i in range(num_full) if e.kv.residual.refined.slot(table[i]) is not None}
        regrade = state.num_recorded >= len(prompt) and not regraded
        if num_full == num_full_before and not regrade:     # settled only when a block fills
            assert refined == refined_before
            continue
        had = refined_before | set(range(num_full_before, num_full))
        if regrade:
            # the whole prompt seen: the top quarter get back the copies its chunks dropped
            assert refined == (had | held) & top and refined & held
            held, regraded = set(), True
        else:
            # a block keeps its finer copy while it ranks in the top quarter; once the prompt is
            # whole, one that lost it never gets it back
            assert refined == had & top
            if state.num_recorded < len(prompt):
                held |= had - refined
        assert e.kv.budgets.held_nbytes == len(held) * e.kv.budgets.copy_nbytes
        e.check_integrity()
        refined_before, num_full_before = refined, num_full
        checked += 1
    # full blocks 4, 8, 12, 16 (prefill chunks of 16 of the 66 prompt tokens), the prompt whole
    # (its last chunk of 2 fills none), then 17, 18, 19 in decode
    assert (regraded, checked, num_full_before) == (True, 8, (66 + 12 - 1) // 4)
    assert e.kv.budgets.num_dropped > 0 and e.kv.budgets.num_restored > 0 and e.kv.budgets.held_nbytes == 0
    e.check_integrity()


def test_a_prompt_holds_no_copies_beyond_the_host_room(loaded):
    # room for one held copy (per request, all layers' key and value parts of one block)
    probe = LLM(loaded=loaded, kv_format=SPEC, num_kv_blocks=64, block_size=4)
    one = probe.engine.kv.budgets.copy_nbytes
    assert one == probe.engine.kv_format.refined_nbytes_per_block(4, 2, 16) > 0     # the tiny model: 2 heads of 16
    llm = LLM(loaded=loaded, kv_format=SPEC, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
              kv_budget_host_gb=one / 2**30)
    b = llm.engine.kv.budgets
    assert b.host_bytes == one
    seen = 0
    rid = llm.engine.add_request(_prompts()[3], GREEDY)
    while llm.engine.has_unfinished:
        llm.engine.step()
        seen = max(seen, b.held_nbytes)
        assert b.held_nbytes <= one
    assert seen == one and b.num_unheld > 0 and b.stats().num_host_evictions == b.num_unheld
    assert b.get(rid) is None and b.held_nbytes == 0


def test_rank_recent_keeps_the_first_block_and_the_newest(loaded):
    llm = LLM(loaded=loaded, kv_format=SPEC + ",rank=recent", num_kv_blocks=64, block_size=4, max_num_batched_tokens=16)
    e = llm.engine
    assert e.kv_format.spec == "zip:hi=int8,lo=kivi2g8,salient=0.25,rank=recent"
    rid = e.add_request(_prompts()[3], GREEDY)
    table: list[int] = []
    while e.has_unfinished:
        table = e.kv.block_ids(rid) or table
        e.step()
    # 66 + 12 tokens: 19 full blocks when its last step settled, 5 kept (ceil(0.25 x 19))
    refined = [i for i, b in enumerate(table) if e.kv.residual.refined.slot(b) is not None]
    assert refined == [0, 15, 16, 17, 18]


@pytest.mark.parametrize("spec", [SPEC, "zip:hi=int8,lo=kivi2g8+had,salient=0.5", "zip:hi=fp16,lo=int4g8,salient=0.25"])
def test_the_cpu_kernel_gives_the_torch_paths_tokens(loaded, spec):
    # chunked prefills over cached context, decodes and a prefix hit, in one batch
    runs = []
    for backend in ("torch", "cpu"):
        llm = LLM(loaded=loaded, kv_format=spec, num_kv_blocks=64, max_num_batched_tokens=24, attention_backend=backend)
        llm.generate(_prompts()[:1], GREEDY)
        runs.append(llm.generate(_prompts(), GREEDY))
        assert llm.engine.kv.budgets.num_dropped > 0
        llm.engine.check_integrity()
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert [o.num_cached_tokens for o in runs[1]] == [32, 32, 32, 32, 0]


def test_what_a_zip_format_cannot_do_is_refused(loaded):
    with pytest.raises(ValueError, match="a KV budget cannot run under the KV format zip:.*a compaction would move"):
        LLM(loaded=loaded, kv_format=SPEC, kv_budget=64)
    with pytest.raises(ValueError, match="triton attention backend cannot read zip:hi=int8,lo=kivi2g8\\+had.*"
                                         "Hadamard domain only"):
        LLM(loaded=loaded, kv_format="zip:hi=int8,lo=kivi2g8+had,salient=0.2", attention_backend="triton")
    llm = LLM(loaded=loaded, kv_format=SPEC, num_kv_blocks=32)
    with pytest.raises(ValueError, match="KV budgets are not available here: KV format zip:.*finer copy"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, kv_budget=32, kv_policy="snapkv"))
    assert llm.generate([[1, 2, 3]], GREEDY)[0].finished       # and nothing else is harmed


def test_a_block_back_from_a_tier_is_read_at_its_base_precision(loaded):
    prompt = [random.Random(1).randrange(128) for _ in range(70)]
    filler = [random.Random(1000).randrange(128) for _ in range(8 * 16 - 1)]
    with LLM(loaded=loaded, kv_format=SPEC, num_kv_blocks=8, host_cache_gb=1 / 1024) as llm:
        e = llm.engine
        rid = e.add_request(prompt, GREEDY)
        e.step()
        table = e.kv.block_ids(rid)
        refined_before = [b for b in table[:4] if e.kv.residual.refined.slot(b) is not None]
        while e.has_unfinished:
            e.step()
        assert refined_before                       # its salient blocks had a finer copy
        llm.generate(filler, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        e.kv.tiering.flush()
        rid = e.add_request(prompt, GREEDY)
        e.step()
        assert e.stats().tiers[0].loaded_tokens == 64
        table = e.kv.block_ids(rid)
        # the four blocks loaded from the host tier hold their base parts alone
        assert [e.kv.residual.refined.slot(b) for b in table[:4]] == [None] * 4
        while e.has_unfinished:
            e.step()
        e.check_integrity()


def test_requests_under_a_zip_format_do_not_draft(loaded):
    # which blocks keep a finer copy follows the steps taken: drafting would change the tokens
    prompt = [[7, 3, 9, 1, 4, 2] * 6 + [5, 8] + [7, 3, 9, 1, 4, 2] * 3]
    spec = LLM(loaded=loaded, kv_format=SPEC, num_kv_blocks=64, block_size=4,
               speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    plain = LLM(loaded=loaded, kv_format=SPEC, num_kv_blocks=64, block_size=4)
    assert spec.generate(prompt, GREEDY)[0].token_ids == plain.generate(prompt, GREEDY)[0].token_ids
    assert spec.engine.speculator.stats.num_drafts == 0

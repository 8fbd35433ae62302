"""``kvserve bench capacity`` on a tiny model: the seat search and the step accounting."""

from __future__ import annotations

import pytest
from tiny import tiny_model

from kvserve.bench.capacity import (
    blocks_per_request,
    distinct_prompts,
    fitting_max_num_seqs,
    render,
    run_format,
)
from kvserve.llm import LLM

GB = 2**30


@pytest.fixture(scope="module")
def loaded():
    return tiny_model()


def maker(loaded, fmt: str, memory_bytes: int):
    def make(max_num_seqs: int) -> LLM:
        return LLM(loaded=loaded, kv_format=fmt, kv_cache_memory_gb=memory_bytes / GB,
                   max_num_batched_tokens=128, max_num_seqs=max_num_seqs)
    return make


@pytest.mark.parametrize("fmt", ["native", "int8", "kivi2g8"])
def test_the_seat_search_finds_the_smallest_non_limiting_max_num_seqs(loaded, fmt):
    make = maker(loaded, fmt, 400_000)
    request_blocks = blocks_per_request(make(1), 40, 24)
    assert request_blocks == 4
    seqs, llm = fitting_max_num_seqs(make, request_blocks, lambda m: None)

    def fit(s: int) -> int:
        return make(s).engine.kv.num_blocks // request_blocks

    assert llm.engine.config.scheduler.max_num_seqs == seqs
    assert seqs >= fit(seqs)
    assert seqs == 1 or seqs - 1 < fit(seqs - 1)


def test_distinct_prompts_share_no_first_block():
    ids = list(range(1000))
    prompts = distinct_prompts(ids, 20, 50, seed=1)
    assert len(prompts) == 20 and all(len(p) == 50 for p in prompts)
    assert len({tuple(p[:16]) for p in prompts}) == 20
    with pytest.raises(ValueError):
        distinct_prompts(ids[:60], 20, 50, seed=1)


@pytest.mark.parametrize("fmt", ["native", "kivi2g8"])
def test_run_format_reaches_the_pool_limit_and_measures_decode(loaded, fmt):
    make = maker(loaded, fmt, 400_000)
    request_blocks = blocks_per_request(make(1), 40, 24)
    seqs, llm = fitting_max_num_seqs(make, request_blocks, lambda m: None)
    fit = llm.engine.kv.num_blocks // request_blocks
    ids = [(7 * i + 3) % 128 for i in range(5000)]
    prompts = distinct_prompts(ids, fit + 3, 40, seed=0)
    r = run_format(llm, fmt, seqs, prompts, 24, request_blocks)
    assert r.fit == fit
    assert 1 <= r.peak_concurrent <= r.peak_running
    assert r.peak_concurrent >= fit - 1          # the pool, not the seats or the budget, is the limit
    assert r.decode_steps > 0 and r.decode_tok_s > 0 and r.decode_batch >= 1
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks
    assert r.generated_tokens == (fit + 3) * 24 and r.e2e_tok_s > 0
    assert r.backend == llm.engine.runner.backend.name
    assert fmt in render([r])

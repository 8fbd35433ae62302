"""The pieces of ``kvserve eval-budget`` on the tiny model (no tokenizer needed)."""

from __future__ import annotations

import math
import random

import pytest
import torch
from tiny import tiny_model

from kvserve import LLM, SamplingParams
from kvserve.eval.budget import (
    BudgetEvalSettings,
    Config,
    ForcedSampler,
    Row,
    configs_for,
    goal_lines,
    render,
    run_one,
    speed_lines,
)


def test_configs_are_the_full_cache_then_each_policy_at_each_fraction():
    s = BudgetEvalSettings(policies=("streaming", "arkvale"), fractions=(0.125, 0.25))
    names = [c.name for c in configs_for(2048, s, 16)]
    assert names == ["full", "streaming@256", "arkvale@256", "streaming@512", "arkvale@512"]
    assert [c.reuses_prefill for c in configs_for(2048, s, 16)] == [True, False, True, False, True]


def test_forced_decoding_scores_the_given_tokens_and_measures_memory():
    forced = ForcedSampler(0)
    llm = LLM(loaded=tiny_model(), sampler=forced, num_kv_blocks=64, max_num_batched_tokens=64)
    rng = random.Random(0)
    prompt = [rng.randrange(128) for _ in range(100)]
    targets = [rng.randrange(128) for _ in range(20)]
    row = Row(100, Config("h2o", 32))
    out = run_one(llm.engine, forced, prompt, Config("h2o", 32).params(20), row, targets)
    assert out == targets and row.num_scored == 20 and row.decode_tokens == 19
    # the same logprobs as prompt logprobs of the concatenation, under the full cache
    full = Row(100, Config(None, None))
    run_one(llm.engine, forced, prompt, Config(None, None).params(20), full, targets)
    ref = llm.generate(prompt + targets, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
    expected = -sum(p.logprob for p in ref.prompt_logprobs[100:] if p is not None)
    assert math.isclose(full.nll_sum, expected, rel_tol=1e-4)
    assert full.peak_blocks == 8 == full.decode_blocks           # 119 tokens
    # h2o evicts between prefill chunks: 2 blocks kept + 36 tokens; then budget + a block
    assert row.peak_blocks == 5 and row.decode_blocks == 3
    torch.testing.assert_close(torch.tensor(row.perplexity), torch.tensor(math.exp(row.nll_sum / 20)))


def test_goal_line_and_table():
    full = Row(256, Config(None, None), passkey=[True, True, False], nll_sum=3.0, num_scored=3)
    ark = Row(256, Config("arkvale", 32), passkey=[True, True, False], nll_sum=3.3, num_scored=3,
              peak_blocks=16, decode_blocks=3)
    stream = Row(256, Config("streaming", 32), passkey=[False, True, False], nll_sum=3.6, num_scored=3)
    s = BudgetEvalSettings(contexts=(256,))
    assert goal_lines([full, ark, stream], s) == [
        "256 tokens, budget 32 (1/8): arkvale passkey 2/3 vs full 2/3: met (needs >= 1.8); streaming 1/3"]
    # bits/el: 3 blocks of 1 MiB over 256 + 64 tokens of 1,024 elements
    text = render([full, ark, stream], 1 << 20, 1024, 64)
    cells = [[c.strip() for c in line.split("|")[1:-1]] for line in text.splitlines()]
    assert cells[3][:10] == ["256", "arkvale", "32", "2/3", "100%", "3.004", "+10.5%", "16.0", "3.0", "76.80"]


def test_under_a_zip_format_the_only_policy_is_saliency_blocks():
    BudgetEvalSettings(policies=("saliency-blocks",), kv_format="zip:hi=int8,lo=kivi2,salient=0.2")
    with pytest.raises(ValueError, match="under a zip: KV format the only budget policy is saliency-blocks.*snapkv"):
        BudgetEvalSettings(policies=("saliency-blocks", "snapkv"), kv_format="zip:hi=int8,lo=kivi2,salient=0.2")


def test_speed_lines_give_each_budget_as_a_multiple_of_the_full_cache():
    full = Row(2048, Config(None, None), decode_seconds=2.0, decode_tokens=100)            # 50 tok/s
    ark = Row(2048, Config("arkvale", 256), decode_seconds=1.0, decode_tokens=60)           # 60 tok/s
    snap = Row(2048, Config("snapkv", 256), decode_seconds=1.0, decode_tokens=45)           # 45 tok/s
    unrun = Row(2048, Config("h2o", 256))
    other = Row(4096, Config("arkvale", 512), decode_seconds=1.0, decode_tokens=10)         # no full row
    assert speed_lines([full, ark, snap, unrun, other]) == [
        "2048 tokens, decode tok/s vs full (50.0): arkvale@256 1.20x, snapkv@256 0.90x; slowest snapkv@256 0.90x"]
    assert speed_lines([Row(2048, Config(None, None)), ark]) == []

"""Model proposers (kvserve/speculative/drafters.py) in the engine, tiny random models: greedy outputs
token for token those of plain decoding with ``self`` and ``draft``, in per-token KV formats
and both attention backends, with prefix hits, preemption and aborts; a draft model with the
target's own weights has every draft accepted (its cache holds exactly the right keys); the
draft cache's blocks are all back after the requests end; configs the methods cannot use are
refused."""

from __future__ import annotations

import pytest
from spec_runs import run_all
from tiny import TINY, random_tokens, tiny_model

from kvserve import LLM, SamplingParams
from kvserve.config import ModelConfig, SpeculativeConfig
from kvserve.engine.engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.speculative.cost import StepCosts
from kvserve.speculative.drafters import DraftModelProposer, ModelProposer, SelfProposer, _Sequence

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
# four layers, so that leaving some out still leaves a model
DEEP = ModelConfig(**{**TINY.__dict__, "num_layers": 4})


@pytest.fixture(scope="module")
def loaded():
    return tiny_model(DEEP)


def drafting(engine: LLMEngine) -> LLMEngine:
    """Every request drafts ``num_speculative_tokens`` tokens every step."""
    assert engine.speculator is not None and isinstance(engine.speculator.proposer, ModelProposer)
    engine.speculator.always_draft()
    return engine


def run(engine: LLMEngine, work: list[tuple[list[int], SamplingParams]],
        abort_at: dict[int, str] | None = None) -> dict[str, RequestOutput]:
    """Every request to the end, checking the pool (and a draft model's cache) after every step."""
    return run_all(engine, work, abort_at, check=check_draft_cache)


def check_draft_cache(engine: LLMEngine) -> None:
    engine.speculator.check_integrity()     # a draft model's cache


def tokens(outs: dict[str, RequestOutput]) -> dict[str, list[int]]:
    return {rid: o.token_ids for rid, o in sorted(outs.items()) if o.finish_reason != "abort"}


def work(seed: int, n: int = 5) -> list[tuple[list[int], SamplingParams]]:
    return [(random_tokens(8 + 7 * i, seed + i), GREEDY) for i in range(n)]


@pytest.mark.parametrize("kv_format", ["native", "int8", "fp16"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("method", ["self", "draft"])
def test_greedy_tokens_equal_plain_decoding(loaded, method, kv_format, backend):
    options = {"num_kv_blocks": 64, "kv_format": kv_format, "attention_backend": backend}
    config = {"method": method, "num_speculative_tokens": 3}
    draft = tiny_model(DEEP, seed=1) if method == "draft" else None
    plain = LLM(loaded=loaded, **options).engine
    spec = drafting(LLM(loaded=loaded, speculative_config=config, draft=draft, **options).engine)
    want, got = run(plain, work(0)), run(spec, work(0))
    assert tokens(got) == tokens(want)
    stats = spec.stats().spec
    assert stats is not None and stats.method == method and stats.num_draft_tokens > 0
    assert sorted(spec.kv.cached_keys()) == sorted(plain.kv.cached_keys())
    assert spec.kv.num_free_blocks == spec.kv.num_blocks


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_draft_model_with_the_targets_weights_has_every_draft_accepted(loaded, backend):
    """Its cache holds the keys of exactly the tokens it was fed, caught up from what each step
    accepted: a stale or misplaced row would change a draft somewhere in 5 x 40 tokens."""
    spec = drafting(LLM(loaded=loaded, num_kv_blocks=64, attention_backend=backend,
                        speculative_config={"method": "draft", "num_speculative_tokens": 3},
                        draft=tiny_model(DEEP)).engine)
    got = run(spec, work(1))
    want = run(LLM(loaded=loaded, num_kv_blocks=64, attention_backend=backend).engine, work(1))
    assert tokens(got) == tokens(want)
    stats = spec.stats().spec
    assert stats.num_draft_tokens > 100 and stats.num_accepted_tokens == stats.num_draft_tokens
    proposer = spec.speculator.proposer
    assert isinstance(proposer, DraftModelProposer) and proposer.num_free_blocks == 64


def test_self_with_every_layer_is_the_target_and_skipping_layers_costs_acceptance(loaded):
    full = drafting(LLM(loaded=loaded, num_kv_blocks=64,
                        speculative_config={"method": "self", "skip_layers": []}).engine)
    run(full, work(2))
    s = full.stats().spec
    assert s.num_draft_tokens > 100 and s.num_accepted_tokens == s.num_draft_tokens
    skipping = drafting(LLM(loaded=loaded, num_kv_blocks=64,
                            speculative_config={"method": "self", "skip_layers": [1, 2]}).engine)
    proposer = skipping.speculator.proposer
    assert isinstance(proposer, SelfProposer) and proposer.pass_.layers == [0, 3]
    assert tokens(run(skipping, work(2))) == tokens(run(LLM(loaded=loaded, num_kv_blocks=64).engine, work(2)))
    s = skipping.stats().spec
    assert s.num_accepted_tokens < s.num_draft_tokens


def test_self_with_quantized_weights_drafts_from_its_own_copy(loaded):
    spec = drafting(LLM(loaded=loaded, num_kv_blocks=64,
                        speculative_config={"method": "self", "quantization": "int8", "skip_layers": []}).engine)
    proposer = spec.speculator.proposer
    assert isinstance(proposer, SelfProposer) and proposer.pass_.model is not spec.model
    assert proposer.pass_.model.products.name.startswith("int8")
    assert tokens(run(spec, work(3))) == tokens(run(LLM(loaded=loaded, num_kv_blocks=64).engine, work(3)))
    assert spec.stats().spec.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["self", "draft"])
def test_prefix_hits_preemption_and_aborts(loaded, method):
    shared = random_tokens(40, 9)
    items = [(shared + random_tokens(3 + i, 20 + i), SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
             for i in range(6)]
    items.append((shared + [1, 2], SamplingParams(max_tokens=20, temperature=0.7, ignore_eos=True)))  # sampled
    options = {"num_kv_blocks": 12, "max_num_batched_tokens": 64}
    want = run(LLM(loaded=loaded, **options).engine, items)
    spec = drafting(LLM(loaded=loaded, speculative_config={"method": method, "num_speculative_tokens": 3},
                        draft=tiny_model(DEEP, seed=2) if method == "draft" else None, **options).engine)
    got = run(spec, items, abort_at={5: "r2", 9: "r4"})
    assert spec.scheduler.num_preemptions > 0 and spec.stats().spec.num_draft_tokens > 0
    sampled = "r6"
    assert len(got[sampled].token_ids) == 20
    assert {r: t for r, t in tokens(got).items() if r != sampled} == \
        {r: t for r, t in tokens(want).items() if r not in ("r2", "r4", sampled)}
    assert any(o.num_cached_tokens > 0 for o in got.values())
    assert spec.kv.num_free_blocks == spec.kv.num_blocks
    proposer = spec.speculator.proposer
    if isinstance(proposer, DraftModelProposer):
        assert proposer.num_free_blocks == spec.kv.num_blocks    # aborted requests' blocks too


def test_a_full_draft_cache_means_no_drafts_not_errors(loaded):
    spec = drafting(LLM(loaded=loaded, num_kv_blocks=64, speculative_config={"method": "draft"},
                        draft=tiny_model(DEEP)).engine)
    proposer = spec.speculator.proposer
    assert isinstance(proposer, DraftModelProposer)
    held = _Sequence()     # a sequence holding all but 4 blocks: room for one short request's only
    held.block_ids, proposer._free = proposer._free[4:], proposer._free[:4]
    proposer._seqs["held"] = held
    got = run(spec, work(4))
    assert tokens(got) == tokens(run(LLM(loaded=loaded, num_kv_blocks=64).engine, work(4)))
    drafted = [rid for rid, o in got.items() if o.num_draft_tokens]
    assert drafted and len(drafted) < len(got)
    assert proposer.num_free_blocks == 4


def test_configs_a_method_cannot_use_are_refused(loaded):
    with pytest.raises(ValueError, match="needs the drafting model"):
        LLM(loaded=loaded, speculative_config={"method": "draft"})
    with pytest.raises(ValueError, match="does not use prompt_lookup_max"):
        SpeculativeConfig.from_json('{"method": "self", "prompt_lookup_max": 2}')
    with pytest.raises(ValueError, match="does not use skip_layers"):
        SpeculativeConfig.from_json('{"method": "ngram", "skip_layers": [1]}')
    with pytest.raises(ValueError, match='"model" is the draft method'):
        SpeculativeConfig(method="self", model="x")
    with pytest.raises(ValueError, match="distinct layer indices"):
        SpeculativeConfig(method="self", skip_layers=(1, 1))
    with pytest.raises(ValueError, match="weight format"):
        LLM(loaded=loaded, speculative_config={"method": "self", "quantization": "int3"})
    with pytest.raises(ValueError, match="leave at least one"):
        LLM(loaded=loaded, speculative_config={"method": "self", "skip_layers": [0, 1, 2, 3]})
    with pytest.raises(ValueError, match="below 4"):
        LLM(loaded=loaded, speculative_config={"method": "self", "skip_layers": [7]})
    other = tiny_model(ModelConfig(**{**DEEP.__dict__, "vocab_size": 96}))
    with pytest.raises(ValueError, match="vocabulary of 96"):
        LLM(loaded=loaded, speculative_config={"method": "draft"}, draft=other)
    with pytest.raises(ValueError, match="loaded draft model"):
        LLM(loaded=loaded, speculative_config={"method": "self"}, draft=other)
    assert SpeculativeConfig(method="self", skip_layers=[3, 1]).skip_layers == (1, 3)


def test_a_drafting_pass_counts_in_what_a_drafted_token_costs(loaded):
    spec = LLM(loaded=loaded, speculative_config={"method": "self"}).engine.speculator
    assert spec is not None
    spec.costs = StepCosts(0.004, 0.0005)
    spec.proposer.costs = StepCosts(0.002, 0.0004)
    # q = (b B + d(B)) / t(B): at batch 1 (0.0005 + 0.0024) / 0.0045
    assert spec._row_share(1) == pytest.approx((0.0005 + 0.0024) / 0.0045)

"""One request's failure fails that request only; a failed step fails its requests only."""

from __future__ import annotations

import pytest
from poison import PoisonedGrammar
from tiny import tiny_model

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputs

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
POISON = StructuredOutputs(regex="poison")


@pytest.fixture
def llm(monkeypatch):
    llm = LLM(loaded=tiny_model(), num_kv_blocks=32)
    # inject the failing component: requests asking for POISON get a grammar that breaks
    monkeypatch.setattr(llm.engine.grammars, "check", lambda spec: None)
    monkeypatch.setattr(llm.engine.grammars, "matcher", lambda spec: PoisonedGrammar())
    return llm


PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [8, 9], [10, 11, 12]]


def test_a_poisoned_request_fails_alone(llm):
    reference = [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY)]
    poisoned = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, structured=POISON)
    outs = llm.generate(PROMPTS, [GREEDY, GREEDY, GREEDY, poisoned])
    assert [o.token_ids for o in outs[:3]] == reference
    assert all(o.finish_reason == "length" and o.error is None for o in outs[:3])
    bad = outs[3]
    assert bad.finish_reason == "error" and "poisoned grammar" in bad.error and len(bad.token_ids) == 2
    llm.engine.check_integrity()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_a_failed_model_step_fails_that_steps_requests_and_the_engine_goes_on(llm, monkeypatch):
    engine = llm.engine
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(out):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("device fell over")
        return real(out)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    outs = llm.generate(PROMPTS[:2], GREEDY)
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert all("device fell over" in o.error for o in outs)
    engine.check_integrity()
    again = llm.generate(PROMPTS[:2], GREEDY)
    assert [o.finish_reason for o in again] == ["length", "length"]
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_sampler_corner_cases_run_through_the_engine(llm):
    reference = llm.generate(PROMPTS[0], GREEDY)[0].token_ids
    for params in (SamplingParams(max_tokens=8, temperature=1e-38, ignore_eos=True),
                   SamplingParams(max_tokens=8, top_p=1e-300, ignore_eos=True),
                   SamplingParams(max_tokens=8, temperature=1e-38, top_p=1e-300, top_k=10**9, ignore_eos=True)):
        out = llm.generate(PROMPTS[0], params)[0]
        assert out.error is None and out.token_ids == reference

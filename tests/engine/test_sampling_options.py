"""Penalties, logit bias, min_tokens and structured outputs through ``LLM.generate``."""

from __future__ import annotations

import json

import pytest
from tiny import tiny_model

from kvserve import LLM, SamplingParams
from kvserve.sampling_params import StructuredOutputs

PROMPT = [5, 17, 42, 9, 3]
N = 8


@pytest.fixture(scope="module")
def llm():
    return LLM(loaded=tiny_model(), num_kv_blocks=64)


def top20(llm: LLM, ids: list[int]) -> dict[int, float]:
    out = llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, logprobs=20, ignore_eos=True))[0]
    return dict(out.logprobs[0].top)


@pytest.mark.parametrize(("presence", "frequency"), [(0.0, 2.0), (1.5, 0.0), (0.5, 1.0), (-2.0, 0.0)])
def test_presence_and_frequency_penalties_exact(llm, presence, frequency):
    """Each token is the argmax of the model's logprobs less the penalties, computed here
    from the raw top-20 at each position (additive penalties keep the argmax in it)."""
    expected: list[int] = []
    for _ in range(N):
        top = top20(llm, PROMPT + expected)
        scores = {t: lp - frequency * expected.count(t) - presence * (t in expected) for t, lp in top.items()}
        expected.append(max(scores, key=scores.get))
    params = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, presence_penalty=presence,
                            frequency_penalty=frequency)
    assert llm.generate([PROMPT], params)[0].token_ids == expected


def test_penalties_batch_with_plain_requests(llm):
    plain = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True)
    penalized = SamplingParams(max_tokens=N, temperature=0, ignore_eos=True, frequency_penalty=2.0,
                               repetition_penalty=1.5, logit_bias={7: 3.0})
    alone = [o.token_ids for o in llm.generate([PROMPT, PROMPT[::-1]], [plain, penalized])]
    mixed = llm.generate([PROMPT, PROMPT[::-1], PROMPT], [plain, penalized, plain])
    assert [o.token_ids for o in mixed] == [alone[0], alone[1], alone[0]]


def test_logit_bias_and_min_tokens_exact(llm):
    greedy = llm.generate([PROMPT], SamplingParams(max_tokens=N, temperature=0, ignore_eos=True))[0].token_ids
    top = top20(llm, PROMPT)
    runner_up = sorted(top, key=top.get, reverse=True)[1]
    biased = SamplingParams(max_tokens=1, temperature=0, logit_bias={greedy[0]: -100})
    assert llm.generate([PROMPT], biased)[0].token_ids == [runner_up]
    # the first greedy token is a stop token: min_tokens=0 stops at once, min_tokens=3 holds it back
    stop = SamplingParams(max_tokens=N, temperature=0, stop_token_ids=[greedy[0]])
    assert llm.generate([PROMPT], stop)[0].token_ids == [greedy[0]]
    held = llm.generate([PROMPT], SamplingParams(max_tokens=N, temperature=0, stop_token_ids=[greedy[0]],
                                                 min_tokens=3))[0]
    assert held.token_ids[0] == runner_up and len(held.token_ids) >= 3
    assert greedy[0] not in held.token_ids[:3]


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"presence_penalty": 3}, "presence_penalty"), ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"logit_bias": {1: 101}}, "logit_bias"),
    ({"logit_bias": {-1: 1}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
    ({"structured": "json"}, "structured"),
])
def test_bad_values_raise(kwargs, words):
    with pytest.raises(ValueError, match=words):
        SamplingParams(**kwargs)


def test_bad_structured_specs_raise():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["b"])
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputs(json="{")


def test_logit_bias_outside_the_vocabulary_is_refused(llm):
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([PROMPT], SamplingParams(logit_bias={10**6: 1.0}))


def test_structured_outputs_from_the_python_api(default_model):
    llm = LLM(loaded=default_model, num_kv_blocks=64, max_model_len=512)
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    params = [SamplingParams(max_tokens=20, temperature=0, structured=StructuredOutputs(json=schema)),
              SamplingParams(max_tokens=20, temperature=0.7, seed=1,
                             structured=StructuredOutputs(choice=["left", "right"])),
              SamplingParams(max_tokens=5, temperature=0)]
    outs = llm.generate(["Is water wet?", "Which way?", "Hello"], params)
    assert json.loads(outs[0].text)["answer"] in ("yes", "no") and outs[0].finish_reason == "stop"
    assert outs[1].text in ("left", "right")
    assert outs[2].finish_reason in ("stop", "length") and outs[2].error is None
    with pytest.raises(ValueError, match="structured regex"):
        llm.generate(["x"], SamplingParams(structured=StructuredOutputs(regex="[a-")))

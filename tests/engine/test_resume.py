"""A request resumed from output it produced elsewhere (``add_request(resume=...)``, what a
cluster's ingress sends when a replica dies mid-stream) goes on exactly as if it had never
stopped: greedy tokens, text, logprobs, penalties, stop strings and grammars count the resumed
tokens; resumed tokens that cannot be the request's output are refused, changing nothing."""

from __future__ import annotations

import pytest
from tiny import random_tokens, tiny_model

from kvserve import LLM, SamplingParams
from kvserve.engine.engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.request import Resumed
from kvserve.sampling_params import StructuredOutputs


def finish(engine: LLMEngine, rid: str) -> list[RequestOutput]:
    """Every output of ``rid`` until it finishes (the pool checked after each step)."""
    outs: list[RequestOutput] = []
    while engine.has_unfinished:
        outs += [o for o in engine.step() if o.request_id == rid]
        engine.check_integrity()
    assert outs and outs[-1].finished
    return outs


def resumed_at(llm: LLM, prompt, params: SamplingParams, plain: RequestOutput, n: int) -> list[RequestOutput]:
    logprobs = tuple(plain.logprobs[:n]) if plain.logprobs else ()
    llm.engine.add_request(prompt, params, request_id="resumed",
                           resume=Resumed(tuple(plain.token_ids[:n]), logprobs))
    return finish(llm.engine, "resumed")


@pytest.mark.parametrize("n", [1, 7, 16, 29])
def test_greedy_tokens_and_logprobs_go_on_as_if_never_stopped(n):
    loaded = tiny_model()
    prompt = random_tokens(21, 3)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, logprobs=2, frequency_penalty=0.7,
                            presence_penalty=0.3)
    plain = LLM(loaded=loaded, num_kv_blocks=32).generate([prompt], params)[0]
    llm = LLM(loaded=loaded, num_kv_blocks=32)
    outs = resumed_at(llm, prompt, params, plain, n)
    got = outs[-1]
    assert got.token_ids == plain.token_ids and got.finish_reason == "length"
    assert [lp.token_id for lp in got.logprobs] == got.token_ids
    assert [round(lp.logprob, 4) for lp in got.logprobs] == [round(lp.logprob, 4) for lp in plain.logprobs]
    assert all(len(o.token_ids) > n for o in outs)          # every output holds the resumed tokens
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_text_and_stop_strings_count_the_resumed_tokens(default_model):
    llm = LLM(loaded=default_model, num_kv_blocks=64)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Name three colors, then stop."}],
                                               add_generation_prompt=True)
    ids = llm.engine.encode_prompt(prompt)
    free = llm.generate([ids], SamplingParams(max_tokens=40, temperature=0.0))[0]
    # a stop string across tokens 9 and 10: its first half in the resumed tokens' text
    cut = len(llm.tokenizer.decode(free.token_ids[:10]))
    stop = free.text[cut - 2:cut + 2]
    assert len(stop) == 4 and stop not in free.text[:cut]
    params = SamplingParams(max_tokens=40, temperature=0.0, stop=[stop])
    plain = llm.generate([ids], params)[0]
    assert plain.finish_reason == "stop" and len(plain.token_ids) < len(free.token_ids)
    outs = resumed_at(llm, ids, params, plain, 10)
    assert outs[-1].text == plain.text and outs[-1].token_ids == plain.token_ids
    assert outs[-1].stop_reason == stop
    assert all(plain.text.startswith(o.text) for o in outs)


def test_a_grammar_goes_on_from_the_resumed_tokens(default_model):
    llm = LLM(loaded=default_model, num_kv_blocks=64)
    ids = llm.engine.encode_prompt(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "A cat as JSON."}], add_generation_prompt=True))
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"]}
    params = SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredOutputs(json=schema))
    plain = llm.generate([ids], params)[0]
    got = resumed_at(llm, ids, params, plain, 5)[-1]
    assert got.token_ids == plain.token_ids and got.text == plain.text


def test_tokens_that_cannot_be_the_output_are_refused_changing_nothing():
    llm = LLM(loaded=tiny_model(), num_kv_blocks=32)
    engine = llm.engine
    prompt = random_tokens(10, 4)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    cases = [
        (greedy, Resumed(tuple(range(10))), "already reach"),
        (greedy, Resumed((1, 500)), "token ids must be in"),
        (SamplingParams(max_tokens=10, temperature=0.0, stop_token_ids=[7]), Resumed((3, 7, 4)), "already ended"),
        (greedy, Resumed((1, True)), "must be integers"),
        (SamplingParams(max_tokens=10, temperature=0.0, logprobs=1), Resumed((1, 2)), "0 logprobs for 2 tokens"),
    ]
    for params, resume, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, params, request_id="bad", resume=resume)
        assert not engine.has_unfinished and engine.outputs.num_requests == 0
        engine.check_integrity()
    engine.add_request(prompt, greedy, request_id="bad", resume=Resumed((1, 2)))   # the id is free again
    assert len(finish(engine, "bad")[-1].token_ids) == 10

"""Drafts for requests with penalties, logit bias, ``min_tokens`` and grammars: row i of a draft is
processed as plain decoding processes the token after the first i drafts (checked row by row
against the request with those drafts appended, and for grammars against a matcher moved
there). In the engine, drafting the plain run's own continuation: every draft is accepted (a
wrongly processed row would show as a rejected draft; the output alone would not show it,
verification falling back to the target's token), and a sampled request is verified on the
processed rows (a draft its bias forbids is never kept)."""

from __future__ import annotations

import pytest
import torch
from spec_runs import run_all
from tiny import random_tokens, tiny_model

from kvserve import LLM, SamplingParams
from kvserve.engine.engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.request import Request
from kvserve.sampling.processors import process_logits
from kvserve.sampling.rows import DraftedRow, drafted_rows
from kvserve.sampling_params import StructuredOutputs
from kvserve.speculative.proposers import Proposer

NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


class Oracle(Proposer):
    """Drafts each request's plain continuation (request id -> the plain run's output ids),
    with the token at ``wrong`` (an output index) replaced by ``wrong_token``."""

    name = "oracle"

    def __init__(self, outputs: dict[str, list[int]], wrong: tuple[int, int] | None = None) -> None:
        self.outputs, self.wrong = outputs, wrong

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        done = request.num_output_tokens
        draft = self.outputs[request.request_id][done:done + num_tokens]
        if self.wrong is not None and done <= self.wrong[0] < done + len(draft):
            draft[self.wrong[0] - done] = self.wrong[1]
        return draft


def generate(engine: LLMEngine, work: list[tuple[list[int], SamplingParams]]) -> dict[str, RequestOutput]:
    return run_all(engine, work)


def with_oracle(llm: LLM, plain: dict[str, RequestOutput], wrong: tuple[int, int] | None = None) -> LLMEngine:
    engine = llm.engine
    assert engine.speculator is not None
    engine.speculator.proposer = Oracle({rid: o.token_ids for rid, o in plain.items()}, wrong)
    engine.speculator.always_draft()
    return engine


def test_penalties_bias_and_min_tokens_see_the_drafts_before_each_row():
    loaded = tiny_model()
    prompts = [random_tokens(12 + 5 * i, 40 + i) for i in range(5)]
    plain_run = generate(LLM(loaded=loaded, num_kv_blocks=64).engine, [(prompts[0], SamplingParams(
        max_tokens=40, temperature=0.0, ignore_eos=True))])
    stop = plain_run["r0"].token_ids[5]        # a stop token that min_tokens holds back at first
    options = [
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, repetition_penalty=1.8),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.7),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logit_bias={7: 3.0, 9: -100.0}),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, min_tokens=12, stop_token_ids=[stop]),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, repetition_penalty=1.3, min_tokens=3,
                       frequency_penalty=0.4, logit_bias={5: 2.0}),
        # negative penalties make outputs repeat what they said: a row then depends on the drafts before it
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, frequency_penalty=-0.6, presence_penalty=-1.0),
        SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, repetition_penalty=0.5),
    ]
    prompts += [random_tokens(9, 50), random_tokens(10, 51)]
    work = list(zip(prompts, options))
    plain = generate(LLM(loaded=loaded, num_kv_blocks=64).engine, work)
    got = generate(with_oracle(LLM(loaded=loaded, num_kv_blocks=64, speculative_config=NGRAM), plain), work)
    assert {r: o.token_ids for r, o in got.items()} == {r: o.token_ids for r, o in plain.items()}
    for rid, out in got.items():
        assert out.num_draft_tokens > 0 and out.num_accepted_tokens == out.num_draft_tokens, rid


@pytest.fixture(scope="module")
def json_work(default_model):
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {
        "type": "array", "items": {"type": "string"}, "maxItems": 3}}, "required": ["name", "tags"]}
    llm = LLM(loaded=default_model, num_kv_blocks=64)
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Describe a cat as JSON."}],
                                               add_generation_prompt=True)
    params = SamplingParams(max_tokens=40, temperature=0.0, structured=StructuredOutputs(json=schema))
    work = [(llm.engine.encode_prompt(prompt), params)]
    return work, generate(llm.engine, work)


def test_a_grammars_drafted_rows_take_its_mask_after_the_drafts(default_model, json_work):
    work, plain = json_work
    spec = LLM(loaded=default_model, num_kv_blocks=64, speculative_config=NGRAM)
    got = generate(with_oracle(spec, plain), work)["r0"]
    assert got.token_ids == plain["r0"].token_ids and got.text == plain["r0"].text
    assert got.num_draft_tokens > 8 and got.num_accepted_tokens == got.num_draft_tokens


def test_drafted_tokens_the_grammar_rejects_are_cut_before_the_step(default_model, json_work):
    work, plain = json_work
    ids = plain["r0"].token_ids
    bad = default_model.tokenizer.encode("}}}", add_special_tokens=False)[0]     # never right after '{"'
    spec = LLM(loaded=default_model, num_kv_blocks=64, speculative_config=NGRAM)
    assert bad != ids[2]
    clean = generate(with_oracle(LLM(loaded=default_model, num_kv_blocks=64, speculative_config=NGRAM), plain),
                     work)["r0"]
    got = generate(with_oracle(spec, plain, wrong=(2, bad)), work)["r0"]
    assert got.token_ids == ids
    # the first decode step's draft (outputs 1..4) held the bad token at output 2: it was cut
    # there, so that draft checked one token where the clean run's checked four; every token
    # checked was accepted (the bad one never reached the step)
    assert got.num_accepted_tokens == got.num_draft_tokens < clean.num_draft_tokens


def test_masks_after_drafts_equal_a_matcher_moved_there_and_leave_it_as_it_was(default_model):
    llm = LLM(loaded=default_model, num_kv_blocks=16)
    grammars = llm.engine.grammars
    spec = StructuredOutputs(regex=r"(cat|dog)s? [0-9]{2,3}")
    vocab = default_model.config.vocab_size
    words = (vocab + 31) // 32
    tokens = default_model.tokenizer.encode("cats 123", add_special_tokens=False)
    matcher = grammars.matcher(spec)
    before = torch.zeros((1, words), dtype=torch.int32)
    matcher.fill_bitmask(before, 0)
    masks = matcher.masks_after(tokens, words)
    assert 1 <= len(masks) <= len(tokens)
    for i, mask in enumerate(masks, start=1):
        fresh = grammars.matcher(spec)
        for t in tokens[:i]:
            fresh.accept(t)
        want = torch.zeros((1, words), dtype=torch.int32)
        fresh.fill_bitmask(want, 0)
        assert torch.equal(mask, want[0])
    after = torch.zeros((1, words), dtype=torch.int32)
    matcher.fill_bitmask(after, 0)
    assert torch.equal(before, after)
    assert matcher.valid_prefix(tokens) == len(tokens)
    assert matcher.valid_prefix([*tokens[:1], *default_model.tokenizer.encode("!", add_special_tokens=False)]) == 1


def test_drafted_rows_see_the_request_after_their_drafts():
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=4), arrival_seq=0)
    req.append_token(9)
    rows = drafted_rows(req, [5, 6], vocab_size=16)
    assert rows[0] is req and len(rows) == 3
    second = rows[2]
    assert isinstance(second, DraftedRow)
    assert second.output_token_ids == [9, 5, 6] and second.all_token_ids == [1, 2, 3, 9, 5, 6]
    assert second.num_output_tokens == 3 and second.constraint is None and req.num_output_tokens == 1


@pytest.mark.parametrize("params", [
    SamplingParams(max_tokens=20, repetition_penalty=1.7, frequency_penalty=0.9, presence_penalty=0.4),
    SamplingParams(max_tokens=20, frequency_penalty=-0.8, presence_penalty=-1.2, logit_bias={3: 4.0}),
    SamplingParams(max_tokens=20, min_tokens=4, stop_token_ids=[5, 6], repetition_penalty=0.6),
])
def test_each_drafted_row_is_processed_as_the_request_with_its_drafts_appended(params):
    g = torch.Generator().manual_seed(7)
    draft = [4, 5, 4, 9]
    logits = torch.randn(len(draft) + 1, 16, generator=g)
    req = Request("r", [1, 2, 4], params, arrival_seq=0)
    req.append_token(9)
    out, errors = process_logits(logits, drafted_rows(req, draft, 16), eos_token_ids=[6])
    assert not errors
    for i in range(len(draft) + 1):
        moved = Request("m", [1, 2, 4], params, arrival_seq=0)
        for t in [9, *draft[:i]]:
            moved.append_token(t)
        want, _ = process_logits(logits[i:i + 1], [moved], eos_token_ids=[6])
        assert torch.equal(out[i], want[0]), i


def test_a_sampled_requests_drafts_are_checked_against_its_processed_rows():
    """The served model drafts its own greedy tokens (every layer), which the bias forbids: raw
    rows would keep many of them (the target agrees with its own argmax), processed rows none."""
    loaded = tiny_model()
    prompt = random_tokens(20, 60)
    greedy = generate(LLM(loaded=loaded, num_kv_blocks=64).engine,
                      [(prompt, SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True))])
    forbidden = {t: -100.0 for t in greedy["r0"].token_ids}
    params = SamplingParams(max_tokens=32, temperature=0.5, ignore_eos=True, logit_bias=forbidden)
    llm = LLM(loaded=loaded, num_kv_blocks=64, speculative_config={"method": "self", "skip_layers": []})
    assert llm.engine.speculator is not None
    llm.engine.speculator.always_draft()
    got = generate(llm.engine, [(prompt, params)])["r0"]
    assert got.num_draft_tokens > 0
    assert not set(got.token_ids) & set(forbidden)

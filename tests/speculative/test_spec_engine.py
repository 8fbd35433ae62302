"""Speculative decoding in the engine (tiny random model): greedy outputs token for token those
of plain decoding (sampled ones: tests/speculative/test_spec_sampling.py), in every per-token KV format and attention backend, with prefix hits,
preemption, aborts and requests that do not draft in the same batch; pool integrity after
every step; the same cached blocks as a plain run."""

from __future__ import annotations

import random

import pytest
from spec_runs import run_all
from tiny import tiny_model

from kvserve import LLM, SamplingParams
from kvserve.engine.engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.request import Request
from kvserve.speculative.cost import StepCosts
from kvserve.speculative.proposers import Proposer
from kvserve.speculative.speculator import before_block_end

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 4}
GREEDY = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return tiny_model()


def prompts(seed: int, n: int = 6) -> list[list[int]]:
    """Prompts that repeat themselves (a quoted passage), so prompt lookup finds drafts."""
    rng = random.Random(seed)
    passage = [rng.randrange(128) for _ in range(24)]
    return [[rng.randrange(128) for _ in range(rng.randrange(3, 20))] + passage + passage[:rng.randrange(4, 20)]
            for _ in range(n)]


def drafting(engine: LLMEngine) -> LLMEngine:
    """Every request that can draft drafts all it may, every step (no timing decides a test)."""
    assert engine.speculator is not None
    engine.speculator.always_draft()
    return engine


def run(engine: LLMEngine, requests: list[tuple[list[int], SamplingParams]],
        abort_at: dict[int, str] | None = None) -> dict[str, RequestOutput]:
    """Every request to the end, checking the pool after every step; ``abort_at``: step -> id."""
    return run_all(engine, requests, abort_at)


def tokens(outs: dict[str, RequestOutput]) -> dict[str, list[int]]:
    return {rid: o.token_ids for rid, o in sorted(outs.items()) if o.finish_reason != "abort"}


@pytest.mark.parametrize("kv_format", ["native", "fp16", "int8", "int4g8", "fp8"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("config", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_greedy_tokens_equal_plain_decoding(loaded, kv_format, backend, config):
    if kv_format == "fp8":
        from kvserve.kv.codecs import fp8_supported
        if not fp8_supported():
            pytest.skip("torch without float8")
    work = [(p, GREEDY) for p in prompts(0)]
    options = {"num_kv_blocks": 64, "kv_format": kv_format, "attention_backend": backend}
    plain = LLM(loaded=loaded, **options).engine
    spec = drafting(LLM(loaded=loaded, speculative_config=config, **options).engine)
    want, got = run(plain, work), run(spec, work)
    assert tokens(got) == tokens(want)
    stats = spec.stats().spec
    assert stats is not None and stats.num_accepted_tokens > 0 and spec.num_steps < plain.num_steps
    assert sum(o.num_accepted_tokens for o in got.values()) == stats.num_accepted_tokens
    assert sum(o.num_draft_tokens for o in got.values()) == stats.num_draft_tokens
    # blocks full of accepted tokens only were cached: the same keys as the plain run's
    assert sorted(spec.kv.cached_keys()) == sorted(plain.kv.cached_keys())
    assert spec.kv.num_free_blocks == spec.kv.num_blocks


@pytest.mark.parametrize("config", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_a_mixed_batch_with_prefix_hits_stops_and_opt_outs(loaded, config):
    ps = prompts(1, 8)
    shared = ps[0][:40]
    work = [(p, GREEDY) for p in ps]
    work += [(shared + [5, 6], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, speculate=False)),
             (ps[1], SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True)),   # seeded: no drafts
             (ps[2], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True)),   # short max_tokens
             (ps[3], SamplingParams(max_tokens=48, temperature=0.0, logprobs=2, ignore_eos=True))]
    plain = LLM(loaded=loaded, num_kv_blocks=96).engine
    spec = drafting(LLM(loaded=loaded, num_kv_blocks=96, speculative_config=config).engine)
    want = run(plain, work)
    # a stop token met while speculating: the output is cut at the same place
    stop_at = want["r0"].token_ids[20]
    work.append((ps[0], SamplingParams(max_tokens=48, temperature=0.0, stop_token_ids=[stop_at], ignore_eos=True)))
    work.append((ps[4], SamplingParams(max_tokens=20, temperature=0.8, ignore_eos=True)))   # speculative sampling
    want = run(LLM(loaded=loaded, num_kv_blocks=96).engine, work)
    got = run(spec, work)
    sampled = "r13"     # the same distribution as plain decoding's, other draws (tests/speculative/test_spec_sampling.py)
    assert {r: t for r, t in tokens(got).items() if r != sampled} == {r: t for r, t in tokens(want).items()
                                                                      if r != sampled}
    assert len(got[sampled].token_ids) == 20
    assert got["r8"].num_draft_tokens == 0 and got["r9"].num_draft_tokens == 0
    assert len(got["r10"].token_ids) == 9
    assert [lp.token_id for lp in got["r11"].logprobs] == got["r11"].token_ids
    assert [round(lp.logprob, 4) for lp in got["r11"].logprobs] == [round(lp.logprob, 4) for lp in want["r11"].logprobs]
    assert got["r12"].stop_reason == stop_at and got["r12"].token_ids[-1] == stop_at
    assert got["r12"].token_ids == want["r12"].token_ids
    assert any(o.num_cached_tokens > 0 for o in got.values())


@pytest.mark.parametrize("config", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_preemption_and_aborts_mid_speculation(loaded, config):
    work = [(p, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)) for p in prompts(2, 8)]
    options = {"num_kv_blocks": 14, "max_num_batched_tokens": 64, "enable_prefix_caching": False}
    want = run(LLM(loaded=loaded, **options).engine, work)
    spec = drafting(LLM(loaded=loaded, speculative_config=config, **options).engine)
    got = run(spec, work, abort_at={6: "r3", 11: "r5"})
    assert spec.scheduler.num_preemptions > 0 and spec.stats().spec.num_accepted_tokens > 0
    assert tokens(got) == {rid: t for rid, t in tokens(want).items() if rid not in ("r3", "r5")}
    assert spec.kv.num_free_blocks == spec.kv.num_blocks


def test_suffix_drafts_a_finished_requests_answer(loaded):
    """The same request again: the outputs index holds the first one's answer, so the second
    drafts more of it, and both give plain decoding's tokens."""
    prompt = prompts(7, 1)[0]
    want = LLM(loaded=loaded).generate([prompt], GREEDY)[0].token_ids
    llm = LLM(loaded=loaded, speculative_config=SUFFIX)
    drafting(llm.engine)
    first, second = llm.generate([prompt], GREEDY)[0], llm.generate([prompt], GREEDY)[0]
    assert first.token_ids == second.token_ids == want
    assert second.num_accepted_tokens > first.num_accepted_tokens
    assert second.num_accepted_tokens >= len(want) // 2
    llm.engine.check_integrity()


def test_bad_configs_are_refused(loaded):
    with pytest.raises(ValueError, match="unknown key"):
        LLM(loaded=loaded, speculative_config={"method": "ngram", "lookahead": 3})


def open_rows_held(engine: LLMEngine) -> tuple[set[int], set[int]]:
    """Blocks holding residual rows, and the running requests' open blocks (their computed
    tokens end inside them): after a step, only open blocks may hold rows."""
    held = set(engine.kv.residual._rows)
    bs = engine.kv.block_size
    open_blocks = {engine.kv.block_ids(r.request_id)[r.num_computed_tokens // bs]
                   for r in engine.scheduler.running if r.num_computed_tokens % bs}
    return held, open_blocks


@pytest.mark.parametrize("kv_format", ["kivi2g8", "kivi4g8", "int4g8+out2", "0=fp16;1-=kivi2g8"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("method", ["ngram", "suffix", "self", "draft"])
def test_formats_that_encode_whole_blocks_give_plain_decodings_tokens(loaded, kv_format, backend, method):
    """A block is encoded as its last slot is written (drafts stop short of a block's last slot
    but at a chunk's start); a block a drafting pass fills keeps its row until the step
    verifies it: the same tokens and cached keys as plain decoding, rows held by open blocks only."""
    work = [(p, GREEDY) for p in prompts(5)]
    options = {"num_kv_blocks": 64, "kv_format": kv_format, "attention_backend": backend}
    config = {"ngram": NGRAM, "suffix": SUFFIX}.get(method, {"method": method, "num_speculative_tokens": 4})
    if method == "self":
        config = {**config, "skip_layers": [1]}
    plain = LLM(loaded=loaded, **options).engine
    spec = drafting(LLM(loaded=loaded, speculative_config=config, draft=tiny_model(seed=3) if method == "draft"
                        else None, **options).engine)
    want = run(plain, work)

    def rows_held_by_open_blocks(engine: LLMEngine) -> None:
        held, open_blocks = open_rows_held(engine)
        assert held <= open_blocks

    got = run_all(spec, work, check=rows_held_by_open_blocks)
    assert tokens(got) == tokens(want)
    stats = spec.stats().spec
    assert stats is not None and stats.num_draft_tokens > 0
    assert sorted(spec.kv.cached_keys()) == sorted(plain.kv.cached_keys())
    assert spec.kv.num_free_blocks == spec.kv.num_blocks and not spec.kv.residual._rows


@pytest.mark.parametrize(("position", "room"), [(0, 14), (13, 1), (14, 0), (15, 15), (16, 14), (31, 15)])
def test_drafts_stop_short_of_a_blocks_last_slot(position, room):
    assert before_block_end(position, 16) == room


def appended_per_step(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """The tokens each step appended to one request."""
    engine.add_request(prompt, params)
    steps, prev = [], 0
    while engine.has_unfinished:
        for out in engine.step():
            steps.append(out.token_ids[prev:])
            prev = len(out.token_ids)
        engine.check_integrity()
    return steps


class FreeRows(StepCosts):
    """A machine where drafted rows cost nothing: every request drafts k_max tokens."""

    def __init__(self) -> None:
        super().__init__(1.0, 0.0)

    def observe(self, num_rows: int, seconds: float) -> None:
        pass

    def row_share(self, batch: int) -> float:
        return 0.0


class OracleProposer(Proposer):
    """Drafts the plain run's own next tokens, the ``wrong``-th of each draft changed (None:
    all right): every step's acceptance is then known."""

    name = "oracle"

    def __init__(self, prompt_len: int, output: list[int], wrong: int | None = None) -> None:
        self.prompt_len, self.output, self.wrong = prompt_len, output, wrong

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        done = request.num_tokens - self.prompt_len
        draft = self.output[done:done + num_tokens]
        if self.wrong is not None and self.wrong < len(draft):
            draft[self.wrong] = (draft[self.wrong] + 1) % 128
        return draft


def with_oracle(loaded, prompt: list[int], output: list[int], wrong: int | None = None) -> LLMEngine:
    engine = LLM(loaded=loaded, speculative_config=NGRAM).engine
    assert engine.speculator is not None
    engine.speculator.proposer = OracleProposer(len(prompt), output, wrong)
    engine.speculator.costs = FreeRows()
    return engine


@pytest.mark.parametrize("wrong", [None, 0, 2])
def test_known_drafts_are_accepted_up_to_the_first_wrong_token(loaded, wrong):
    prompt = prompts(3, 1)[0]
    plain = LLM(loaded=loaded).generate([prompt], GREEDY)[0].token_ids
    steps = appended_per_step(with_oracle(loaded, prompt, plain, wrong), prompt, GREEDY)
    assert [t for s in steps for t in s] == plain
    per_step = 4 + 1 if wrong is None else wrong + 1      # accepted drafts + the target's own token
    assert [len(s) for s in steps[1:-1]] == [per_step] * (len(steps) - 2)


def test_a_stop_token_inside_an_accepted_run_cuts_the_output_there(loaded):
    prompt = prompts(3, 1)[0]
    plain = LLM(loaded=loaded).generate([prompt], GREEDY)[0].token_ids
    # steps: the prefill's token, then runs of 5 (tokens 1-5, 6-10, ...): stop at the middle of
    # the second run, a token the output has not held before
    at = next(i for i in range(7, 10) if plain[i] not in plain[:i])
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True, stop_token_ids=[plain[at]])
    steps = appended_per_step(with_oracle(loaded, prompt, plain), prompt, params)
    assert [t for s in steps for t in s] == plain[:at + 1] == LLM(loaded=loaded).generate([prompt], params)[0].token_ids
    assert [len(s) for s in steps] == [1, 5, at - 5]      # the run cut at the stop token

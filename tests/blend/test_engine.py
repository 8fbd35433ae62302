"""Blending in the engine: segmented prompts through LLM.generate, the cost model's verdict,
shared segment blocks, prefix hits kept exact, lossy blocks never cached, formats, tiers."""

from __future__ import annotations

import pytest
from tiny import random_tokens as tokens

from kvserve import LLM, SamplingParams
from kvserve.blend.blender import blend_work
from kvserve.blend.prompt import Segment, SegmentedPrompt
from kvserve.request import BlendSpec

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)




DOCS = [tokens(40, 1), tokens(33, 2), tokens(48, 3), tokens(20, 4)]


def rag(order: list[int], fraction: float, system: int = 11, question_seed: int = 9) -> SegmentedPrompt:
    parts: list = [tokens(system, 0)]
    for i in order:
        parts += [Segment(DOCS[i]), [5]]             # a separator token after each document
    parts.append(tokens(7, question_seed))
    return SegmentedPrompt(parts, blend_fraction=fraction)


def plain(prompt: SegmentedPrompt) -> list[int]:
    return [t for p in prompt.parts for t in (p.content if isinstance(p, Segment) else p)]


def test_fraction_one_gives_the_full_prefill_tokens(loaded):
    # at 1.0 blending costs a full prefill, so the cost model would send it there: off here
    llm = LLM(loaded=loaded, num_kv_blocks=48, blend_cost_model=False)
    prompt = rag([0, 1, 2], 1.0)
    want = LLM(loaded=loaded, enable_prefix_caching=False).generate([plain(prompt)], GREEDY)[0]
    first = llm.generate([prompt], GREEDY)[0]         # segments computed standalone, stored, blended
    again = llm.generate([prompt], GREEDY)[0]         # segments found in the pool
    assert first.token_ids == want.token_ids and again.token_ids == want.token_ids
    assert first.prompt_token_ids == want.prompt_token_ids
    # full blocks of each document reused (32 + 32 + 48), every one of them recomputed at 1.0
    assert (again.num_reused_tokens, again.num_recomputed_tokens) == (112, 112)
    stats = llm.engine.stats().blend
    assert (stats.num_blended, stats.stored_tokens, stats.num_declined) == (2, 112, 0)
    llm.engine.check_integrity()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_the_blends_passes_attend_through_the_engines_backend(loaded, monkeypatch, backend):
    """Outside the batch every layer of the blend's passes attends through the backend the
    engine runs (``AttentionBackend.attend_dense``), not a kernel of blending's choosing."""
    llm = LLM(loaded=loaded, num_kv_blocks=48, blend_cost_model=False, blend_in_batch=False,
              attention_backend=backend)
    engine = llm.engine
    attention = engine.runner.backend
    assert engine.blending.blender.attention is attention and attention.name == backend
    calls = []
    attend = attention.attend_dense
    monkeypatch.setattr(attention, "attend_dense", lambda *args: calls.append(args[3].numel()) or attend(*args))
    out = llm.generate([rag([0, 1, 2], 0.15)], GREEDY)[0]
    assert out.num_recomputed_tokens > 0 and len(out.token_ids) == 6
    # layer 0 computes every token (a causal prefill), the layers from select_layer on some
    n = len(out.prompt_token_ids)
    assert len(calls) == loaded.config.num_layers and calls[0] == n and all(0 < c < n for c in calls[1:])


@pytest.mark.parametrize("selection", ["deviation", "narrowing", "query", "query-segments"])
def test_the_engine_blends_with_each_selection_as_blend_prefill_does(loaded, selection):
    """``blend_selection`` and ``blend_sink_tokens`` reach the blend: the engine's request
    recomputes exactly the tokens ``blend_prefill`` picks, and gives its greedy tokens."""
    from kvserve.blend.blending import BlendPrompt, blend_prefill, greedy_tokens
    from kvserve.blend.rope import RopeTables
    from kvserve.blend.segment import compute_kv

    llm = LLM(kv_format="native", loaded=loaded, num_kv_blocks=64, blend_cost_model=False, blend_selection=selection,
              blend_sink_tokens=4, blend_query_layer=1, enable_prefix_caching=False)
    prompt = rag([2, 0, 1], 0.15)
    out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1))[0]
    ids = plain(prompt)
    model = llm.engine.model
    spans, at = [], 11
    for i in (2, 0, 1):
        spans.append((at, len(DOCS[i])))
        at += len(DOCS[i]) + 1
    blend = BlendPrompt(tuple(ids), tuple(spans))
    # the documents were computed standalone just now, so every token of each is reused
    cached = [compute_kv(model, DOCS[i]) for i in (2, 0, 1)]
    ref = blend_prefill(model, RopeTables(model.config), blend, cached, 0.15, 1, None, selection, 4, 1)
    assert (out.num_reused_tokens, out.num_recomputed_tokens) == (121, ref.num_recomputed_tokens)
    if selection == "query-segments":     # 19 wanted: a window of the best document, past its sinks
        assert ref.num_recomputed_tokens == 19 + 3 * 4
    else:
        assert ref.num_recomputed_tokens == 8 + 6 + 5        # ceil(0.15 * run), the 4 sinks within
    assert out.token_ids == greedy_tokens(model, ref, 6)
    assert out.logprobs is not None       # the first token's logprob is the blend's own
    first = out.logprobs[0]
    assert first.logprob == pytest.approx(float(ref.logits.float().log_softmax(-1)[first.token_id]), abs=1e-5)
    llm.engine.check_integrity()
    with pytest.raises(ValueError, match="unknown blend selection 'best'"):
        LLM(loaded=loaded, num_kv_blocks=16, blend_selection="best")
    with pytest.raises(ValueError, match="blend_sink_tokens must be an integer >= 0"):
        LLM(loaded=loaded, num_kv_blocks=16, blend_sink_tokens=-2)
    with pytest.raises(ValueError, match="blend_query_layer must be in 0..1 for this model"):
        LLM(loaded=loaded, num_kv_blocks=16, blend_query_layer=2)
    with pytest.raises(ValueError, match="blend_preamble must be a non-empty text"):
        LLM(loaded=loaded, num_kv_blocks=16, blend_preamble="")
    with pytest.raises(ValueError, match="blend_preamble is text, and this model has no tokenizer"):
        LLM(loaded=loaded, num_kv_blocks=16, blend_preamble="You are a helpful assistant.")


def test_segments_are_shared_across_requests_and_lossy_blocks_never_cached(loaded):
    # the cost model off: in the batch the deviation selection runs the rows kept through the 2
    # layers of the tiny model again, so it would never pay here (blend_work)
    llm = LLM(loaded=loaded, num_kv_blocks=48, blend_cost_model=False)
    engine = llm.engine
    assert llm.cache_segments([DOCS[0], DOCS[1], DOCS[2], DOCS[3]]) == 32 + 32 + 48 + 16
    assert llm.cache_segments([DOCS[2]]) == 0
    cached_before = engine.kv.stats().num_cached_blocks
    outs = llm.generate([rag([2, 0], 0.15), rag([0, 2, 1], 0.15), rag([1], 0.15)], GREEDY)
    assert [o.num_reused_tokens for o in outs] == [48 + 32, 32 + 48 + 32, 32]
    # ceil(0.15 * run) tokens per reused run
    assert [o.num_recomputed_tokens for o in outs] == [8 + 5, 5 + 8 + 5, 5]
    # the blended prompts' own blocks were never cached (the prefix of 11 tokens is not a block)
    assert engine.kv.stats().num_cached_blocks == cached_before
    assert all(b.ref_count == 0 for b in engine.kv._pool.blocks)
    engine.check_integrity()
    assert engine.stats().blend.num_blended == 3


def test_the_exact_head_before_the_first_segment_is_cached_and_hit(loaded):
    """A blended prompt's tokens before its first segment (a system prompt) attend to no reused
    KV, so they are computed exactly: their full blocks are cached and hit by the next prompt,
    blended or plain; the blocks from the first segment on never are."""
    llm = LLM(loaded=loaded, num_kv_blocks=64, blend_cost_model=False)
    engine = llm.engine
    assert llm.cache_segments([DOCS[0], DOCS[2]]) == 32 + 48
    cached_before = engine.kv.stats().num_cached_blocks
    first = llm.generate([rag([2, 0], 0.15, system=40)], GREEDY)[0]      # a head of 40 tokens: 2 full blocks
    assert (first.num_cached_tokens, first.num_reused_tokens) == (0, 48 + 32)
    assert engine.kv.stats().num_cached_blocks == cached_before + 2
    second = llm.generate([rag([0, 2], 0.15, system=40, question_seed=10)], GREEDY)[0]
    assert (second.num_cached_tokens, second.num_reused_tokens) == (32, 32 + 48)
    assert engine.kv.stats().num_cached_blocks == cached_before + 2
    engine.check_integrity()
    ids = plain(rag([1], 0.0, system=40))
    hit = llm.generate([ids], GREEDY)[0]
    cold = LLM(loaded=loaded, enable_prefix_caching=False).generate([ids], GREEDY)[0]
    assert hit.num_cached_tokens == 32 and hit.token_ids == cold.token_ids
    engine.check_integrity()


def test_a_cached_prefix_stays_exact_and_is_not_reused(loaded):
    # the same system prompt and first document as an earlier plain request: its blocks hit
    llm = LLM(loaded=loaded, num_kv_blocks=64)
    prompt = rag([0, 1], 0.0, system=24)
    ids = plain(prompt)
    llm.generate([ids[:24 + 40 + 1]], SamplingParams(max_tokens=1))     # caches blocks 0..3 (64 tokens)
    out = llm.generate([prompt], GREEDY)[0]
    assert out.num_cached_tokens == 64
    # document 0 lies in the hit but for its last token; document 1 is computed standalone (all 33 reused)
    assert (out.num_reused_tokens, out.num_recomputed_tokens) == (33, 0)
    llm.engine.check_integrity()
    # the known prefix read back, the rest blended at 1.0: the full prefill's tokens
    exact = LLM(loaded=loaded, num_kv_blocks=64, blend_cost_model=False)
    exact.generate([ids[:24 + 40 + 1]], SamplingParams(max_tokens=1))
    full = SegmentedPrompt(prompt.parts, 1.0)
    out = exact.generate([full], GREEDY)[0]
    want = LLM(loaded=loaded, enable_prefix_caching=False).generate([ids], GREEDY)[0]
    assert out.num_cached_tokens == 64 and out.num_reused_tokens == 33 and out.token_ids == want.token_ids


@pytest.mark.parametrize("in_batch", [True, False])
def test_the_engine_recomputes_the_last_segments_whole_as_blend_prefill_does(loaded, in_batch):
    from kvserve.blend.blending import BlendPrompt, blend_prefill, greedy_tokens
    from kvserve.blend.rope import RopeTables
    from kvserve.blend.segment import compute_kv

    llm = LLM(loaded=loaded, num_kv_blocks=64, blend_cost_model=False, blend_selection="query-segments",
              blend_sink_tokens=4, blend_query_layer=1, blend_last_segments=1, enable_prefix_caching=False,
              blend_in_batch=in_batch)
    prompt = rag([2, 0, 1], 0.15)
    out = llm.generate([prompt], GREEDY)[0]
    model = llm.engine.model
    blend = BlendPrompt(tuple(plain(prompt)), ((11, 48), (60, 40), (101, 33)))
    cached = [compute_kv(model, DOCS[i]) for i in (2, 0, 1)]
    ref = blend_prefill(model, RopeTables(model.config), blend, cached, 0.15, 1, None, "query-segments", 4, 1,
                        last_segments=1)
    # document 1 (33 tokens) whole; ceil(0.15 x 88) = 14 in a window past the others' 4 sinks each
    assert (out.num_reused_tokens, out.num_recomputed_tokens) == (121, 33 + 14 + 2 * 4)
    assert ref.num_recomputed_tokens == 33 + 14 + 2 * 4 and set(range(101, 134)) <= set(ref.selected.tolist())
    assert out.token_ids == greedy_tokens(model, ref, 6)
    llm.engine.check_integrity()
    with pytest.raises(ValueError, match="blend_last_segments must be an integer >= 0, got -1"):
        LLM(loaded=loaded, num_kv_blocks=16, blend_last_segments=-1)


def test_the_cost_model_sends_unprofitable_blends_to_a_full_prefill(loaded):
    llm = LLM(loaded=loaded, num_kv_blocks=48)
    short = SegmentedPrompt([tokens(30, 5), Segment(tokens(10, 6)), tokens(5, 7)], 0.15)
    out = llm.generate([short], GREEDY)[0]            # a segment shorter than a block: nothing to reuse
    want = LLM(loaded=loaded, enable_prefix_caching=False).generate([plain(short)], GREEDY)[0]
    assert out.token_ids == want.token_ids and out.num_reused_tokens == 0
    assert llm.engine.stats().blend.num_declined == 1
    # at fraction 1.0 with 2 layers, select layer 1: 0.5 + 0.5 = 1 per reused token: no gain
    assert blend_work(100, 60, 1.0, 1, 2) == 100
    assert blend_work(100, 60, 0.0, 1, 30) == pytest.approx(40 + 2)
    # the last segments' 20 reused tokens whole, the fraction of the other 40, sinks among those
    assert blend_work(100, 60, 0.1, 1, 30, "query", 0, num_whole=20) == pytest.approx(2 * 40 + 20 + 4)
    assert blend_work(100, 60, 0.0, 1, 30, num_sink_tokens=12, num_whole=20) == pytest.approx(
        40 + 2 + 32 * 29 / 30)
    # sinks recompute at least their tokens; the query selection computes the others twice
    assert blend_work(100, 60, 0.0, 1, 30, num_sink_tokens=12) == pytest.approx(40 + 2 + 12 * 29 / 30)
    assert blend_work(100, 60, 0.1, 1, 30, "query") == pytest.approx(2 * 40 + 6)
    assert blend_work(100, 60, 0.1, 1, 30, "query", 12) == pytest.approx(2 * 40 + 12)
    assert blend_work(100, 60, 0.1, 1, 30, "query-segments", 12) == pytest.approx(2 * 40 + 12)
    # read at layer 14 of 30, the first pass stops there: 15 of its 30 layers
    assert blend_work(100, 60, 0.1, 1, 30, "query-segments", 12, query_layer=14) == pytest.approx(1.5 * 40 + 12)
    # ... and computes only the text before the first segment and the question (25 of the 40)
    assert blend_work(100, 60, 0.1, 1, 30, "query-segments", 12, query_layer=14, num_asking=25) == pytest.approx(
        40 + 0.5 * 25 + 12)
    # those rows: before the first segment (past an exact hit) and after the last
    spec = BlendSpec(((5, 20), (28, 32)), 0.1)
    assert [spec.num_asking_tokens(66, known) for known in (0, 4, 8, 64)] == [11, 7, 6, 2]
    # narrowing: layer 1 computes 12 of the 60 (2f), layer 2 9 (1.5f), then 6 (f) on
    assert blend_work(100, 60, 0.1, 1, 30, "narrowing") == pytest.approx(40 + 2 + 6 * 29 / 30 + (6 + 3) / 30)
    # in the batch, the rows kept run again through the choosing pass's layers (0-1; narrowing 0-3);
    # the query selections' rows are computed once either way
    dense = 40 + 2 + 6 * 29 / 30
    assert blend_work(100, 60, 0.1, 1, 30, in_batch=True) == pytest.approx(dense + 46 * 2 / 30)
    assert blend_work(100, 60, 0.1, 1, 30, "narrowing", in_batch=True) == pytest.approx(
        dense + (6 + 3) / 30 + 46 * 4 / 30)
    assert blend_work(100, 60, 0.1, 1, 30, "query", 12, in_batch=True) == pytest.approx(2 * 40 + 12)
    llm.engine.check_integrity()


@pytest.mark.parametrize("kv_format", ["int8", "k=kivi4g8+had,v=int8"])
def test_blending_in_a_quantized_format(loaded, kv_format):
    llm = LLM(loaded=loaded, num_kv_blocks=64, kv_format=kv_format, blend_cost_model=False)
    prompt = rag([2, 0, 1], 1.0)
    blended = llm.generate([prompt], GREEDY)[0]
    assert blended.num_reused_tokens == 40 + 33 + 48     # computed standalone just now: every token
    llm.engine.check_integrity()
    # decoding after the written KV: more tokens, other requests alongside
    outs = llm.generate([rag([1, 2], 0.15), plain(rag([0], 0.0))], SamplingParams(max_tokens=20, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [20, 20]
    llm.engine.check_integrity()


def test_segments_come_back_from_a_tier(loaded):
    llm = LLM(loaded=loaded, num_kv_blocks=24, host_cache_gb=0.01, blend_cost_model=False)
    engine = llm.engine
    llm.cache_segments([DOCS[2]])                       # 3 blocks
    filler = [tokens(16 * 23 + 3, 20)]
    llm.generate(filler, SamplingParams(max_tokens=1))  # evicts the segment's blocks to the host tier
    assert engine.blending.blender.segments.locate(DOCS[2]).num_device_blocks == 0
    out = llm.generate([rag([2], 1.0)], GREEDY)[0]
    want = LLM(loaded=loaded, enable_prefix_caching=False).generate([plain(rag([2], 1.0))], GREEDY)[0]
    assert out.num_reused_tokens == 48 and out.token_ids == want.token_ids
    assert engine.stats().blend.stored_tokens == 48     # loaded back, not computed again
    engine.check_integrity()


def test_bad_segmented_prompts_are_refused(loaded):
    llm = LLM(loaded=loaded, num_kv_blocks=32)
    with pytest.raises(ValueError, match="at least one Segment"):
        SegmentedPrompt([tokens(5, 1)])
    with pytest.raises(ValueError, match="at least one segment span"):     # what a front end hands the engine
        BlendSpec((), 0.1)
    with pytest.raises(ValueError, match="blend_fraction"):
        SegmentedPrompt([Segment(tokens(5, 1))], blend_fraction=1.5)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        llm.generate([rag([0], 0.1)], SamplingParams(prompt_logprobs=1))
    with pytest.raises(ValueError, match="prompt_logprobs"):   # the plain prompt is not queued either
        llm.generate([tokens(20, 1), rag([0], 0.1)], SamplingParams(prompt_logprobs=1))
    with pytest.raises(ValueError, match="out of range"):
        llm.generate([SegmentedPrompt([Segment([1, 2, 999])])], GREEDY)
    with pytest.raises(ValueError, match="does not occur"):
        SegmentedPrompt.from_text("abc def", ["def", "abc"])
    llm.engine.check_integrity()
    assert not llm.engine.has_unfinished


def test_from_text_cuts_at_the_segments():
    p = SegmentedPrompt.from_text("Read: A then B? B", ["A", "B"], 0.2)
    assert p.parts == ("Read: ", Segment("A"), " then ", Segment("B"), "? B")
    assert p.blend_fraction == 0.2


def test_a_waiting_segmented_request_can_be_aborted(loaded):
    llm = LLM(loaded=loaded, num_kv_blocks=32)
    engine = llm.engine
    rid = engine.add_request(rag([0, 1], 0.15), GREEDY)
    assert engine.has_unfinished
    engine.abort(rid)
    assert not engine.has_unfinished and engine.step() == []
    engine.check_integrity()
    assert all(b.ref_count == 0 for b in engine.kv._pool.blocks)


def test_a_preempted_blended_request_is_recomputed_and_finishes(loaded):
    # 14 blocks: the blended request and a plain one cannot both grow to their 40 new tokens
    llm = LLM(loaded=loaded, num_kv_blocks=14, blend_cost_model=False)
    engine = llm.engine
    long_out = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    llm.cache_segments([DOCS[0]])
    plain_id = engine.add_request(tokens(60, 30), long_out)
    blended = engine.add_request(rag([0], 0.15), long_out)      # the later arrival: the victim
    done = {}
    for _ in range(500):
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
        if not engine.has_unfinished:
            break
    assert set(done) == {blended, plain_id}
    assert [len(done[r].token_ids) for r in (blended, plain_id)] == [60, 60]
    # preempted, then recomputed in full (exact), its reuse counts kept from its blend
    assert done[blended].num_preemptions >= 1 and done[blended].num_reused_tokens == 32
    assert all(b.ref_count == 0 for b in engine.kv._pool.blocks)


def test_no_room_to_load_a_segment_computes_it_instead(loaded):
    # 10 blocks: the request takes 8, a tier load of the segment's 3 cannot get blocks
    llm = LLM(loaded=loaded, num_kv_blocks=10, host_cache_gb=0.01, blend_cost_model=False)
    engine = llm.engine
    llm.cache_segments([DOCS[2]])
    llm.generate([tokens(16 * 9 + 3, 21)], SamplingParams(max_tokens=1))   # the segment goes to the host tier
    assert engine.blending.blender.segments.locate(DOCS[2]).tier_run.num_blocks == 3
    prompt = SegmentedPrompt([tokens(11, 0), Segment(DOCS[2]), tokens(60, 22)], 0.15)
    out = llm.generate([prompt], GREEDY)[0]
    want = LLM(loaded=loaded, enable_prefix_caching=False).generate([plain(prompt)], GREEDY)[0]
    assert out.error is None and out.num_reused_tokens == 0 and out.token_ids == want.token_ids
    engine.check_integrity()
    assert all(b.ref_count == 0 for b in engine.kv._pool.blocks)


@pytest.mark.parametrize("speed", ["slow", "fast"])
def test_the_cost_model_weighs_a_tier_load_against_the_partial_recompute(loaded, speed):
    # a 48-token segment in the host tier. Blending saves 48 - 48 * (1/2 + 0.15/2) = 20.4
    # token-equivalents (2 layers, select layer 1) and costs the load: at a prefill speed
    # where loading still beats recomputing those 48 tokens (the tier's own verdict) but
    # the load costs more than 20.4 tokens' compute, the request gets a full prefill. (Outside
    # the batch: inside it the rows kept run through the tiny model's 2 layers twice.)
    llm = LLM(loaded=loaded, num_kv_blocks=24, host_cache_gb=0.01, blend_in_batch=False)
    engine = llm.engine
    llm.cache_segments([DOCS[2]])
    llm.generate([tokens(16 * 23 + 3, 20)], SamplingParams(max_tokens=1))
    load_s = engine.kv._tiering.load_seconds(engine.blending.blender.segments.locate(DOCS[2]).tier_run)
    assert load_s > 0
    tokens_per_s = (20.4 + 48) / 2 / load_s if speed == "fast" else 10.0 / load_s
    for _ in range(80):                 # the measured speed is a moving average: settle it here
        engine.kv.observe_prefill(int(tokens_per_s), 1.0)
    prompt = SegmentedPrompt([tokens(11, 0), Segment(DOCS[2]), tokens(7, 9)], 0.15)
    out = llm.generate([prompt], GREEDY)[0]
    stats = engine.stats().blend
    if speed == "fast":
        assert (stats.num_blended, stats.num_declined, out.num_reused_tokens) == (0, 1, 0)
    else:
        assert (stats.num_blended, stats.num_declined, out.num_reused_tokens) == (1, 0, 48)
    engine.check_integrity()


def test_decoding_requests_keep_stepping_while_a_prompt_blends(loaded):
    """A step's token budget of 16 is 32 token-layers of blend work on the 2-layer model:
    layer 0 of the 142-token prompt, layer 1 of its 40 computed and selected rows (each over
    more than 32), then its logits: three steps, in each of which the decoding request gets
    its token. The tokens
    are those of the blend run whole before one step (``blend_in_steps`` off)."""
    def run(in_steps: bool) -> tuple[list[list[str]], dict[str, list[int]]]:
        llm = LLM(loaded=loaded, num_kv_blocks=48, blend_cost_model=False, max_num_batched_tokens=16,
                  blend_in_steps=in_steps, blend_in_batch=False)
        engine = llm.engine
        llm.cache_segments(DOCS[:3])
        decoding = engine.add_request(tokens(10, 40), SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
                                      request_id="decoding")
        engine.step()                                           # its prefill and first token
        engine.add_request(rag([0, 1, 2], 0.15), GREEDY, request_id="blended")
        got: dict[str, list[int]] = {decoding: [], "blended": []}
        per_step = []
        while engine.has_unfinished:
            outs = engine.step()
            if engine.blending.blending is not None or not per_step or len(got["blended"]) == 0:
                per_step.append(sorted({o.request_id for o in outs}))
            for o in outs:
                got[o.request_id] = list(o.token_ids)
            engine.check_integrity()
            if len(per_step) == 1 and in_steps:
                assert engine.scheduler.num_reserved_seats == 1     # the blend holds its seat
        assert engine.scheduler.num_reserved_seats == 0
        return per_step, got

    stepped, got = run(True)
    whole, want = run(False)
    assert stepped == [["decoding"], ["decoding"], ["blended", "decoding"]]
    assert whole == [["blended", "decoding"]]
    assert got == want and len(got["blended"]) == 6 and len(got["decoding"]) == 12


def test_a_request_aborted_while_it_blends_frees_its_blocks_and_seat(loaded):
    llm = LLM(loaded=loaded, num_kv_blocks=48, blend_cost_model=False, max_num_batched_tokens=16)
    engine = llm.engine
    llm.cache_segments(DOCS[:3])
    rid = engine.add_request(rag([0, 1, 2], 0.15), GREEDY)
    assert engine.step() == [] and engine.blending.blending is not None
    engine.abort(rid)
    assert engine.blending.blending is None and engine.scheduler.num_reserved_seats == 0
    assert not engine.has_unfinished
    engine.check_integrity()
    assert all(b.ref_count == 0 for b in engine.kv._pool.blocks)
    again = llm.generate([rag([0, 1, 2], 0.15)], GREEDY)[0]      # the engine goes on
    assert again.error is None and len(again.token_ids) == 6


@pytest.mark.parametrize("in_batch", [True, False])
def test_a_blend_that_fails_midway_fails_alone(loaded, monkeypatch, in_batch):
    llm = LLM(loaded=loaded, num_kv_blocks=48, blend_cost_model=False, max_num_batched_tokens=16,
              blend_in_batch=in_batch)
    engine = llm.engine
    llm.cache_segments(DOCS[:3])

    def broken(task):
        raise RuntimeError("no room to write")
    # in the batch the blend's last part outside it hands its rows over; else it writes the KV
    monkeypatch.setattr(engine.blending.blender, "rows" if in_batch else "finish", broken)
    plain = engine.add_request(tokens(10, 40), GREEDY)
    failed = engine.add_request(rag([0, 1, 2], 0.15), GREEDY)
    done = {}
    while engine.has_unfinished:
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    assert "blending failed: RuntimeError: no room to write" in done[failed].error
    assert done[plain].error is None and len(done[plain].token_ids) == 6
    assert engine.scheduler.num_reserved_seats == 0
    engine.check_integrity()
    assert all(b.ref_count == 0 for b in engine.kv._pool.blocks)

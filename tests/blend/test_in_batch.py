"""Blending inside the batch (``blend_in_batch``): the recomputed rows run as chunks of the
engine's steps, through its attention backends and KV formats, beside other requests."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_engine import DOCS, plain, rag
from tiny import TINY, tiny_model
from tiny import random_tokens as tokens

from kvserve import LLM, SamplingParams
from kvserve.blend.blending import BlendJob, BlendPrompt, attention_keys_per_row, blend_prefill, greedy_tokens
from kvserve.blend.prompt import Segment, SegmentedPrompt
from kvserve.blend.rope import RopeTables
from kvserve.blend.segment import compute_kv
from kvserve.blend.store import read_tokens
from kvserve.model.loader import LoadedModel
from kvserve.request import BlendRows

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ORDER = (2, 0, 1)


@pytest.fixture(scope="module")
def four_layers() -> LoadedModel:
    """Four layers: narrowing chooses at layers 1, 2 and 3 (2f, 1.5f, f)."""
    return tiny_model(dataclasses.replace(TINY, num_layers=4), seed=3)


def reference(llm: LLM, prompt: SegmentedPrompt, selection: str, query_layer: int):
    """The dense blend of ``prompt`` (``blend_prefill``), its documents computed standalone."""
    model = llm.engine.model
    spans, at = [], 11
    for i in ORDER:
        spans.append((at, len(DOCS[i])))
        at += len(DOCS[i]) + 1
    cached = [compute_kv(model, DOCS[i]) for i in ORDER]
    return blend_prefill(model, RopeTables(model.config), BlendPrompt(tuple(plain(prompt)), tuple(spans)), cached,
                         0.15, 1, None, selection, 4, query_layer)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("selection", ["deviation", "narrowing", "query", "query-segments"])
def test_the_batch_computes_the_dense_blend(four_layers, selection, backend):
    """Chunks of 16 rows through the engine's backend give the dense blend's KV in the request's
    blocks (every layer, to float order), its recomputed rows and its greedy tokens."""
    llm = LLM(kv_format="native", loaded=four_layers, num_kv_blocks=64, blend_cost_model=False, blend_selection=selection,
              blend_sink_tokens=4, blend_query_layer=2, enable_prefix_caching=False, blend_in_batch=True,
              attention_backend=backend, max_num_batched_tokens=16)
    engine = llm.engine
    prompt = rag(list(ORDER), 0.15)
    ref = reference(llm, prompt, selection, 2)
    rid = engine.add_request(prompt, GREEDY)
    req = engine.tokens.requests[rid]
    chunks, rows = [], None
    while req.num_output_tokens == 0:
        before = req.num_computed_tokens
        engine.step()
        rows = rows or req.blend_rows
        if req.num_computed_tokens > before:
            chunks.append((before, req.num_computed_tokens))
    # the choice runs first (outside the batch); then chunks of computed rows, each as many as
    # the step's 16 tokens of budget hold, a row costing 1 + the keys it attends / keys_per_row,
    # over at most 16 positions (a step's writes): a longer stretch of supplied positions is
    # written by steps that compute nothing
    assert rows is not None and rows.keys_per_row == attention_keys_per_row(four_layers.config)
    assert [p for start, end in chunks for p in rows.computed_in(start, end)] == list(rows.computed)
    assert len(rows.computed) == 11 + 3 + 7 + ref.num_recomputed_tokens
    cost = lambda positions: sum(1 + (p + 1) / rows.keys_per_row for p in positions)
    assert any(not rows.computed_in(start, end) for start, end in chunks)      # write-only steps
    for start, end in chunks:
        done = rows.computed_in(start, end)
        assert end - start <= 16 and (cost(done) <= 16 or len(done) == 1)
        after = rows.computed_in(end, rows.end)[:1]
        if done and after:          # the chunk stopped for the budget or the positions
            assert cost((*done, *after)) > 16 or after[0] >= start + 16
        if not done:
            assert end - start == 16
    assert req.num_recomputed_tokens == ref.num_recomputed_tokens
    stored = read_tokens(engine.runner.cache, engine.kv.block_ids(rid), req.prompt_token_ids)
    for layer in range(4):
        torch.testing.assert_close(stored.keys[layer], ref.keys[layer], atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(stored.values[layer], ref.values[layer], atol=2e-5, rtol=1e-5)
    out = None
    while engine.has_unfinished:
        out = next((o for o in engine.step() if o.finished), out)
    assert out is not None and out.token_ids == greedy_tokens(engine.model, ref, 6)
    assert (out.num_reused_tokens, out.num_recomputed_tokens) == (121, ref.num_recomputed_tokens)
    assert engine.stats().blend.num_blended == 1
    engine.check_integrity()
    assert all(b.ref_count == 0 for b in engine.kv._pool.blocks)


def test_rows_chunk_by_the_cost_of_their_computed_rows():
    """A chunk ends right after its last computed row within the budget (one row at least), or at
    the prompt's end, and covers at most the given positions (then perhaps supplied ones only);
    a row costs 1 and, with ``keys_per_row``, the keys it attends over that."""
    keys = tuple(torch.zeros(4, 1, 2) for _ in range(2))
    rows = BlendRows(3, (3, 4, 9, 10, 11, 15), (5, 6, 7, 8), keys, keys, 4, 0)
    assert rows.end == 16
    assert rows.chunk(3, 2, 16) == (2, 2, 2)            # 3, 4
    assert rows.chunk(5, 2, 16) == (6, 2, 2)            # 5..10: supplied 5-8, computed 9, 10
    assert rows.chunk(11, 16, 16) == (5, 2, 2)          # 11..15, the prompt's end
    assert rows.chunk(5, 2, 5) == (5, 1, 1)             # 5..9: at most 5 positions
    assert rows.chunk(5, 2, 3) == (3, 0, 0)             # 5..7: supplied only
    assert rows.computed_in(5, 11) == (9, 10) and rows.supplied_in(5, 11) == (0, 4)
    # 10 keys cost a row: position 3 costs 1.4, 4 1.5, 9 2.0, 10 2.1
    costly = BlendRows(3, (3, 4, 9, 10, 11, 15), (5, 6, 7, 8), keys, keys, 4, 0, keys_per_row=10.0)
    assert costly.chunk(3, 3, 16) == costly.chunk(3, 4, 16) == (2, 2, 3)    # 1.4 + 1.5 = 2.9; with 9: 4.9
    assert costly.chunk(3, 5, 16) == (7, 3, 5)
    assert costly.chunk(9, 1, 16) == (1, 1, 2)          # one row, whatever it costs
    with pytest.raises(ValueError, match="at least one"):
        rows.chunk(3, 0, 16)
    with pytest.raises(ValueError, match="one key and one value row per supplied position"):
        BlendRows(3, (3,), (5,), keys, keys, 1, 0)


@pytest.mark.parametrize("kv_format", ["int8", "k=kivi4g8+had,v=int8", "kivi2g8", "zip:hi=int8,lo=kivi2g8,salient=0.25"])
def test_blending_in_the_batch_in_a_quantized_format(loaded, kv_format):
    """The torch path and the CPU kernel read the chunk's keys in the format alike: same tokens;
    the request decodes on after, beside a plain one."""
    outs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(loaded=loaded, num_kv_blocks=64, kv_format=kv_format, blend_cost_model=False,
                  blend_in_batch=True, attention_backend=backend, max_num_batched_tokens=16,
                  blend_selection="query-segments", blend_query_layer=1)
        llm.cache_segments(DOCS[:3])
        got = llm.generate([rag([1, 2], 0.15), plain(rag([0], 0.0))], SamplingParams(max_tokens=20, ignore_eos=True,
                                                                                      temperature=0.0))
        assert [len(o.token_ids) for o in got] == [20, 20] and got[0].num_reused_tokens == 32 + 48
        llm.engine.check_integrity()
        assert all(b.ref_count == 0 for b in llm.engine.kv._pool.blocks)
        outs[backend] = [o.token_ids for o in got]
    assert outs["torch"] == outs["cpu"]


def test_decoding_requests_step_beside_the_blends_chunks(loaded):
    """The blend's rows share each step with a decoding request: every step holds the decode's
    token and, once the rows are chosen, a chunk of the blend's; the tokens are those of the
    dense blend run whole before one step."""
    def run(in_batch: bool) -> tuple[list[list[str]], dict[str, list[int]], int]:
        llm = LLM(loaded=loaded, num_kv_blocks=48, blend_cost_model=False, max_num_batched_tokens=16,
                  blend_in_batch=in_batch, blend_in_steps=in_batch)
        engine = llm.engine
        llm.cache_segments(DOCS[:3])
        engine.add_request(tokens(10, 40), SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                           request_id="decoding")
        engine.step()
        blended = engine.tokens.requests[engine.add_request(rag([0, 1, 2], 0.15), GREEDY, request_id="blended")]
        got: dict[str, list[int]] = {"decoding": [], "blended": []}
        per_step, num_chunks = [], 0
        while engine.has_unfinished:
            before = blended.num_computed_tokens
            outs = engine.step()
            num_chunks += before < blended.num_computed_tokens and before < blended.num_prompt_tokens
            if not got["blended"]:
                per_step.append(sorted({o.request_id for o in outs}))
            for o in outs:
                got[o.request_id] = list(o.token_ids)
            engine.check_integrity()
        return per_step, got, num_chunks

    stepped, got, num_chunks = run(True)
    whole, want, _ = run(False)
    # the choice: layers 0 and 1 of every token, a step each, then a step that ends it (its
    # rows join the batch from the next); then 30 tokens not reused (the documents' partial
    # last blocks among them) and 18 selected, 48 rows, in chunks beside the decode
    assert num_chunks > 2
    assert stepped == [["decoding"]] * (3 + num_chunks - 1) + [["blended", "decoding"]]
    assert whole == [["blended", "decoding"]]
    assert got["decoding"] == want["decoding"] and got["blended"] == want["blended"]


def test_a_request_preempted_while_its_rows_run_is_recomputed_exactly(loaded):
    """Preempted between two chunks of its rows (as the scheduler does when a running request
    needs a block), a blended request drops its rows and is computed again in full: its tokens
    are the plain prompt's."""
    llm = LLM(loaded=loaded, num_kv_blocks=48, blend_cost_model=False, blend_in_batch=True,
              max_num_batched_tokens=8)
    engine = llm.engine
    llm.cache_segments(DOCS[:3])
    prompt = rag([0, 1, 2], 0.15)
    rid = engine.add_request(prompt, GREEDY)
    req = engine.tokens.requests[rid]
    while req.num_computed_tokens == 0:
        engine.step()
    assert req.blend_rows is not None and req.num_computed_tokens < req.num_prompt_tokens
    engine.scheduler._preempt(req)
    assert req.blend_rows is None and req.num_computed_tokens == 0
    engine.check_integrity()
    out = None
    while engine.has_unfinished:
        out = next((o for o in engine.step() if o.finished), out)
    want = LLM(loaded=loaded, enable_prefix_caching=False).generate([plain(prompt)], GREEDY)[0]
    assert out is not None and out.num_preemptions == 1 and out.token_ids == want.token_ids
    engine.check_integrity()
    assert all(b.ref_count == 0 for b in engine.kv._pool.blocks)


def test_a_request_aborted_while_its_rows_run_frees_its_blocks(loaded):
    llm = LLM(loaded=loaded, num_kv_blocks=48, blend_cost_model=False, blend_in_batch=True,
              max_num_batched_tokens=8)
    engine = llm.engine
    llm.cache_segments(DOCS[:3])
    rid = engine.add_request(rag([0, 1, 2], 0.15), GREEDY)
    req = engine.tokens.requests[rid]
    while req.num_computed_tokens == 0:     # the choice (two steps' work), then the first chunk
        engine.step()
    assert req.blend_rows is not None and 0 < req.num_computed_tokens < req.num_prompt_tokens
    engine.abort(rid)
    assert not engine.has_unfinished and engine.scheduler.num_reserved_seats == 0
    engine.check_integrity()
    assert all(b.ref_count == 0 for b in engine.kv._pool.blocks)
    again = llm.generate([rag([0, 1, 2], 0.15)], GREEDY)[0]
    assert again.error is None and len(again.token_ids) == 6


def test_the_choice_alone_is_what_blend_prefill_chooses(loaded):
    """``BlendJob(rows_only=True)``: the positions computed are the text not reused and the
    selected tokens; the supplied ones carry the stored (moved) KV from the choosing layer on."""
    model = LLM(loaded=loaded, num_kv_blocks=16).engine.model
    rope = RopeTables(model.config)
    head, question = tokens(11, 0), tokens(7, 9)
    prompt = BlendPrompt.join(head, [DOCS[0], DOCS[1]], question)
    cached = [compute_kv(model, DOCS[0]), compute_kv(model, DOCS[1])]
    ref = blend_prefill(model, rope, prompt, cached, 0.2, 1, None, "deviation", 2)
    rows = BlendJob(model, rope, prompt, cached, 0.2, 1, None, "deviation", 2, rows_only=True).advance(float("inf"))
    assert isinstance(rows, BlendRows)
    selected = set(ref.selected.tolist())
    reused = set(range(11, 11 + 40 + 33))
    assert rows.computed == tuple(p for p in range(len(prompt.token_ids)) if p not in reused or p in selected)
    assert rows.supplied == tuple(sorted(reused - selected))
    at = torch.tensor(rows.supplied)
    for layer in range(2):      # layer 0 as the choosing pass computed it; layer 1 on, as stored
        torch.testing.assert_close(rows.keys[layer], ref.keys[layer][at], atol=1e-6, rtol=0)
        torch.testing.assert_close(rows.values[layer], ref.values[layer][at], atol=1e-6, rtol=0)
    assert (rows.num_reused_tokens, rows.num_recomputed_tokens) == (73, len(selected))
    segmented = SegmentedPrompt([head, Segment(DOCS[0]), Segment(DOCS[1]), question], 0.2)
    assert plain(segmented) == list(prompt.token_ids)


def test_a_budgeted_request_beside_the_blends_rows(loaded):
    """A plain request under a KV budget (its attention weights added up by the CPU kernel as it
    attends) shares the steps with a blend's rows (queries at given positions): the tokens of
    the torch path, for both."""
    outs = {}
    for backend in ("torch", "cpu"):
        llm = LLM(loaded=loaded, num_kv_blocks=64, blend_cost_model=False, attention_backend=backend,
                  max_num_batched_tokens=16)
        engine = llm.engine
        llm.cache_segments(DOCS[:3])
        budgeted = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, kv_budget=32, kv_policy="snapkv")
        engine.add_request(tokens(40, 50), budgeted, request_id="budgeted")
        engine.add_request(rag([0, 1, 2], 0.15), GREEDY, request_id="blended")
        got, shared = {}, 0
        while engine.has_unfinished:
            rows = engine.tokens.requests.get("blended")
            had_rows = rows is not None and rows.blend_rows is not None
            for o in engine.step():
                got[o.request_id] = list(o.token_ids)
            budget = engine.tokens.requests.get("budgeted")
            shared += had_rows and budget is not None and budget.num_computed_tokens > 40
        assert shared > 0 and engine.kv.budgets.num_compactions >= 1
        engine.check_integrity()
        outs[backend] = got
    assert outs["cpu"] == outs["torch"] and len(outs["cpu"]["budgeted"]) == 24


def test_a_long_stretch_of_reused_tokens_takes_steps_that_only_write(loaded):
    """With 2 sequences and a 16-token step, KIVI's residual rows are 16 / 16 + 2 x 2 + 1 = 6:
    a chunk over a document's 40 reused tokens and more would need a row for each block it
    touches. A chunk covers at most 16 positions; a stretch of supplied ones is written by
    steps that compute nothing (here the only request: steps with no row at all)."""
    llm = LLM(loaded=loaded, num_kv_blocks=48, kv_format="kivi2g8", blend_cost_model=False, max_num_seqs=2,
              max_num_batched_tokens=16, blend_selection="query-segments", blend_query_layer=1)
    engine = llm.engine
    llm.cache_segments(DOCS[:3])
    rid = engine.add_request(rag([0, 1, 2], 0.05), GREEDY)
    req = engine.tokens.requests[rid]
    write_only, out = 0, None
    while engine.has_unfinished:
        before, rows = req.num_computed_tokens, req.blend_rows
        out = next((o for o in engine.step() if o.finished), out)
        if rows is not None and req.num_computed_tokens > before:
            write_only += not rows.computed_in(before, req.num_computed_tokens)
        engine.check_integrity()
    assert write_only >= 2 and out is not None and out.error is None and len(out.token_ids) == 6
    assert all(b.ref_count == 0 for b in engine.kv._pool.blocks)


def test_one_blend_at_a_time_until_its_rows_are_computed(loaded):
    """A blend's supplied keys and values are held outside the KV pool, so the next segmented
    request's choice starts only once the rows of the one before are computed (as outside the
    batch one blend runs at a time); both give the tokens they give alone."""
    llm = LLM(loaded=loaded, num_kv_blocks=64, blend_cost_model=False, max_num_batched_tokens=16)
    engine = llm.engine
    llm.cache_segments(DOCS[:3])
    prompts = [rag([0, 1, 2], 0.15), rag([2, 1], 0.15, question_seed=11)]
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    first, second = (engine.tokens.requests[i] for i in ids)
    got: dict[str, list[int]] = {}
    second_started_after = None
    while engine.has_unfinished:
        for o in engine.step():
            got[o.request_id] = list(o.token_ids)
        holding = [r for r in (first, second) if r.blend_rows is not None]
        assert len(holding) <= 1
        if engine.blending.blending is second and second_started_after is None:
            second_started_after = first.blend_rows is None and first.num_computed_tokens >= first.num_prompt_tokens
        engine.check_integrity()
    assert second_started_after is True
    assert [got[i] for i in ids] == alone

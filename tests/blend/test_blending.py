"""Blending on a tiny model: cached segments plus a partial recompute (the dense reference)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from tiny import TINY, random_tokens, tiny_model

from kvserve import LLM, SamplingParams
from kvserve.blend.blending import (
    BlendJob,
    BlendPrompt,
    _Context,
    attention_keys_per_row,
    blend_prefill,
    greedy_tokens,
    narrowing_fractions,
    segment_peaks_by_layer,
)
from kvserve.blend.rope import RopeTables
from kvserve.blend.segment import compute_kv
from kvserve.blend.store import SegmentStore
from kvserve.model.llama import LlamaModel

DEEP = dataclasses.replace(TINY, num_layers=4)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def tokens(n: int, seed: int) -> tuple[int, ...]:
    return tuple(random_tokens(n, seed))


def rag_prompt(seed: int = 0) -> BlendPrompt:
    """A system text, three documents, a question."""
    return BlendPrompt.join(tokens(11, seed), segments=(tokens(40, seed + 1), tokens(33, seed + 2),
                                                          tokens(48, seed + 3)), suffix=tokens(9, seed + 4))


@pytest.fixture(scope="module", params=["tiny", "deep"])
def setup(request):
    loaded = tiny_model(DEEP if request.param == "deep" else TINY)
    model = LlamaModel(loaded.config, loaded.weights, torch.device("cpu"), torch.float32)
    return loaded, model, RopeTables(loaded.config)


def standalone(model: LlamaModel, prompt: BlendPrompt):
    return [compute_kv(model, s) for s in prompt.segments]


def test_a_key_costs_what_its_share_of_the_multiply_adds_says():
    # SmolLM2-135M: 576 x (576 + 2 x 192) + 576 x 576 + 3 x 576 x 1536 over 2 x 576
    smol = dataclasses.replace(TINY, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3,
                               head_dim=64)
    assert attention_keys_per_row(smol) == 3072.0
    assert attention_keys_per_row(TINY) == (64 * 128 + 64 * 64 + 3 * 64 * 128) / 128 == 288.0


def test_blend_fraction_one_gives_the_full_prefill(setup):
    loaded, model, rope = setup
    prompt = rag_prompt()
    want = LLM(loaded=loaded, enable_prefix_caching=False).generate([prompt.token_ids], GREEDY)[0].token_ids
    blended = blend_prefill(model, rope, prompt, standalone(model, prompt), blend_fraction=1.0)
    assert blended.num_reused_tokens == 40 + 33 + 48 and blended.num_computed_tokens == 11 + 9
    assert blended.selected.tolist() == list(range(11, 11 + 121))     # every reused token recomputed
    assert greedy_tokens(model, blended, 8) == want
    full = compute_kv(model, prompt.token_ids)
    for layer in range(model.config.num_layers):
        torch.testing.assert_close(blended.keys[layer], full.keys[layer], atol=1e-6, rtol=0)
        torch.testing.assert_close(blended.values[layer], full.values[layer], atol=1e-6, rtol=0)


def test_a_partial_blend_recomputes_the_fraction_asked_per_segment(setup):
    _, model, rope = setup
    prompt = rag_prompt(1)
    full = compute_kv(model, prompt.token_ids)
    blended = blend_prefill(model, rope, prompt, standalone(model, prompt), blend_fraction=0.15)
    picked = blended.selected.tolist()
    starts = prompt.segment_starts
    for start, segment in zip(starts, prompt.segments):
        inside = [p for p in picked if start <= p < start + len(segment)]
        assert len(inside) == math.ceil(0.15 * len(segment) - 1e-9)
    assert blended.num_recomputed_tokens == 6 + 5 + 8
    # below the selecting layer every token is computed, so the KV is the full prefill's
    torch.testing.assert_close(blended.keys[0], full.keys[0], atol=1e-6, rtol=0)
    # at it, the selected and computed tokens have their full-prefill KV, the others the cached KV
    computed = [p for p in range(len(prompt.token_ids)) if p < 11 or p >= 132 or p in picked]
    torch.testing.assert_close(blended.keys[1][computed], full.keys[1][computed], atol=1e-6, rtol=0)
    reused_only = [p for p in range(11, 132) if p not in picked]
    assert (blended.keys[1][reused_only] - full.keys[1][reused_only]).abs().max() > 1e-3


@pytest.mark.parametrize("selection", ["deviation", "query"])
def test_fraction_one_gives_the_full_prefill_under_every_selection_and_sinks(setup, selection):
    _, model, rope = setup
    prompt = rag_prompt(5)
    blended = blend_prefill(model, rope, prompt, standalone(model, prompt), blend_fraction=1.0,
                            selection=selection, sink_tokens=4)
    assert blended.selected.tolist() == list(range(11, 11 + 121))
    full = compute_kv(model, prompt.token_ids)
    for layer in range(model.config.num_layers):
        torch.testing.assert_close(blended.keys[layer], full.keys[layer], atol=1e-5, rtol=0)


def test_sink_tokens_are_always_among_the_recomputed(setup):
    _, model, rope = setup
    prompt = rag_prompt(6)
    cached = standalone(model, prompt)
    plain = blend_prefill(model, rope, prompt, cached, blend_fraction=0.15).selected.tolist()
    sinks = blend_prefill(model, rope, prompt, cached, blend_fraction=0.15, sink_tokens=4).selected.tolist()
    starts, lengths = prompt.segment_starts, [len(s) for s in prompt.segments]      # 40, 33, 48 tokens
    for start, length in zip(starts, lengths):
        inside = [p for p in sinks if start <= p < start + length]
        assert inside[:4] == list(range(start, start + 4))
        assert len(inside) == math.ceil(0.15 * length - 1e-9)          # within the fraction: 6, 5, 8
        # the rest are the deviation's best after the sinks, in its order
        ranked = [p for p in plain if start + 4 <= p < start + length]
        assert set(ranked) <= set(inside)
    only = blend_prefill(model, rope, prompt, cached, blend_fraction=0.0, sink_tokens=10).selected.tolist()
    assert only == [p for start in starts for p in range(start, start + 10)]
    with pytest.raises(ValueError, match="blend_sink_tokens must be an integer >= 0"):
        blend_prefill(model, rope, prompt, cached, sink_tokens=-1)
    with pytest.raises(ValueError, match="unknown blend selection 'lru'"):
        blend_prefill(model, rope, prompt, cached, selection="lru")


def test_the_last_segments_are_recomputed_whole_and_the_fraction_taken_of_the_others(setup):
    _, model, rope = setup
    prompt = rag_prompt(7)          # segments at 11 (40 tokens), 51 (33), 84 (48); the question from 132
    cached = standalone(model, prompt)
    last = list(range(84, 132))
    for selection in ("deviation", "narrowing", "query"):
        plain = blend_prefill(model, rope, prompt, cached, 0.15, selection=selection, sink_tokens=2).selected.tolist()
        whole = blend_prefill(model, rope, prompt, cached, 0.15, selection=selection, sink_tokens=2,
                              last_segments=1).selected.tolist()
        # the other segments' picks are the plain blend's (the same scores, chosen per segment)
        assert whole == [p for p in plain if p < 84] + last, selection
    # query-segments: its count, ceil(0.15 x 73), among the first two segments only
    windows = blend_prefill(model, rope, prompt, cached, 0.15, selection="query-segments",
                            last_segments=1).selected.tolist()
    assert windows[-48:] == last and len(windows) == 11 + 48 and max(windows[:-48]) < 84
    # the deviation pass with the last segment recomputed whole is the blend without its cached KV
    ref = blend_prefill(model, rope, prompt, cached[:2] + [None], 0.15)
    got = blend_prefill(model, rope, prompt, cached, 0.15, last_segments=1)
    assert got.num_reused_tokens == 121 and ref.num_reused_tokens == 73
    for layer in range(model.config.num_layers):
        torch.testing.assert_close(got.keys[layer], ref.keys[layer], atol=1e-5, rtol=0)
        torch.testing.assert_close(got.values[layer], ref.values[layer], atol=1e-5, rtol=0)
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-4, rtol=0)
    # every segment (or more than there are) whole: the full prefill's KV at any fraction
    full = compute_kv(model, prompt.token_ids)
    for count in (3, 7):
        every = blend_prefill(model, rope, prompt, cached, 0.0, selection="query-segments", last_segments=count)
        assert every.selected.tolist() == list(range(11, 132))
        torch.testing.assert_close(every.keys[-1], full.keys[-1], atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="blend_last_segments must be an integer >= 0, got -1"):
        blend_prefill(model, rope, prompt, cached, last_segments=-1)


def _question_attention_reference(model: LlamaModel, rope: RopeTables, prefix, segment, question,
                                  only_layer: int | None = None, cached_tokens: int | None = None) -> torch.Tensor:
    """The query selection's score, written out for one segment: the prefix and the question
    computed layer by layer over the segment's cached KV (moved to its place), and the softmax
    weights of the question's queries summed per position over the queries, heads and layers
    (``only_layer``: that layer's alone). ``cached_tokens``: only the segment's leading tokens
    are cached (a store in whole blocks); its tail, between the reused tokens and the question,
    is left out of this pass (no row attends to it, its score 0)."""
    c = len(segment) if cached_tokens is None else cached_tokens
    n0, n1 = len(prefix), len(prefix) + len(segment)
    ids = torch.tensor([*prefix, *question])
    rows = torch.tensor([*range(n0), *range(n1, n1 + len(question))])      # positions, for RoPE
    cached = compute_kv(model, segment[:c]).moved_to(n0, rope)
    present = [*range(n0 + c), *range(n1, n1 + len(question))]            # the positions the KV holds
    m = len(present)
    slots = torch.tensor([*range(n0), *range(n0 + c, m)])                # the rows' places in it
    h = model.embed(ids)
    total = torch.zeros(m)
    for layer in range(model.config.num_layers):
        q, k, v = model.layer_qkv(layer, h, model.angles(rows))
        keys = torch.cat([k[:n0], cached.keys[layer], k[n0:]])     # prefix, the cached tokens, the question
        vals = torch.cat([v[:n0], cached.values[layer], v[n0:]])
        group = q.shape[1] // keys.shape[1]
        kq, vq = keys.repeat_interleave(group, 1), vals.repeat_interleave(group, 1)     # [m, H, D]
        logits = torch.einsum("rhd,nhd->hrn", q, kq) * model.scale
        logits = logits.masked_fill(torch.arange(m)[None, None, :] > slots[None, :, None], float("-inf"))
        weights = logits.softmax(-1)
        if only_layer in (None, layer):
            total += weights[:, n0:].sum((0, 1))    # the question's rows only
        attended = torch.einsum("hrn,nhd->rhd", weights, vq)
        h = model.layer_output(layer, h, attended)
    out = torch.zeros(n1 + len(question))
    out[present] = total
    return out


def test_the_first_pass_computes_the_prefix_and_the_question_and_leaves_out_the_rest(setup):
    """``_Context.asking``: the text before the first reused token and the question. A
    separator between segments and a segment's uncached tail are left out of the first pass:
    its KV holds every other position, in order, and the question's attention on them is 0."""
    _, model, rope = setup
    a, b = tokens(20, 61), tokens(32, 62)
    prompt = BlendPrompt((*tokens(5, 60), *a, *tokens(3, 63), *b, *tokens(6, 64)), ((5, 20), (28, 32)))
    ctx, runs = _Context.of(model, rope, prompt, [compute_kv(model, a[:16]), compute_kv(model, b)], None)
    assert runs == [(5, 16), (28, 32)]                     # a's last 4 tokens (21..24) not cached
    assert torch.nonzero(ctx.asking()).flatten().tolist() == [*range(5), *range(60, 66)]
    passes = ctx.run(ctx.asking(), read_question=True)
    rows = []
    while True:
        try:
            rows.append(next(passes)[0])
        except StopIteration as stop:
            asked = stop.value
            break
    assert rows == [11] * model.config.num_layers
    assert asked.attention is not None and asked.keys[0].shape[0] == 66 - 7
    assert (asked.attention[21:28] == 0).all()
    assert (asked.attention[:21] > 0).all() and (asked.attention[28:] > 0).all()


def test_the_query_selection_picks_the_rows_its_reference_picks(setup):
    _, model, rope = setup
    prefix, segment, question = tokens(9, 31), tokens(60, 32), tokens(7, 33)
    prompt = BlendPrompt.join(prefix, segments=(segment,), suffix=question)
    score = _question_attention_reference(model, rope, prefix, segment, question)[9:69]
    ranked = [int(i) + 12 for i in torch.argsort(score[3:], descending=True)]     # after the 3 sinks
    for count in range(4, 60, 4):       # the whole ranking, a few rows at a time
        blended = blend_prefill(model, rope, prompt, standalone(model, prompt), blend_fraction=count / 60,
                                selection="query", sink_tokens=3)
        assert blended.selected.tolist() == sorted([9, 10, 11, *ranked[:count - 3]]), count
    want = blended.selected.tolist()
    # the others keep the cached KV in every layer; the chosen ones are recomputed in every layer
    cached = compute_kv(model, segment).moved_to(9, rope)
    others = [p for p in range(9, 69) if p not in want]
    last = model.config.num_layers - 1
    for layer in range(model.config.num_layers):
        torch.testing.assert_close(blended.keys[layer][others], cached.keys[layer][[p - 9 for p in others]],
                                   atol=0, rtol=0)
    assert (blended.keys[last][want] - cached.keys[last][[p - 9 for p in want]]).abs().max() > 1e-3


def test_the_query_selection_reads_one_layer_when_told(setup):
    _, model, rope = setup
    prefix, segment, question = tokens(9, 41), tokens(60, 42), tokens(7, 43)
    prompt = BlendPrompt.join(prefix, segments=(segment,), suffix=question)
    last = model.config.num_layers - 1
    score = _question_attention_reference(model, rope, prefix, segment, question, only_layer=last)[9:69]
    ranked = [int(i) + 9 for i in torch.argsort(score, descending=True)]
    for count in range(5, 60, 5):
        blended = blend_prefill(model, rope, prompt, standalone(model, prompt), blend_fraction=count / 60,
                                selection="query", query_layer=last)
        assert blended.selected.tolist() == sorted(ranked[:count]), count
    with pytest.raises(ValueError, match="query_layer must be in"):
        blend_prefill(model, rope, prompt, standalone(model, prompt), selection="query", query_layer=last + 1)


def test_the_question_is_the_text_after_the_last_segment_when_its_tail_is_not_cached(setup):
    """A segment stored in whole blocks is reused up to its last whole block and its tail is
    computed by the blend, but left out of the first pass: the tail's rows are not the
    question's, and their attention (mostly on the tokens just before them) is not part of the
    score. (It was, until 2026-11-28, and pulled the windows of ``query-segments`` to the end of
    the last document.)"""
    _, model, rope = setup
    prefix, segment, question = tokens(9, 51), tokens(60, 52), tokens(7, 53)
    prompt = BlendPrompt.join(prefix, segments=(segment,), suffix=question)
    cached = [compute_kv(model, segment[:48])]                  # three blocks of 16; 12 tokens left out
    score = _question_attention_reference(model, rope, prefix, segment, question, cached_tokens=48)[9:57]
    ranked = [int(i) + 9 for i in torch.argsort(score, descending=True)]
    with_tail = _question_attention_reference(model, rope, prefix, segment[:48], [*segment[48:], *question])
    assert not torch.equal(torch.argsort(score, descending=True),
                           torch.argsort(with_tail[9:57], descending=True))     # the two readings differ here
    for count in range(4, 48, 4):
        blended = blend_prefill(model, rope, prompt, cached, blend_fraction=count / 48, selection="query")
        assert blended.selected.tolist() == sorted(ranked[:count]), count


def test_segments_are_ranked_by_their_peak_past_the_sink_span_and_give_windows_around_it():
    from kvserve.blend.blending import SINK_SPAN, _pick_segments

    runs = [(10, 40), (60, 50), (120, 20)]              # 40 + 50 + 20 reused tokens, in order
    score = torch.zeros(110)
    score[0] = 9.0                                      # run 0's first token: a sink, not counted
    score[40 + SINK_SPAN + 3] = 2.0                     # run 1's peak past its sink span: position 95
    score[90 + 5] = 1.0                                 # run 2 is shorter than the span: all of it counts
    def picked(fraction: float, sinks: int = 0) -> list[int]:
        return _pick_segments(score, runs, fraction, sinks).tolist()
    assert picked(0.0) == []
    assert picked(0.01) == [94, 95]                                   # 2 wanted: centred on run 1's peak
    assert picked(0.1) == list(range(90, 101))                        # 11: 5 before the peak, 5 after
    assert picked(0.4) == list(range(66, 110))                        # 44: moved inside the run's end
    assert picked(0.5) == list(range(60, 110)) + list(range(123, 128))     # 55: run 1 whole, 5 of run 2
    assert picked(0.01, sinks=2) == [10, 11, 60, 61, 94, 95, 120, 121]


def test_more_recompute_comes_closer_to_the_full_prefill(setup):
    _, model, rope = setup
    errors = []
    for seed in range(4):
        prompt = rag_prompt(10 * seed)
        cached = standalone(model, prompt)
        ref = blend_prefill(model, rope, prompt, cached, blend_fraction=1.0).logits
        errors.append([float((blend_prefill(model, rope, prompt, cached, blend_fraction=f).logits - ref).norm())
                       for f in (0.0, 0.3, 1.0)])
    mean = [sum(e[i] for e in errors) / len(errors) for i in range(3)]
    assert mean[0] > mean[1] > mean[2] == 0.0


def test_a_leading_segment_reused_as_it_is_gives_the_full_prefill(setup):
    # nothing comes before it, so its standalone KV is the prompt's: no recompute needed
    loaded, model, rope = setup
    prompt = BlendPrompt.join((), segments=(tokens(50, 7),), suffix=tokens(6, 8))
    want = LLM(loaded=loaded, enable_prefix_caching=False).generate([prompt.token_ids], GREEDY)[0].token_ids
    blended = blend_prefill(model, rope, prompt, standalone(model, prompt), blend_fraction=0.0)
    assert blended.num_recomputed_tokens == 0 and blended.num_reused_tokens == 50
    assert greedy_tokens(model, blended, 8) == want


def test_blending_from_the_segment_store(setup):
    # the store keeps full blocks only: the tails are computed with the prefix and suffix
    loaded, _, rope = setup
    llm = LLM(loaded=loaded, num_kv_blocks=32)
    engine = llm.engine
    store = SegmentStore(engine.kv, engine.kv._pool, engine.runner.cache, engine.kv._tiering)
    prompt = rag_prompt(2)
    for segment in prompt.segments:
        store.put(compute_kv(engine.model, segment))
    cached = [store.get(segment, 0, rope) for segment in prompt.segments]
    assert [c.num_tokens if c else 0 for c in cached] == [32, 32, 48]
    blended = blend_prefill(engine.model, rope, prompt, cached, blend_fraction=1.0)
    assert blended.num_reused_tokens == 112 and blended.num_computed_tokens == 20 + 8 + 1
    want = LLM(loaded=loaded, enable_prefix_caching=False).generate([prompt.token_ids], GREEDY)[0].token_ids
    assert greedy_tokens(engine.model, blended, 8) == want
    engine.check_integrity()


def test_bad_blends_are_refused(setup):
    _, model, rope = setup
    prompt = rag_prompt()
    cached = standalone(model, prompt)
    with pytest.raises(ValueError, match="blend_fraction must be in"):
        blend_prefill(model, rope, prompt, cached, blend_fraction=1.5)
    with pytest.raises(ValueError, match="select_layer must be in"):
        blend_prefill(model, rope, prompt, cached, select_layer=0)
    with pytest.raises(ValueError, match="3 segments"):
        blend_prefill(model, rope, prompt, cached[:2])
    with pytest.raises(ValueError, match="standalone computation"):
        blend_prefill(model, rope, prompt, [cached[1], cached[0], cached[2]])
    with pytest.raises(ValueError, match="standalone computation"):
        blend_prefill(model, rope, prompt, [cached[0].moved_to(3, rope), None, None])


@pytest.mark.parametrize("padding", [0, 5])
def test_selected_rows_attend_through_the_kernel_and_in_groups_as_in_one_masked_call(padding):
    """Rows at gaps (the last at the last key): the CPU kernel's route and the groups of masked
    calls (the route elsewhere) give one masked call's output; rows of padding past the last
    key, filled with garbage, are never read (the cpu backend's ``attend_dense``, blending's call)."""
    from kvserve.attention import cpu, dense
    from kvserve.attention.backends import CpuBackend
    from kvserve.attention.dense import ROWS_PER_CALL
    _attend, _attend_kernel, _attend_groups = CpuBackend().attend_dense, cpu.dense_attention, dense.attend_dense
    gen = torch.Generator().manual_seed(0)
    n, heads, kv_heads, dim = 300, 6, 2, 16
    rows = torch.sort(torch.randperm(n - 1, generator=gen)[:2 * ROWS_PER_CALL + 8]).values
    rows = torch.cat([rows, torch.tensor([n - 1])])
    q = torch.randn(rows.numel(), heads, dim, generator=gen)
    k, v = torch.randn(n, kv_heads, dim, generator=gen), torch.randn(n, kv_heads, dim, generator=gen)
    mask = torch.arange(n)[None, :] <= rows[:, None]
    want = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn_mask=mask, scale=0.25,
        enable_gqa=True)[0].transpose(0, 1)
    k, v = (torch.cat([x, torch.full((padding, kv_heads, dim), 1e4)]) for x in (k, v))
    for attend in (_attend, _attend_kernel, _attend_groups):
        torch.testing.assert_close(attend(q, k, v, rows, 0.25), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("selection", ["deviation", "query", "query-segments"])
def test_a_blend_run_a_layer_at_a_time_is_the_blend_run_whole(setup, selection):
    """``BlendJob.advance`` with a budget of one token-layer: a layer per call, the same
    tensors as ``blend_prefill``, and the rows and keys it computed counted exactly."""
    _, model, rope = setup
    prompt = rag_prompt(5)
    cached = standalone(model, prompt)
    whole = blend_prefill(model, rope, prompt, cached, 0.2, selection=selection, sink_tokens=2)
    job = BlendJob(model, rope, prompt, cached, 0.2, selection=selection, sink_tokens=2)
    calls, stepped = 1, job.advance(1)
    while stepped is None:
        calls, stepped = calls + 1, job.advance(1)
    num_layers, n = model.config.num_layers, len(prompt.token_ids)
    computed = n - whole.num_reused_tokens                       # 20: the text around the documents
    recomputed = whole.num_recomputed_tokens
    if selection == "deviation":     # layer 0 for every token, then the computed and selected
        assert calls == num_layers + 1
        assert job.num_row_layers == n + (num_layers - 1) * (computed + recomputed)
        rows = sorted({*range(11), *range(n - 9, n), *whole.selected.tolist()})     # system, question, selected
        keys = n * (n + 1) // 2 + (num_layers - 1) * sum(p + 1 for p in rows)       # causal: p + 1 keys
        assert job.num_key_layers == keys
        assert job.work == pytest.approx(job.num_row_layers + keys / attention_keys_per_row(model.config))
    else:                            # the question's pass, then the blend's
        assert calls == 2 * num_layers + 1
        assert job.num_row_layers == num_layers * (computed + computed + recomputed)
    assert torch.equal(stepped.logits, whole.logits) and torch.equal(stepped.selected, whole.selected)
    for layer in range(num_layers):
        assert torch.equal(stepped.keys[layer], whole.keys[layer])
        assert torch.equal(stepped.values[layer], whole.values[layer])
    done = BlendJob(model, rope, prompt, cached, 0.2, selection=selection, sink_tokens=2)
    assert done.advance(math.inf) is not None                    # whole in one call
    with pytest.raises(ValueError, match="select_layer must be in"):
        BlendJob(model, rope, prompt, cached, 0.2, select_layer=0)    # checked before any layer runs


def test_narrowing_keeps_2f_then_1_5f_then_f_each_among_the_layer_befores():
    """CacheBlend's gradual filtering on the 4-layer model (select_layer 1): layer 1 keeps the
    deviation selection at 2f, layer 2 the best 1.5f of those by its own deviation, layer 3
    the best f of those; the layers' rows counted exactly."""
    loaded = tiny_model(DEEP)
    model = LlamaModel(loaded.config, loaded.weights, torch.device("cpu"), torch.float32)
    rope = RopeTables(loaded.config)
    prompt = rag_prompt(7)
    cached = standalone(model, prompt)
    f = 0.2
    job = BlendJob(model, rope, prompt, cached, f, selection="narrowing")
    narrowed = job.advance(math.inf)
    wide = blend_prefill(model, rope, prompt, cached, 2 * f)                      # layer 1's choice
    middle = blend_prefill(model, rope, prompt, cached, 1.5 * f, selection="narrowing", select_layer=2)
    lengths = [40, 33, 48]
    counts = {share: [math.ceil(share * n - 1e-9) for n in lengths] for share in (2 * f, 1.5 * f, f)}
    assert narrowed.num_recomputed_tokens == sum(counts[f]) == 8 + 7 + 10
    assert set(narrowed.selected.tolist()) <= set(wide.selected.tolist())
    assert narrowed.selected.tolist() != blend_prefill(model, rope, prompt, cached, f).selected.tolist()
    assert middle.num_recomputed_tokens == sum(counts[1.5 * f])     # 2 layers from layer 2: the tail, ending at 0.3
    n, computed = len(prompt.token_ids), 11 + 9
    assert job.num_row_layers == n + sum(computed + sum(counts[s]) for s in (2 * f, 1.5 * f, f))
    assert narrowing_fractions(0.15, 30) == (0.3, 0.15 * 1.5, 0.15) and narrowing_fractions(0.6, 1) == (0.6,)
    assert narrowing_fractions(0.6, 30)[0] == 1.0


def test_narrowing_with_one_layer_left_is_the_deviation_selection(setup):
    _, model, rope = setup
    prompt = rag_prompt(8)
    cached = standalone(model, prompt)
    last = model.config.num_layers - 1
    a = blend_prefill(model, rope, prompt, cached, 0.2, select_layer=last, selection="narrowing")
    b = blend_prefill(model, rope, prompt, cached, 0.2, select_layer=last)
    assert torch.equal(a.selected, b.selected) and torch.equal(a.logits, b.logits)
    full = blend_prefill(model, rope, prompt, cached, 1.0, selection="narrowing")
    assert full.num_recomputed_tokens == 121                           # fraction 1.0: everything, as full prefill
    torch.testing.assert_close(full.keys[last], compute_kv(model, prompt.token_ids).keys[last], atol=1e-6, rtol=0)


def test_each_layers_segment_peaks_name_the_segment_query_segments_recomputes_at_that_layer():
    """``segment_peaks_by_layer`` (what ``eval-blend-layer`` calibrates from) against the
    selection itself: at every layer of the 4-layer model, the segment with the highest peak
    is the one ``query-segments`` reading that layer recomputes first (whole, at a fraction of
    its size), its first pass stopping at that layer."""
    loaded = tiny_model(DEEP)
    model = LlamaModel(loaded.config, loaded.weights, torch.device("cpu"), torch.float32)
    rope = RopeTables(loaded.config)
    for seed in (3, 9):
        prompt = rag_prompt(seed)
        cached = standalone(model, prompt)
        peaks = segment_peaks_by_layer(model, rope, prompt, cached)
        assert len(peaks) == 4 and all(len(p) == 3 for p in peaks)
        num_reused = sum(length for _, length in prompt.spans)
        for layer, scores in enumerate(peaks):
            best = max(range(3), key=scores.__getitem__)
            fraction = prompt.spans[best][1] / num_reused          # as many tokens as that segment holds
            job = BlendJob(model, rope, prompt, cached, fraction, selection="query-segments", query_layer=layer)
            picked = job.advance(math.inf)
            assert picked is not None
            start, length = prompt.spans[best]
            assert picked.selected.tolist() == list(range(start, start + length))
            # the first pass stops at the layer it reads: layers 0..layer for the text around
            # the segments, then every layer for it and the recomputed segment
            computed = len(prompt.token_ids) - picked.num_reused_tokens
            assert job.num_row_layers == (layer + 1) * computed + 4 * (computed + length)
    with pytest.raises(ValueError, match="standalone KV is needed, whole"):
        segment_peaks_by_layer(model, rope, prompt, [c.head(5) for c in cached])

"""A budgeted request's attention against transformers, masked to exactly what it keeps.

Compaction rewrites a request's blocks, maps positions to slots and masks holes; if any
of that went wrong, a query would see a key it should not, or miss one it should. Here
every query of a streaming request (chunked prefill across several compactions, then
decode with more) is checked against transformers on the same weights, given a 4D mask
that lets position i see only the positions the request's state kept before i's step,
plus i's own step up to i.
"""

from __future__ import annotations

import pytest
import torch
from model.test_llama_vs_hf import TOL, hf_model
from tiny import TINY, random_weights, tiny_model

from kvserve import LLM, SamplingParams


def kept_positions(state, num_computed: int) -> list[int]:
    """Positions the request's cache holds before a step (the same for every layer and head
    under streaming; asserted)."""
    if state is None:
        return list(range(num_computed))
    n = state.num_recorded
    rows = {tuple(state.pos[layer][h, :n][state.valid[layer][:n]].tolist())
            for layer in range(len(state.pos)) for h in range(state.num_kv_heads)}
    assert len(rows) == 1
    return list(rows.pop())


def test_streaming_attends_exactly_to_its_kept_positions():
    weights = random_weights(TINY, seed=3)
    loaded = tiny_model(TINY, seed=3)
    model = hf_model(TINY, weights)
    prompt = [(i * 37) % 128 for i in range(150)]
    llm = LLM(kv_format="native", loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=32, enable_prefix_caching=False)
    engine = llm.engine
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, logprobs=5, prompt_logprobs=5,
                            kv_budget=48, kv_policy="streaming")
    rid = engine.add_request(prompt, params)
    req = engine.tokens.requests[rid]
    visible: dict[int, list[int]] = {}
    evicted = []
    while not req.is_finished:
        state = engine.kv.budgets.get(rid)
        start = req.num_computed_tokens
        kept = kept_positions(state, start)
        engine.step()
        for i in range(start, req.num_computed_tokens):
            visible[i] = kept + list(range(start, i + 1))
        evicted.append(0 if state is None else state.num_evicted)
    # the prefill compacted between its chunks and decode compacted again
    assert max(evicted) > len(prompt) - 48 and len(set(evicted)) > 3
    seq = prompt + req.output_token_ids
    n = len(seq) - 1
    assert sorted(visible) == list(range(n))
    mask = torch.zeros(n, n, dtype=torch.bool)
    for i, cols in visible.items():
        mask[i, cols] = True
    assert int(mask[-1].sum()) <= 48 + 16                 # the last query saw its budget, at most a block more
    with torch.inference_mode():
        logits = model(torch.tensor([seq[:-1]]), attention_mask=mask[None, None]).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    for i, lp in enumerate(req.prompt_logprobs[1:], start=1):
        assert lp.logprob == pytest.approx(ref[i - 1, prompt[i]].item(), abs=TOL)
    for j, lp in enumerate(req.output_logprobs):
        row = ref[len(prompt) - 1 + j]
        assert lp.token_id == int(row.argmax())
        assert lp.logprob == pytest.approx(row.max().item(), abs=TOL)


def test_saliency_is_the_normalized_attention_of_the_probe_queries():
    """The saliency an engine keeps (scored by the torch path in the chunked prefill and by the cpu
    kernel in decode) equals the dense computation from transformers' attention weights: per layer
    and KV head, the weights the probe queries gave each position, summed over the KV head's query
    heads, divided by the number of probes at or after that position."""
    weights = random_weights(TINY, seed=4)
    loaded = tiny_model(TINY, seed=4)
    model = hf_model(TINY, weights)
    model.set_attn_implementation("eager")
    prompt = [(i * 29) % 128 for i in range(100)]
    llm = LLM(loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=32, enable_prefix_caching=False,
              attention_backend="cpu")
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True,
                                                    kv_budget=192, kv_policy="saliency"))
    req = engine.tokens.requests[rid]
    while req.num_output_tokens < 6:
        engine.step()
    state = engine.kv.budgets.get(rid)
    assert state is not None and not state.is_compacted
    n = req.num_computed_tokens
    assert n == 105 and state.num_recorded == n
    # every 16th position, the window of 32 before the prompt's end, then every decode query
    probes = [15, 31, 47, 63, *range(68, 105)]
    assert state.probes == probes
    seq = (prompt + req.output_token_ids)[:n]
    with torch.inference_mode():
        attentions = model(torch.tensor([seq]), output_attentions=True).attentions
    group = TINY.num_heads // TINY.num_kv_heads
    seen_by = torch.tensor([sum(1 for p in probes if p >= j) for j in range(n)], dtype=torch.float32)
    for layer, a in enumerate(attentions):
        a = a[0, :, probes].float()                                       # [heads, probes, n]
        ref = a.view(TINY.num_kv_heads, group, len(probes), n).sum(dim=(1, 2)) / seen_by
        torch.testing.assert_close(state.saliency(layer), ref, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("chunk", [32, 48])
def test_a_zip_prompts_question_is_the_normalized_attention_of_its_last_window(chunk):
    """Precision by saliency ranks a whole prompt again with ``question`` added (kv/budget/precision.py):
    per token, the weights of the probes scored from the step holding the prompt's last window's
    first row (the window, 32 positions, and a stride probe that shared that step), divided by
    how many of those probes could see it, summed over KV heads, averaged over layers. A
    lossless zip format, so the engine's attention is transformers'."""
    weights = random_weights(TINY, seed=4)
    loaded = tiny_model(TINY, seed=4)
    model = hf_model(TINY, weights)
    model.set_attn_implementation("eager")
    prompt = [(i * 29) % 128 for i in range(100)]
    llm = LLM(loaded=loaded, num_kv_blocks=64, max_num_batched_tokens=chunk, enable_prefix_caching=False,
              kv_format="zip:hi=fp32,lo=fp32,salient=0.25")
    engine = llm.engine
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    req = engine.tokens.requests[rid]
    while req.num_computed_tokens < len(prompt):
        engine.step()
    state = engine.kv.budgets.get(rid)
    assert state is not None and state.regraded and state.question is not None
    # steps of 32: [64, 96) holds the window's first row (68): probes 68 ... 99 (79 and 95 among them);
    # steps of 48: [48, 96) does, with the stride probe 63 before 68 (47, before that step, is not counted)
    probes = ([63] if chunk == 48 else []) + list(range(68, 100))
    assert state.probes == [15, 31, 47, 63, *range(68, 100)]
    with torch.inference_mode():
        attentions = model(torch.tensor([prompt]), output_attentions=True).attentions
    group = TINY.num_heads // TINY.num_kv_heads
    seen_by = torch.tensor([max(1, sum(1 for p in probes if p >= j)) for j in range(100)], dtype=torch.float32)
    ref = torch.stack([a[0, :, probes].float().view(TINY.num_kv_heads, group, len(probes), 100).sum(dim=(1, 2))
                       for a in attentions]) / seen_by
    torch.testing.assert_close(state.question, ref.sum(dim=1).mean(dim=0), atol=1e-5, rtol=1e-4)

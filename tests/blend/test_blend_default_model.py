"""Blending on the real default model (SmolLM2-135M-Instruct): chat with documents as
segments, in two orders; a planted fact is still found."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams, SegmentedPrompt

DOC_A = ("The lighthouse keeper on Marrow Island kept a logbook of every passing ship, noting the weather, the "
         "flags they flew and the hour they rounded the point. In the winter of the great storm he wrote that the "
         "sea had risen higher than any keeper before him had recorded, and that the lamp burned all night.")
DOC_B = ("Mina Osk runs the harbour bakery. Her rye loaves sell out before eight each morning, and the fishermen "
         "buy her seed rolls by the dozen before they sail. The code of the bakery's back door is 4817, and only "
         "Mina and her nephew know it. The oven is older than the harbour wall.")
QUESTION = "What is the code of the bakery's back door? Answer with the number."
GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def conversation(first: str, second: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{first}\n\n{second}\n\n{QUESTION}"}]


@pytest.fixture(scope="module")
def llm(default_model):
    return LLM(loaded=default_model, num_kv_blocks=256)


def test_documents_in_either_order_are_reused_and_the_fact_found(default_model, llm):
    full = LLM(loaded=default_model, num_kv_blocks=256, enable_prefix_caching=False)
    for first, second in ((DOC_A, DOC_B), (DOC_B, DOC_A)):
        want = full.chat(conversation(first, second), GREEDY)[0]
        got = llm.chat(conversation(first, second), GREEDY, segments=[first, second], blend_fraction=0.15)[0]
        assert "4817" in want.text and "4817" in got.text
        assert got.num_reused_tokens > 0.9 * (len(llm.tokenizer.encode(DOC_A + DOC_B)) - 32)
    stats = llm.engine.stats().blend
    assert stats.num_blended == 2 and stats.num_declined == 0
    llm.engine.check_integrity()


def test_fraction_one_gives_the_full_prefill_tokens_on_the_real_model(default_model):
    always = LLM(loaded=default_model, num_kv_blocks=256, blend_cost_model=False)
    full = LLM(loaded=default_model, num_kv_blocks=256, enable_prefix_caching=False)
    conv = conversation(DOC_B, DOC_A)
    text = always.tokenizer.apply_chat_template(conv, add_generation_prompt=True)
    prompt = SegmentedPrompt.from_text(text, [DOC_B, DOC_A], blend_fraction=1.0)
    ids = prompt.encode(always.tokenizer)[0]
    got = always.generate([prompt], GREEDY)[0]
    want = full.generate([ids], GREEDY)[0]
    assert got.num_recomputed_tokens == got.num_reused_tokens > 0
    assert got.token_ids == want.token_ids


def test_documents_stored_after_a_preamble_are_the_prompts_own_kv_for_them(default_model):
    """With ``blend_preamble`` a document is stored as the engine computes it after the preamble
    (its blocks read back as ``compute_kv(..., preamble=...)``), under keys of their own that the
    model card (the cluster router's) computes alike; the fact is still found."""
    import torch

    from kvserve.blend.segment import compute_kv
    from kvserve.kv.prefix import segment_block_keys

    system = "<|im_start|>system\nYou are a helpful AI assistant.<|im_end|>\n<|im_start|>user\n"
    llm = LLM(kv_format="native", loaded=default_model, num_kv_blocks=256, blend_preamble=system)
    pre = llm.tokenizer.encode(system)
    got = llm.chat(conversation(DOC_A, DOC_B), GREEDY, segments=[DOC_A, DOC_B], blend_fraction=0.15)[0]
    assert "4817" in got.text and got.num_reused_tokens > 0
    blender = llm.engine.blending.blender
    doc = llm.tokenizer.encode(DOC_B)
    card = llm.engine.model_card
    keys = blender.segments.keys(doc)
    assert keys == card.segment_keys(doc) == segment_block_keys(doc, 16, card.extra_key, pre)
    assert not set(keys) & set(segment_block_keys(doc, 16, card.extra_key))
    stored = blender.segments.get(doc, 0, blender.rope)
    want = compute_kv(blender.model, doc, preamble=pre)
    n = stored.num_tokens
    assert n == len(keys) * 16
    for layer in (0, 17, 29):
        assert torch.equal(stored.values[layer], want.values[layer][:n])
        assert torch.equal(stored.keys[layer], want.keys[layer][:n])
    llm.engine.check_integrity()

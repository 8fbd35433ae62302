"""Speculative decoding on the default model: greedy outputs token for token plain decoding's,
on an input-grounded prompt (repeat a passage) where prompt lookup drafts well."""

from __future__ import annotations

import pytest

from kvserve import LLM, SamplingParams
from kvserve.bench.common import find_text

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


def repeat_prompt(llm: LLM) -> str:
    passage = " ".join(find_text().split()[2000:2120])
    return llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": f"Repeat this text word for word:\n\n{passage}"}], add_generation_prompt=True)


@pytest.mark.parametrize(("kv_format", "backend"), [("native", "cpu"), ("int8", "cpu"), ("kivi2", "cpu"), ("native", "torch")])
def test_greedy_ids_equal_plain_decoding(default_model, kv_format, backend):
    """The torch path sums a drafted chunk's rows in an order that depends on its shape
    (scaled_dot_product_attention's blocking, which also changes with the thread count), so it
    runs the float weights: the file's quantized ones round every product's activations to int8
    and turn a last-bit difference into another token at a near tie (at one thread: token 49,
    0.046 nats apart in plain decoding), and it stores the native KV: under a quantized format a
    last-bit difference moves a value across a rounding step (int8: 1/127 of its row's largest),
    which on an AVX-512 host moved the logits by 0.02 nats by token 51 and flipped a 0.03-nat
    near tie there. The cpu kernel sums each row alike whatever its chunk, in every format."""
    weights = "native" if backend == "torch" else "auto"
    options = {"num_kv_blocks": 64, "kv_format": kv_format, "attention_backend": backend, "weight_format": weights}
    plain = LLM(loaded=default_model, **options)
    spec = LLM(loaded=default_model, speculative_config=NGRAM, **options)
    assert spec.engine.speculator is not None
    spec.engine.speculator.always_draft()       # no timing decides the test
    prompt = repeat_prompt(plain)
    params = SamplingParams(max_tokens=64, temperature=0.0)
    want, got = plain.generate([prompt], params)[0], spec.generate([prompt], params)[0]
    assert got.token_ids == want.token_ids and got.text == want.text
    assert got.num_accepted_tokens > 16 and spec.engine.num_steps < plain.engine.num_steps
    spec.engine.check_integrity()


@pytest.mark.parametrize("method", ["self", "draft"])
def test_model_proposers_give_plain_decodings_ids(default_model, method):
    """``self`` with its default layers left out, ``draft`` with the default model drafting for
    itself (its own cache, so every draft is the target's own token): drafting forced."""
    plain = LLM(loaded=default_model, num_kv_blocks=64)
    spec = LLM(loaded=default_model, num_kv_blocks=64, speculative_config={"method": method},
               draft=default_model if method == "draft" else None)
    assert spec.engine.speculator is not None
    spec.engine.speculator.always_draft()
    prompt = repeat_prompt(plain)
    params = SamplingParams(max_tokens=32, temperature=0.0)
    want, got = plain.generate([prompt], params)[0], spec.generate([prompt], params)[0]
    assert got.token_ids == want.token_ids
    assert got.num_draft_tokens > 0
    if method == "draft":
        assert got.num_accepted_tokens == got.num_draft_tokens
    spec.engine.check_integrity()

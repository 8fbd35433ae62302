"""The engine's output text over a long generation: each step decodes only the new tokens,
and the texts it streams add up to the final text (tiny random model, the default model's
real tokenizer, whose ids 0..127 the tiny model draws)."""

from __future__ import annotations

import dataclasses

from tiny import TINY, tiny_model

from kvserve import LLM, SamplingParams
from kvserve.model.tokenizer import Tokenizer

NUM_TOKENS = 4096
MAX_IDS_PER_STEP = 12    # 3 * (3 held tokens + 1): tests/engine/test_detokenizer.py says why


class CountingTokenizer(Tokenizer):
    """The real tokenizer, counting the ids each decode is given."""

    num_decoded_ids = 0

    def decode(self, ids, skip_special_tokens=True):   # type: ignore[no-untyped-def]
        self.num_decoded_ids += len(ids)
        return super().decode(ids, skip_special_tokens=skip_special_tokens)


def test_a_4096_token_generation_decodes_only_new_tokens_each_step(default_model):
    tokenizer = CountingTokenizer.__new__(CountingTokenizer)
    tokenizer.__dict__.update(Tokenizer.from_json(default_model.tokenizer.to_json()).__dict__)
    config = dataclasses.replace(TINY, max_position_embeddings=NUM_TOKENS + 64)
    loaded = dataclasses.replace(tiny_model(config), tokenizer=tokenizer)
    llm = LLM(loaded=loaded, num_kv_blocks=(NUM_TOKENS + 64) // 16)
    engine = llm.engine
    # a stop string that never occurs: the stop search runs every step too
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0, ignore_eos=True,
                                                       stop=["\x00never"]))
    streamed, texts, per_step = [], [], []
    while engine.has_unfinished:
        before = tokenizer.num_decoded_ids
        (out,) = engine.step()
        per_step.append(tokenizer.num_decoded_ids - before)
        assert out.text.startswith("".join(streamed))      # every text extends the last one
        streamed.append(out.text[len("".join(streamed)):])
        texts.append(out.text)
    assert out.request_id == rid and out.finished and len(out.token_ids) == NUM_TOKENS
    assert "".join(streamed) == out.text == tokenizer.decode(out.token_ids)
    assert max(per_step) <= MAX_IDS_PER_STEP                # not growing with the output
    assert sum(per_step) <= 4 * NUM_TOKENS + len(out.text)  # O(n) in all, a full decode a step is O(n^2)
    engine.check_integrity()

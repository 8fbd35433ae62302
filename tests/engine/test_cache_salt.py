"""Cache salts in the engine: requests share blocks only with requests of the same salt, in the
device pool, the pins and the keys a router computes (tiny random model)."""

from __future__ import annotations

import pytest
from tiny import random_tokens, tiny_model

from kvserve import LLM, CacheControl, PrefixPin, SamplingParams, Segment, SegmentedPrompt
from kvserve.kv.pins import PinNotFoundError

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_salts_partition_the_prefix_cache_and_keep_outputs():
    llm = LLM(loaded=tiny_model(), num_kv_blocks=64)
    prompt = random_tokens(70, 1)
    runs = [(salt, llm.generate([prompt], GREEDY, cache=CacheControl(salt=salt))[0])
            for salt in ("", "a", "b", "a", "")]
    assert [o.num_cached_tokens for _, o in runs] == [0, 0, 0, 64, 64]
    assert len({tuple(o.token_ids) for _, o in runs}) == 1          # salting changes no output
    pool = llm.engine.kv._pool
    keys = {salt: llm.engine.kv.prefix_keys(prompt, salt=salt) for salt in ("", "a", "b")}
    assert not set(keys[""]) & set(keys["a"]) and not set(keys["a"]) & set(keys["b"])
    assert all(pool.lookup(k, tuple(prompt[i * 16:(i + 1) * 16])) is not None
               for ks in keys.values() for i, k in enumerate(ks))
    # a router computes the same keys from the model card
    assert llm.engine.model_card.block_keys(prompt, "a") == keys["a"]
    llm.engine.check_integrity()


def test_pins_are_per_salt():
    llm = LLM(loaded=tiny_model(), num_kv_blocks=64)
    prompt = random_tokens(40, 2)
    llm.generate([prompt], GREEDY, cache=CacheControl(salt="a", pins=(PrefixPin(32, 60.0),)))
    assert [(p.num_tokens, p.salt) for p in llm.engine.kv.list_pins()] == [(32, "a")]
    assert llm.engine.kv.list_pins("b") == [] and llm.engine.kv.unpin_all("b") == []
    with pytest.raises(PinNotFoundError):
        llm.engine.unpin(prompt, 32)                          # the unsalted prefix was never pinned
    assert llm.engine.unpin(prompt, 32, salt="a").salt == "a"


def test_segments_are_stored_per_salt():
    llm = LLM(loaded=tiny_model(), num_kv_blocks=64, blend_cost_model=False)
    doc = random_tokens(40, 3)
    assert llm.cache_segments([doc], salt="a") == 32
    assert llm.cache_segments([doc], salt="a") == 0                # stored already, in salt a
    prompt = SegmentedPrompt([[5, 6], Segment(doc), [7, 8]])
    same = llm.generate([prompt], GREEDY, cache=CacheControl(salt="a"))[0]
    other = llm.generate([prompt], GREEDY, cache=CacheControl(salt="b"))[0]
    stats = llm.engine.stats().blend
    # salt a reused its 2 stored blocks; salt b found nothing of a's: it computed the segment
    # (used whole, 40 tokens) and stored its blocks itself
    assert (same.num_reused_tokens, other.num_reused_tokens, stats.stored_tokens) == (32, 40, 64)
    assert llm.cache_segments([doc], salt="b") == 0 and llm.cache_segments([doc]) == 32
    with pytest.raises(ValueError, match="cache_salt must be a string of at most 256"):
        CacheControl(salt="x" * 257)
    llm.engine.check_integrity()


def test_engines_with_other_secrets_share_no_keys_and_the_same_secret_file_does(tmp_path):
    loaded, prompt = tiny_model(), random_tokens(40, 4)
    a1, a2, b = (LLM(loaded=loaded, num_kv_blocks=16, key_secret_file=str(tmp_path / name)).engine
                 for name in ("a", "a", "b"))
    assert a1.kv.prefix_keys(prompt) == a2.kv.prefix_keys(prompt)
    assert not set(a1.kv.prefix_keys(prompt)) & set(b.kv.prefix_keys(prompt))

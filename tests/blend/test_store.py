"""Segments in the engine's block pool: stored under their keys, shared, evicted to a tier
and brought back, in any KV format."""

from __future__ import annotations

import pytest
import torch
from tiny import random_tokens as tokens

from kvserve import LLM, SamplingParams
from kvserve.blend.rope import RopeTables
from kvserve.blend.segment import compute_kv
from kvserve.blend.store import SegmentStore
from kvserve.kv.tiering import OffloadTiering

FILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)




def test_a_stored_segment_comes_back_moved_and_exact(loaded):
    llm = LLM(kv_format="native", loaded=loaded, num_kv_blocks=16)
    engine = llm.engine
    store, rope = SegmentStore(engine.kv, engine.kv._pool, engine.runner.cache, engine.kv._tiering), RopeTables(engine.model_config)
    segment = tokens(40, 1)                          # 2 full blocks + 8 tokens never stored
    assert store.get(segment, 37, rope) is None
    standalone = compute_kv(engine.model, segment)
    assert store.put(standalone) == 2
    assert store.put(standalone) == 0                # already there
    engine.check_integrity()
    assert engine.kv.stats().num_cached_blocks == 2 and engine.kv.num_free_blocks == 16   # cached, unreferenced
    got = store.get(segment, 37, rope)
    assert got is not None and got.first_position == 37 and got.token_ids == tuple(segment[:32])
    want = standalone.head(32).moved_to(37, rope)
    for layer in range(engine.model_config.num_layers):
        assert torch.equal(got.keys[layer], want.keys[layer])
        assert torch.equal(got.values[layer], want.values[layer])
    engine.check_integrity()
    assert all(b.ref_count == 0 for b in engine.kv._pool.blocks)
    with pytest.raises(ValueError, match="only standalone segments"):
        store.put(standalone.moved_to(5, rope))


def test_segments_share_blocks_with_each_other_never_with_prompts(loaded):
    llm = LLM(kv_format="native", loaded=loaded, num_kv_blocks=16)
    engine = llm.engine
    store = SegmentStore(engine.kv, engine.kv._pool, engine.runner.cache, engine.kv._tiering)
    a = tokens(48, 2)
    b = a[:16] + tokens(32, 3)                       # the same first block, then other text
    assert store.put(compute_kv(engine.model, a)) == 3
    assert store.put(compute_kv(engine.model, b)) == 2       # block 0 is a's
    assert store.num_cached_blocks(a) == 3 and store.num_cached_blocks(b) == 3
    # a prompt made of the same tokens takes no segment block as a prefix hit, and runs
    # beside them in the same pool
    out = llm.generate([a + [1]], FILL)[0]
    assert out.num_cached_tokens == 0
    engine.check_integrity()
    assert engine.kv.stats().num_cached_blocks == 5 + 3 and store.num_cached_blocks(a) == 3
    # a prompt's blocks do not count as the segment's either
    assert store.num_cached_blocks(a[:16] + [5] * 16) == 1


@pytest.mark.parametrize("kv_format", ["int8", "kivi4g8", "k=kivi4g8+had,v=int8"])
def test_a_segment_in_a_compressed_format(loaded, kv_format):
    llm = LLM(loaded=loaded, num_kv_blocks=16, kv_format=kv_format)
    engine = llm.engine
    store, rope = SegmentStore(engine.kv, engine.kv._pool, engine.runner.cache, engine.kv._tiering), RopeTables(engine.model_config)
    segment = tokens(64, 4)
    standalone = compute_kv(engine.model, segment)
    assert store.put(standalone) == 4
    engine.check_integrity()                         # residual rows all given back
    got = store.get(segment, 100, rope)
    assert got is not None and got.num_tokens == 64
    want = standalone.moved_to(100, rope)
    for layer in range(engine.model_config.num_layers):
        for stored, exact in ((got.keys[layer], want.keys[layer]), (got.values[layer], want.values[layer])):
            err = (stored - exact).abs().max() / exact.abs().max()
            assert 0 < err < 0.1, (layer, float(err))
    # what a prompt in this format attends to afterwards is unaffected
    llm.generate([tokens(30, 5)], FILL)
    engine.check_integrity()


def test_an_evicted_segment_is_demoted_and_comes_back_from_the_host_tier(loaded):
    llm = LLM(kv_format="native", loaded=loaded, num_kv_blocks=8, host_cache_gb=1 / 1024)
    engine = llm.engine
    assert isinstance(engine.kv._tiering, OffloadTiering)
    store, rope = SegmentStore(engine.kv, engine.kv._pool, engine.runner.cache, engine.kv._tiering), RopeTables(engine.model_config)
    segment = tokens(40, 6)
    standalone = compute_kv(engine.model, segment)
    store.put(standalone)
    llm.generate([tokens(8 * 16 - 1, 7)], FILL)     # takes every device block
    engine.kv.flush_tiers()
    assert store.num_cached_blocks(segment) == 0
    got = store.get(segment, 200, rope)
    assert got is not None and got.num_tokens == 32
    want = standalone.head(32).moved_to(200, rope)
    assert all(torch.equal(g, w) for g, w in zip(got.keys + got.values, want.keys + want.values))
    assert store.num_cached_blocks(segment) == 2    # cached on the device again
    engine.check_integrity()

"""Segments cached by content, independent of position: keys, RoPE re-rotation, standalone KV."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from tiny import TINY, tiny_model
from tiny import random_tokens as tokens

from kvserve.blend.rope import RopeTables
from kvserve.blend.segment import compute_kv
from kvserve.config import RopeScaling
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix import SEGMENT_ROOT, make_extra_key, segment_block_keys
from kvserve.model.llama import LlamaModel
from kvserve.model.rope import apply_rope, rope_tables

CPU = torch.device("cpu")
LLAMA3 = dataclasses.replace(TINY, rope_theta=500000.0, rope_scaling=RopeScaling(
    factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64))
QWEN = dataclasses.replace(TINY, architecture="qwen2", attention_bias=True, num_kv_heads=1, rope_theta=1e6)
CONFIGS = {"llama": TINY, "llama3-scaled": LLAMA3, "qwen2-bias": QWEN}


def build(config=TINY, dtype=torch.float32) -> LlamaModel:
    loaded = tiny_model(config)
    return LlamaModel(loaded.config, loaded.weights, CPU, dtype)




@pytest.mark.parametrize("name", CONFIGS)
def test_a_standalone_segment_moved_to_37_has_the_first_layers_keys_computed_there(name):
    # Layer 0's keys and values depend on the token and its position alone, so moving a
    # standalone segment must reproduce what the same tokens get after 37 tokens of context.
    model = build(CONFIGS[name])
    rope = RopeTables(model.config)
    context, segment = tokens(37, 1), tokens(45, 2)
    standalone = compute_kv(model, segment)
    in_place = compute_kv(model, context + segment)
    moved = standalone.moved_to(37, rope)
    assert moved.first_position == 37 and moved.token_ids == tuple(segment)
    torch.testing.assert_close(moved.keys[0], in_place.keys[0][37:], atol=1e-5, rtol=0)
    # far from position 0 the stored keys differ a lot: the rotation did the work
    assert (standalone.keys[0] - in_place.keys[0][37:]).abs().max() > 0.1
    # values carry no position: shared as they are, and equal to those computed in place
    assert all(m is s for m, s in zip(moved.values, standalone.values))
    torch.testing.assert_close(moved.values[0], in_place.values[0][37:], atol=1e-6, rtol=0)
    # from layer 1 on the context shows (what blending recomputes)
    assert (moved.keys[1] - in_place.keys[1][37:]).abs().max() > 1e-2


def test_a_segment_without_context_is_the_same_at_any_position_in_every_layer():
    # attention scores depend on relative positions only, so a segment computed alone at
    # 200.. is its standalone KV moved there, in every layer (up to float32 rounding)
    model = build()
    segment = tokens(40, 3)
    at_200 = compute_kv(model, segment, first_position=200)
    moved = compute_kv(model, segment).moved_to(200, RopeTables(model.config))
    for layer in range(model.config.num_layers):
        torch.testing.assert_close(moved.keys[layer], at_200.keys[layer], atol=1e-4, rtol=0)
        torch.testing.assert_close(moved.values[layer], at_200.values[layer], atol=1e-4, rtol=0)


def test_rerotation_matches_rotating_at_the_target_positions():
    rope = RopeTables(TINY)
    cos, sin = rope_tables(TINY)
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(64, 2, TINY.head_dim, generator=g) * 3
    src = torch.randint(0, 512, (64,), generator=g)
    dst = torch.randint(0, 512, (64,), generator=g)

    def at(pos: torch.Tensor) -> torch.Tensor:
        return apply_rope(raw, cos[pos].unsqueeze(1), sin[pos].unsqueeze(1))

    torch.testing.assert_close(rope.rerotate(at(src), src, dst), at(dst), atol=1e-5, rtol=0)
    # there and back again
    torch.testing.assert_close(rope.rerotate(rope.rerotate(at(src), src, dst), dst, src), at(src),
                               atol=1e-5, rtol=0)
    # any dtype in, the same dtype out (computed in float32)
    half = rope.rerotate(at(src).bfloat16(), src, dst)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), at(dst), atol=0.05, rtol=0.02)
    # moving to where it is already copies it exactly
    keys = apply_rope(raw[:10], cos[:10].unsqueeze(1), sin[:10].unsqueeze(1))
    same = rope.move(keys, 0, 0)
    assert torch.equal(same, keys) and same is not keys


def test_rerotation_refuses_positions_outside_the_model():
    rope = RopeTables(TINY)
    keys = torch.zeros(3, 2, TINY.head_dim)
    with pytest.raises(ValueError, match="outside the model's 512"):
        rope.move(keys, 0, 510)
    with pytest.raises(ValueError, match="3 keys need 3 positions"):
        rope.rerotate(keys, torch.arange(2), torch.arange(3))
    with pytest.raises(ValueError, match="outside the model's 512"):
        compute_kv(build(), tokens(10, 0), first_position=505)


def test_segment_keys_are_their_own_chain():
    extra = make_extra_key("tiny-0", "native:torch.float32")
    a, b = tokens(40, 4), tokens(40, 5)
    keys_a = segment_block_keys(a, 16, extra)
    assert len(keys_a) == 2                     # full blocks only; the last 8 tokens have no key
    assert keys_a == segment_block_keys(a, 16, extra)
    # a different segment, a different format or salt: other keys
    assert not set(keys_a) & set(segment_block_keys(b, 16, extra))
    assert not set(keys_a) & set(segment_block_keys(a, 16, make_extra_key("tiny-0", "int8:torch.float32")))
    # the same tokens as a prompt's prefix never share a key with the segment
    pool = BlockPool(8, 16)
    prefix_keys = KVCacheManager(pool, extra).prefix_keys(a)
    assert len(prefix_keys) == 2 and not set(keys_a) & set(prefix_keys)
    # chained: segments that share their first block share its key, and only that one
    keys_ab = segment_block_keys(a[:16] + b[16:], 16, extra)
    assert keys_ab[0] == keys_a[0] and keys_ab[1] != keys_a[1]
    assert len(SEGMENT_ROOT) == 32 and SEGMENT_ROOT != bytes(32)


def test_a_segment_computed_after_a_preamble_is_its_span_of_the_whole_prompt_moved_to_0():
    """``compute_kv(..., preamble=P)``: the tokens' values are those a prompt P + S writes for them,
    their keys those moved from position len(P) to 0, and both differ from S computed alone."""
    model, rope = build(), RopeTables(TINY)
    pre, seg = tokens(7, 1), tokens(20, 2)
    whole = compute_kv(model, pre + seg)
    after = compute_kv(model, seg, preamble=pre, rope=rope)
    alone = compute_kv(model, seg)
    assert after.first_position == 0 and after.token_ids == tuple(seg)
    for layer in range(TINY.num_layers):
        assert torch.equal(after.values[layer], whole.values[layer][7:])
        assert torch.equal(after.keys[layer], rope.move(whole.keys[layer][7:], 7, 0))
        assert not torch.allclose(after.values[layer], alone.values[layer], atol=1e-3) or layer == 0
    assert torch.equal(compute_kv(model, seg, 5, preamble=pre).keys[1], rope.move(whole.keys[1][7:], 7, 5))
    with pytest.raises(ValueError, match="outside the model"):
        compute_kv(model, seg, preamble=tokens(TINY.max_position_embeddings - 10, 3))


def test_segments_stored_after_a_preamble_have_keys_of_their_own():
    extra = make_extra_key("tiny-0", "native:torch.float32")
    a = tokens(40, 4)
    plain, after_p, after_q = (segment_block_keys(a, 16, extra, pre) for pre in ((), (1, 2, 3), (1, 2, 4)))
    assert plain == segment_block_keys(a, 16, extra, ())
    assert after_p == segment_block_keys(a, 16, extra, [1, 2, 3])
    assert not set(plain) & set(after_p) and not set(after_p) & set(after_q)

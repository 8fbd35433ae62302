"""The KV storage protocol: the factory, each storage's write plan and the residual sizing."""

from __future__ import annotations

import re

import pytest
import torch
from tiny import TINY

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.kv.codecs import parse_kv_format
from kvserve.kv.residual import ROWS_FORMULA, ResidualRows, num_residual_rows
from kvserve.kv.storage.factory import make_storage
from kvserve.kv.storage.paged import PagedKVCache
from kvserve.kv.storage.quantized import QuantizedKVCache

CPU = torch.device("cpu")
F32 = torch.float32
SCHED = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4)


def storage(spec: str, num_blocks: int = 8):
    fmt = parse_kv_format(spec, TINY.num_layers, F32, head_dim=TINY.head_dim)
    return make_storage(TINY, fmt, CacheConfig(block_size=4, num_blocks=num_blocks), SCHED, F32, CPU)


def test_the_factory_picks_the_storage_from_the_format():
    native, int8, kivi = storage("native"), storage("int8"), storage("kivi2g8")
    assert isinstance(native, PagedKVCache) and isinstance(int8, QuantizedKVCache)
    assert native.reads_as_written and native.supports_budgets and native.residual.num_rows == 0
    assert not int8.reads_as_written and int8.supports_budgets
    assert int8.residual.num_rows == 0                      # int8 stores every token as it comes
    assert kivi.residual.num_rows == num_residual_rows(4, 4, 32) == 32 // 4 + 2 * 4 + 1
    # rows for KIVI's keys only: its values are stored token by token
    assert [t is None for t in kivi.key_residual + kivi.value_residual] == [False, False, True, True]


def test_native_writes_go_to_slots_and_read_back_as_written():
    cache = storage("native")
    planner = cache.planner()
    planner.add([5, 2], 3, 3)                      # slots 3, 4, 5: block 5 offset 3, block 2 offsets 0, 1
    planner.add([7], 0, 1)
    assert planner.overlay([(1, 2)]) is None
    writes = planner.build()
    assert writes.slots.tolist() == [23, 8, 9, 28] and writes.encode_rows.numel() == 0
    k = torch.randn(4, 2, 16)
    for layer in range(2):
        cache.write(layer, k, -k, writes)
    keys, values = cache.gather(1, torch.tensor([[5, 2]]))
    assert torch.equal(keys[0, 3:6], k[:3]) and torch.equal(values[0, 3:6], -k[:3])


def test_per_token_formats_write_every_token_into_its_block():
    cache = storage("int8")
    planner = cache.planner()
    planner.add([6, 3], 2, 4)            # fills block 6 (slots 2, 3), opens block 3 (slots 4, 5)
    planner.add([1], 0, 4)               # fills block 1
    writes = planner.build()
    assert writes.slots.tolist() == [26, 27, 12, 13, 4, 5, 6, 7] and writes.residual_slots is None
    assert writes.encode_rows.numel() == 0 and planner.overlay([(1, 3)]) is None
    assert planner.open_rows([3, 1]) == [-1, -1]
    x = torch.randn(8, 2, 16)
    for layer in range(2):
        cache.write(layer, x, x, writes)
    keys, _ = cache.gather(0, torch.tensor([[6, 3]]))
    codec = cache.format.layers[0].key
    expected = codec.decode(codec.encode(x[:4].view(1, 4, 2, 16)), F32)[0]
    assert torch.equal(keys[0, 2:6], expected)              # open or full, each token as int8 stores it
    assert (keys[0, 2:6] - x[:4]).abs().max() < 0.05


def test_whole_block_halves_go_through_residual_rows_and_open_blocks_are_overlaid():
    cache = storage("kivi2g8")
    planner = cache.planner()
    planner.add([6, 3], 2, 4)            # fills block 6 (slots 2, 3), opens block 3 (slots 4, 5)
    planner.add([1], 0, 4)               # fills block 1
    writes = planner.build()
    rows = {b: cache.residual.assign(b) for b in (6, 3, 1)}   # the rows the planner took
    assert rows == {6: 0, 3: 1, 1: 2} and cache.residual.num_free_rows == cache.residual.num_rows - 3
    assert writes.slots.tolist() == [26, 27, 12, 13, 4, 5, 6, 7]
    assert writes.residual_slots is not None and writes.residual_slots.tolist() == [2, 3, 4, 5, 8, 9, 10, 11]
    assert writes.encode_rows.tolist() == [0, 2] and writes.encode_block_ids.tolist() == [6, 1]
    overlay = planner.overlay([(1, 3), (3, 1)])             # only block 3 is open
    assert overlay is not None and overlay.positions.tolist() == [1] and overlay.rows.tolist() == [1]
    assert planner.open_rows([3, 1]) == [1, -1]
    x = torch.randn(8, 2, 16)
    for layer in range(2):
        cache.write(layer, x, x, writes)
    keys, values = cache.gather(0, torch.tensor([[6, 3]]), overlay)
    assert torch.equal(keys[0, 4:6], x[2:4])                 # the open block's keys, from their row, exactly
    assert not torch.equal(keys[0, 2:4], x[:2])              # the full block, through KIVI
    assert not torch.equal(values[0, 4:6], x[2:4])           # values are stored per token, open or not
    cache.finish_step(writes)                                # encoded blocks give their rows back
    assert cache.residual.num_free_rows == cache.residual.num_rows - 1
    cache.residual.release([3])
    cache.residual.check_integrity()


def test_residual_sizing_error_quotes_the_formula_used():
    assert ROWS_FORMULA == "max_num_batched_tokens // block_size + 2 * max_num_seqs + 1"
    assert num_residual_rows(16, 32, 512) == 512 // 16 + 2 * 32 + 1
    rows = ResidualRows(1)
    rows.assign(4)
    with pytest.raises(RuntimeError, match=re.escape(f"(rows = {ROWS_FORMULA})")):
        rows.assign(5)


def test_quantized_storage_that_does_not_fit_says_what_to_lower():
    fmt = parse_kv_format("kivi2g8", TINY.num_layers, F32, head_dim=TINY.head_dim)
    with pytest.raises(ValueError, match="keeps 17 full-precision residual rows .* lower max_num_seqs"):
        make_storage(TINY, fmt, CacheConfig(block_size=4, memory_bytes=1000), SCHED, F32, CPU)
    # a row is a block of the keys of both layers: 2 x 4 tokens x 2 heads x 16 x 4 bytes
    assert QuantizedKVCache.residual_row_nbytes(TINY, fmt, 4, F32) == 2 * 4 * 2 * 16 * 4
    int8 = parse_kv_format("int8", TINY.num_layers, F32, head_dim=TINY.head_dim)
    assert make_storage(TINY, int8, CacheConfig(block_size=4, memory_bytes=1000), SCHED, F32, CPU).num_blocks == 1


def test_swapping_blocks_returns_what_they_held_and_stores_the_new():
    """``swap_blocks`` (ArkVale's recalls, one read and one write) as block-by-block reads and
    writes do, and the keys alone of a gather (``gather_keys``) as the gather's."""
    from kvserve.kv.storage.base import KVStorage

    cache = storage("native")
    g = torch.Generator().manual_seed(0)
    for layer in range(2):
        for t in (cache.key_caches[layer], cache.value_caches[layer]):
            t.copy_(torch.randn(t.shape, generator=g))
    before = [cache.read_block(1, b) for b in (6, 1)]
    before = [(k.clone(), v.clone()) for k, v in before]
    new_k, new_v = torch.randn(2, 4, 2, 16, generator=g), torch.randn(2, 4, 2, 16, generator=g)
    other = storage("native")
    for layer in range(2):
        other.key_caches[layer].copy_(cache.key_caches[layer])
        other.value_caches[layer].copy_(cache.value_caches[layer])
    old_k, old_v = cache.swap_blocks(1, torch.tensor([6, 1]), new_k, new_v)
    ref_k, ref_v = KVStorage.swap_blocks(other, 1, torch.tensor([6, 1]), new_k, new_v)   # the block-by-block default
    assert torch.equal(old_k, ref_k) and torch.equal(old_v, ref_v)
    assert torch.equal(old_k[0], before[0][0]) and torch.equal(old_v[1], before[1][1])
    assert torch.equal(cache.read_block(1, 6)[0], new_k[0]) and torch.equal(cache.read_block(1, 1)[1], new_v[1])
    assert torch.equal(cache.key_caches[1], other.key_caches[1]) and torch.equal(cache.key_caches[0], other.key_caches[0])
    table = torch.tensor([[3, 6, 1]])
    assert torch.equal(cache.gather_keys(1, table), cache.gather(1, table)[0])


def test_quantized_rewrites_encode_closed_blocks_again_and_write_open_ones_into_their_rows():
    """A budget's rewrite (``write_slots``) under KIVI: entries of a closed block are laid over its
    decoded tokens and the block encoded again; a block ``reopen``-ed takes its entries in its row,
    read back exactly between steps (``open_overlay``); values, stored token by token, are each
    encoded into their slot."""
    cache = storage("kivi2g8")
    planner = cache.planner()
    planner.add([6, 1], 0, 8)            # fills blocks 6 and 1
    writes = planner.build()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 2, 16, generator=g)
    cache.write(0, x, x, writes)
    cache.finish_step(writes)
    assert cache.residual.num_free_rows == cache.residual.num_rows
    codec, vcodec = cache.format.layers[0].key, cache.format.layers[0].value
    before, _ = cache.gather(0, torch.tensor([[6, 1]]))
    new = torch.randn(4, 2, 16, generator=g)
    cache.reopen(3)
    # block 6 slots 1, 2 (closed); block 3 slots 0, 1 (open again)
    cache.write_slots(0, new, new, torch.tensor([25, 26, 12, 13]))
    assert cache.residual.row_of(3) is not None and cache.residual.row_of(6) is None
    assert cache.open_overlay([6, 1]) is None
    overlay = cache.open_overlay([6, 3])
    assert overlay is not None and overlay.positions.tolist() == [1]
    keys, values = cache.gather(0, torch.tensor([[6, 3, 1]]), overlay)
    expected = before[0, :4].clone()
    expected[1:3] = new[:2]
    assert torch.equal(keys[0, :4], codec.decode(codec.encode(expected.unsqueeze(0)), F32)[0])
    assert torch.equal(keys[0, 4:6], new[2:])                # exactly, from the row
    assert torch.equal(keys[0, 8:], before[0, 4:])           # block 1: untouched
    per_token = vcodec.decode(vcodec.encode(new.unsqueeze(1)), F32)[:, 0]
    assert torch.equal(values[0, 1:3], per_token[:2]) and torch.equal(values[0, 4:6], per_token[2:])
    cache.residual.release([3])
    cache.residual.check_integrity()


def test_quantized_blocks_are_stashed_as_their_bytes_and_come_back_exactly():
    """ArkVale's moves under a quantized format: ``stored_blocks`` gives each block's parts as
    bytes (one row of ``stash_nbytes`` per half: KIVI-2 keys of 4 tokens x 2 heads x 16 are 32
    bytes of codes + 128 of float16 scales and zeros per channel; values 32 + 64, padded to 160),
    and ``swap_blocks`` puts such rows into other blocks, returning theirs: the blocks decode
    there exactly as they did where they were."""
    cache, other = storage("kivi2g8"), storage("kivi2g8")
    g = torch.Generator().manual_seed(0)
    for c in (cache, other):
        planner = c.planner()
        planner.add([6, 1, 2, 5], 0, 16)
        writes = planner.build()
        for layer in range(2):
            x = torch.randn(16, 2, 16, generator=g)
            c.write(layer, x, -x, writes)
        c.finish_step(writes)
    assert cache.stash_nbytes == 160
    k_bytes, v_bytes = cache.stored_blocks(1, torch.tensor([6, 1]))
    assert k_bytes.shape == v_bytes.shape == (2, 160) and k_bytes.dtype == torch.uint8
    assert not v_bytes[:, 96:].any()                           # the values' padding
    moved = cache.gather(1, torch.tensor([[6, 1]]))
    held = other.gather(1, torch.tensor([[2, 5]]))
    held_bytes = other.stored_blocks(1, torch.tensor([2, 5]))
    out = other.swap_blocks(1, torch.tensor([2, 5]), k_bytes, v_bytes)
    assert torch.equal(out[0], held_bytes[0]) and torch.equal(out[1], held_bytes[1])
    there = other.gather(1, torch.tensor([[2, 5]]))
    assert torch.equal(there[0], moved[0]) and torch.equal(there[1], moved[1])
    other.swap_blocks(1, torch.tensor([2, 5]), *out)           # and back
    back = other.gather(1, torch.tensor([[2, 5]]))
    assert torch.equal(back[0], held[0]) and torch.equal(back[1], held[1])

"""Precision by saliency (``zip:``): the spec, the side pool, the storage's reads and writes
(tiny model: head_dim 16, block size 4). The engine under it: tests/engine/test_zip_engine.py."""

from __future__ import annotations

import pytest
import torch
from tiny import TINY

from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.kv.codecs import parse_kv_format
from kvserve.kv.residual import num_residual_rows
from kvserve.kv.storage.factory import make_storage
from kvserve.kv.storage.zip import RefinedBlocks, ZipKVCache

CPU = torch.device("cpu")
F32 = torch.float32
SCHED = SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4)
SPEC = "zip:hi=int8,lo=kivi2g8,salient=0.25"


def zip_storage(num_blocks: int = 8, spec: str = SPEC) -> ZipKVCache:
    fmt = parse_kv_format(spec, TINY.num_layers, F32, head_dim=TINY.head_dim)
    cache = make_storage(TINY, fmt, CacheConfig(block_size=4, num_blocks=num_blocks), SCHED, F32, CPU)
    assert isinstance(cache, ZipKVCache)
    return cache


def test_the_spec_is_canonical_and_its_bytes_are_base_plus_the_salient_share():
    fmt = parse_kv_format("ZIP: lo=kivi2, hi=int8", 30, F32, head_dim=64)
    assert fmt.spec == "zip:hi=int8,lo=kivi2g32,salient=0.2"
    assert parse_kv_format(fmt.spec, 30, F32).spec == fmt.spec and not fmt.is_lossless
    # SmolLM2's shape: kivi2 80,640 bytes a block of 16, int8 190,080; 0.2 of the latter is 38,016
    assert fmt.nbytes_per_block(16, 3, 64) == 80_640 + 38_016 and fmt.refined_nbytes_per_block(16, 3, 64) == 190_080
    per_layer = parse_kv_format("zip:hi=0-1=fp16;2-=int8,lo=k=kivi2,v=int2g64,salient=0.1", 30, F32)
    assert per_layer.spec == "zip:hi=0-1=fp16;2-29=int8,lo=kivi2g64,salient=0.1"   # KIVI merged
    assert parse_kv_format("zip:hi=native,lo=native", 2, F32).spec == "zip:hi=fp32,lo=fp32,salient=0.2"


@pytest.mark.parametrize("spec, message", [
    ("zip:hi=int8", "needs both hi= and lo="),
    ("zip:hi=int8,lo=kivi2,salient=1", r"salient must be a fraction of the blocks in \(0, 1\)"),
    ("zip:hi=int8,lo=kivi2,salient=x", "salient='x' is not a number"),
    ("zip:hi=int8,hi=int4,lo=kivi2", "bad zip format"),
    ("zip:hi=zip:hi=int8,lo=int8,lo=int8", "bad zip format"),
    ("zip:hi=int9,lo=kivi2", "unknown KV format 'int9'"),
])
def test_bad_zip_specs_say_what_is_wrong(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_kv_format(spec, 30, F32)


def test_side_slots_are_handed_out_until_none_is_free_and_dropped_by_block():
    refined = RefinedBlocks(num_blocks=6, num_slots=2, device=CPU)
    assert [refined.assign(b) for b in (4, 1, 4, 5)] == [0, 1, 0, None]     # a block keeps its slot
    assert refined.side_map.tolist() == [-1, 1, -1, -1, 0, -1] and refined.num_free_slots == 0
    assert refined.drop([5, 4, 2]) == [4]
    assert refined.assign(5) == 0 and refined.block_ids == [1, 5]
    refined.check_integrity()


def test_a_zip_storage_sizes_its_side_pool_from_the_memory():
    fmt = parse_kv_format(SPEC, TINY.num_layers, F32, head_dim=TINY.head_dim)
    rows = num_residual_rows(4, 4, 32)
    row_nbytes = 2 * 2 * 4 * 2 * 16 * 4               # both halves of both layers keep rows, fp32
    hi_nbytes = fmt.refined_nbytes_per_block(4, 2, 16)
    memory = rows * (row_nbytes + hi_nbytes) + 100 * fmt.nbytes_per_block(4, 2, 16) + 7
    cache = make_storage(TINY, fmt, CacheConfig(block_size=4, memory_bytes=memory), SCHED, F32, CPU)
    assert isinstance(cache, ZipKVCache)
    assert cache.num_blocks == 100 and cache.refined.num_slots == 25 + rows
    assert cache.nbytes <= memory + cache.num_blocks * 8             # and the side map, 8 bytes a block
    with pytest.raises(ValueError, match="side slots for the blocks a step fills"):
        make_storage(TINY, fmt, CacheConfig(block_size=4, memory_bytes=rows * row_nbytes), SCHED, F32, CPU)


def _reference(spec: str, rows: torch.Tensor) -> torch.Tensor:
    """``rows`` [n, 4, heads, dim] encoded and decoded by the keys' codec of layer 0 of ``spec``."""
    codec = parse_kv_format(spec, TINY.num_layers, F32, head_dim=TINY.head_dim).layers[0].key
    return codec.decode(codec.encode(rows), F32)


def test_full_blocks_are_read_from_the_finer_copy_until_it_is_dropped():
    cache = zip_storage(num_blocks=8)
    k = torch.randn(10, 2, 16)
    planner = cache.planner()
    planner.add([6, 3, 5], 0, 10)            # fills blocks 6 and 3, leaves block 5 open (2 tokens)
    overlay = planner.overlay([(2, 5)])
    writes = planner.build()
    assert writes.encode_block_ids.tolist() == [6, 3] and writes.refine_slots is not None
    assert writes.refine_slots.tolist() == [0, 1] and cache.refined.block_ids == [3, 6]
    assert writes.refine_rows is not None and writes.refine_rows.tolist() == writes.encode_rows.tolist()
    for layer in range(2):
        cache.write(layer, k, -k, writes)
    keys, values = cache.gather(1, torch.tensor([[6, 3, 5]]), overlay)
    full = k[:8].view(2, 4, 2, 16)
    assert torch.equal(keys[0, :8].view(2, 4, 2, 16), _reference("int8", full))
    assert torch.equal(values[0, :8].view(2, 4, 2, 16), _reference("int8", -full))
    assert torch.equal(keys[0, 8:10], k[8:10])                        # the open block, from its row
    cache.finish_step(writes)
    assert cache.refined.drop([3]) == [3]
    keys, _ = cache.gather(1, torch.tensor([[6, 3]]))
    assert torch.equal(keys[0, 4:8].view(1, 4, 2, 16), _reference("kivi2g8", full[1:]))
    assert torch.equal(keys[0, :4].view(1, 4, 2, 16), _reference("int8", full[:1]))
    cache.residual.check_integrity()


def test_a_block_written_again_from_its_first_slot_loses_its_finer_copy():
    cache = zip_storage(num_blocks=4, spec="zip:hi=int8,lo=kivi2g8,salient=0.25")
    planner = cache.planner()
    planner.add([2], 0, 4)
    writes = planner.build()
    for layer in range(2):
        cache.write(layer, torch.randn(4, 2, 16), torch.randn(4, 2, 16), writes)
    cache.finish_step(writes)
    assert cache.refined.block_ids == [2]
    planner = cache.planner()
    planner.add([2], 0, 3)                   # new content, left open: no finer copy of the old one
    assert cache.refined.block_ids == []
    cache.residual.renew([2])                # (and the KV manager's hand-out drops it too)
    cache.finish_step(planner.build())


def test_the_side_pool_runs_out_before_the_blocks_do():
    cache = zip_storage(num_blocks=8)
    num_slots = cache.refined.num_slots                             # 2 + 17 rows' worth
    planner = cache.planner()
    planner.add(list(range(8)), 0, 32)
    writes = planner.build()
    assert writes.refine_slots is not None and writes.refine_slots.tolist() == list(range(8))
    cache.refined.drop(range(8))
    assert cache.refined.num_free_slots == num_slots == int(0.25 * 8) + num_residual_rows(4, 4, 32)


def test_the_probe_observer_scores_as_the_saliency_budgets_state():
    from kvserve.kv.budget.policies import get_policy
    from kvserve.kv.budget.precision import ProbeObserver
    from kvserve.kv.budget.state import BudgetState

    observer = ProbeObserver(2, 2, 4, CPU)
    state = BudgetState(get_policy("saliency"), 64, [64, 64], 2, 4, CPU)
    g = torch.Generator().manual_seed(0)
    # a prefix hit of 8 slots, a chunk of 9, then three decode steps; probes as the engine picks them
    for start, n, probes in ((8, 9, (3, 7, 8)), (17, 1, (0,)), (18, 1, ()), (19, 1, (0,))):
        for s in (observer, state):
            s.prepare(start, start, n)
            s.record_probes(start, probes)
        for layer in range(2):
            scores = torch.rand(2, start + n, generator=g)
            observer.add_scores(layer, scores)
            state.add_scores(layer, scores)
    every = observer.saliency_of_layers(20)
    assert every.shape == (2, 2, 20)
    for layer in range(2):
        assert torch.allclose(observer.saliency(layer), state.saliency(layer), rtol=0, atol=1e-7)
        assert torch.equal(every[layer], observer.saliency(layer))      # all layers at once: the same


@pytest.mark.parametrize("spec, mixes", [
    (SPEC, False), ("zip:hi=int8,lo=kivi2g8+had", True), ("zip:hi=int8+had,lo=kivi2g8+had", False),
    ("zip:hi=int8+had,lo=kivi2g8", True), ("zip:hi=int4g8+had+out2,lo=kivi2g8", False),   # +outN: not rotated
    ("zip:hi=0=int8;1=int8+had,lo=int8", True),
])
def test_a_storage_says_whether_its_formats_mix_rotation_domains(spec, mixes):
    assert zip_storage(spec=spec).mixes_rotation_domains is mixes


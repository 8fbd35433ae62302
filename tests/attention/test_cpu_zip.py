"""The C++ kernel over mixed-precision blocks (``zip:`` KV formats, kv/storage/zip.py): each block
read in place from its finer copy where it has one, else from its base format, against
attention over what the storage's ``gather`` (the torch path) reads."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from attention.cases import dense_attention, zip_case
from tiny import TINY

from kvserve.attention import cpu
from kvserve.attention.backends import CpuBackend
from kvserve.attention.cpu_writes import CpuWrites
from kvserve.config import CacheConfig, SchedulerConfig
from kvserve.kv.codecs import parse_kv_format
from kvserve.kv.storage.factory import make_storage
from kvserve.kv.storage.layout import PagedBatch
from kvserve.kv.storage.zip import ZipKVCache

pytestmark = pytest.mark.skipif(not cpu.is_available(), reason="the C++ kernel is not built here")

SPECS = [
    "zip:hi=int8,lo=kivi2g8,salient=0.5",
    "zip:hi=int8,lo=kivi2g8+had,salient=0.5",        # the finer copy in the other rotation domain
    "zip:hi=int8+had,lo=int4g8,salient=0.5",
    "zip:hi=fp16,lo=int2g8+had,salient=0.5",
    "zip:hi=int4g8+out2+had,lo=kivi4g8,salient=0.5",  # a finer format that encodes whole blocks
]
INT = torch.int32


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("spec", SPECS)
def test_the_kernel_reads_each_block_in_the_precision_it_holds(spec: str, head_dim: int) -> None:
    case = zip_case(spec, head_dim, 4, "cpu", seed=1, drop=[2, 5, 0, 4])  # some blocks of each sequence lose their copy
    storage, fmt, k = case.storage, case.fmt, case.keys
    num_queries = [1, 3, 5]
    batch, starts = case.batch(num_queries)
    q = torch.randn(starts[-1], 4, head_dim, generator=torch.Generator().manual_seed(2))
    scale = head_dim ** -0.5
    backend = CpuBackend()
    for layer in range(TINY.num_layers):
        got = backend.attend(q, *storage.half_stores(layer), batch, scale)
        keys, values = storage.gather(layer, batch.block_tables.long(), case.overlay)
        for s, length in enumerate(case.lens):
            ref = dense_attention(q[starts[s]:starts[s + 1]], keys[s], values[s], length, scale)
            assert torch.allclose(got[starts[s]:starts[s + 1]].double(), ref, atol=2e-5, rtol=1e-5), (spec, layer, s)
    # the gather itself: refined blocks decode from the finer format, the rest from the base one
    keys, _ = storage.gather(0, torch.tensor([[7, 2]]))
    lo = fmt.layers[0].key
    assert fmt.refine is not None
    hi = fmt.refine.layers[0].key
    first = k[:8].view(2, 4, 2, head_dim)
    assert torch.equal(keys[0, :4], hi.decode(hi.encode(first[:1]), torch.float32)[0])
    assert torch.equal(keys[0, 4:8], lo.decode(lo.encode(first[1:]), torch.float32)[0])


def test_unregistered_calls_refuse_mixed_blocks() -> None:
    """(The Triton kernels read them: tests/attention/test_triton.py.)"""
    fmt = parse_kv_format(SPECS[0], TINY.num_layers, torch.float32, head_dim=16)
    storage = make_storage(TINY, fmt, CacheConfig(block_size=4, num_blocks=8),
                           SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2), torch.float32,
                           torch.device("cpu"))
    batch = PagedBatch(torch.zeros(1, 1, dtype=INT), torch.ones(1, dtype=INT), torch.tensor([0, 1], dtype=INT),
                       torch.full((1,), -1, dtype=INT), 4, 1, 1)
    with pytest.raises(ValueError, match="read through registered halves"):
        cpu.paged_attention(torch.zeros(1, 4, 16), *storage.half_stores(0), batch, 0.25)


def _zip_storage(spec: str, *, cpu_writes: bool) -> ZipKVCache:
    config = replace(TINY, num_kv_heads=3, num_heads=3, head_dim=64)
    fmt = parse_kv_format(spec, config.num_layers, torch.float32, head_dim=64)
    # 6 side slots for 32 blocks: the pool runs out on the way (sized by build, it never does in a step)
    storage = ZipKVCache(config, 32, 16, fmt, 40, torch.float32, torch.device("cpu"), num_side_slots=6,
                         make_writer=CpuWrites.for_storage if cpu_writes else None)
    assert (storage._writer is not None) == cpu_writes
    return storage


@pytest.mark.parametrize("spec", SPECS)
def test_the_cpu_writer_stores_the_torch_paths_bytes_in_both_formats(spec: str) -> None:
    # (sequence, new tokens) per step: prompts ending mid-block and on a boundary, decodes,
    # a chunk long enough for the threaded path; side slots run out on the way
    steps = [[("a", 37), ("b", 16)], [("a", 1), ("b", 1), ("c", 20)], [("a", 12), ("c", 300)],
             [("a", 1), ("b", 15), ("c", 1)]]
    spec = spec.replace("g8", "g32").replace("salient=0.5", "salient=0.25")
    reference, tested = _zip_storage(spec, cpu_writes=False), _zip_storage(spec, cpu_writes=True)
    g = torch.Generator().manual_seed(0)
    tables: dict[str, list[int]] = {}
    lens: dict[str, int] = {}
    free = list(range(32))
    for step in steps:
        planners = [s.planner() for s in (reference, tested)]
        for name, n in step:
            table, start = tables.setdefault(name, []), lens.get(name, 0)
            while len(table) * 16 < start + n:
                table.append(free.pop())
            for p in planners:
                p.add(table, start, n)
            lens[name] = start + n
        writes = [p.build() for p in planners]
        for layer in range(2):
            k = torch.randn(writes[0].slots.numel(), 3, 64, generator=g)
            v = torch.randn(writes[0].slots.numel(), 3, 64, generator=g)
            for storage, w in zip((reference, tested), writes):
                storage.write(layer, k, v, w)
        for storage, w in zip((reference, tested), writes):
            storage.finish_step(w)
        assert reference.refined.block_ids == tested.refined.block_ids
        for layer in range(2):
            for ref, new in zip(reference.half_stores(layer), tested.half_stores(layer)):
                assert ref.refined is not None and new.refined is not None
                for mine, theirs in ((ref.parts, new.parts), (ref.refined.parts, new.refined.parts)):
                    for name, t in mine.items():
                        assert torch.equal(t.view(torch.uint8), theirs[name].view(torch.uint8)), (spec, layer, name)
                assert ref.residual is not None and new.residual is not None and torch.equal(ref.residual, new.residual)
    assert reference.refined.num_free_slots == 0          # the side pool ran out: later blocks got no copy

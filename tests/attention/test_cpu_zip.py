"""The C++ kernel over mixed-precision blocks (``zip:`` KV formats, kv/storage/zip.py): each block
read in place from its finer copy where it has one, else from its base format, against
attention over what the storage's ``gather`` (the torch path) reads."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from tiny import TINY

from kvserve.attention import cpu
from kvserve.attention.backends import CpuBackend
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


def _reference(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int, scale: float) -> torch.Tensor:
    """q [n, Hq, D] (the last n positions of ``length``) over keys/values [L, H, D]: float64 attention."""
    n, hq, _ = q.shape
    group = hq // keys.shape[1]
    k = keys[:length].double().repeat_interleave(group, dim=1)
    v = values[:length].double().repeat_interleave(group, dim=1)
    logits = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    causal = torch.arange(length)[None, :] <= torch.arange(length - n, length)[:, None]
    return torch.einsum("hnl,lhd->nhd", logits.masked_fill(~causal, float("-inf")).softmax(dim=-1), v)


@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("spec", SPECS)
def test_the_kernel_reads_each_block_in_the_precision_it_holds(spec: str, head_dim: int) -> None:
    config = replace(TINY, head_dim=head_dim)
    fmt = parse_kv_format(spec, config.num_layers, torch.float32, head_dim=head_dim)
    storage = make_storage(config, fmt, CacheConfig(block_size=4, num_blocks=16),
                           SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), torch.float32,
                           torch.device("cpu"))
    assert isinstance(storage, ZipKVCache)
    g = torch.Generator().manual_seed(1)
    tables, lens, num_queries = [[7, 2, 9, 4, 11], [3, 5], [12, 0, 6]], [18, 8, 11], [1, 3, 5]
    planner = storage.planner()
    for table, length in zip(tables, lens):
        planner.add(table, 0, length)
    last = [(i * 5 + (length - 1) // 4, table[(length - 1) // 4]) for i, (table, length) in enumerate(zip(tables, lens))]
    overlay = planner.overlay(last)
    open_rows = planner.open_rows([b for _, b in last])
    writes = planner.build()
    num_tokens = sum(lens)
    k = torch.randn(num_tokens, 2, head_dim, generator=g) * 2
    v = torch.randn(num_tokens, 2, head_dim, generator=g)
    for layer in range(config.num_layers):
        storage.write(layer, k, v, writes)
    assert storage.refined.block_ids == sorted(b for t, n in zip(tables, lens) for b in t[:n // 4])
    storage.refined.drop([2, 5, 0, 4])                  # some blocks of each sequence lose their finer copy
    table = torch.tensor([t + [0] * (5 - len(t)) for t in tables], dtype=INT)
    starts = [0]
    for n in num_queries:
        starts.append(starts[-1] + n)
    batch = PagedBatch(table, torch.tensor(lens, dtype=INT), torch.tensor(starts, dtype=INT),
                       torch.tensor(open_rows, dtype=INT), 4, max(num_queries), max(lens))
    q = torch.randn(starts[-1], 4, head_dim, generator=g)
    scale = head_dim ** -0.5
    backend = CpuBackend()
    for layer in range(config.num_layers):
        got = backend.attend(q, *storage.half_stores(layer), batch, scale)
        keys, values = storage.gather(layer, table.long(), overlay)
        for s, (length, n) in enumerate(zip(lens, num_queries)):
            ref = _reference(q[starts[s]:starts[s + 1]], keys[s], values[s], length, scale)
            assert torch.allclose(got[starts[s]:starts[s + 1]].double(), ref, atol=2e-5, rtol=1e-5), (spec, layer, s)
    # the gather itself: refined blocks decode from the finer format, the rest from the base one
    keys, _ = storage.gather(0, torch.tensor([[7, 2]]))
    lo = fmt.layers[0].key
    assert fmt.refine is not None
    hi = fmt.refine.layers[0].key
    first = k[:8].view(2, 4, 2, head_dim)
    assert torch.equal(keys[0, :4], hi.decode(hi.encode(first[:1]), torch.float32)[0])
    assert torch.equal(keys[0, 4:8], lo.decode(lo.encode(first[1:]), torch.float32)[0])


def test_unregistered_calls_and_the_triton_kernels_refuse_mixed_blocks() -> None:
    fmt = parse_kv_format(SPECS[0], TINY.num_layers, torch.float32, head_dim=16)
    storage = make_storage(TINY, fmt, CacheConfig(block_size=4, num_blocks=8),
                           SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=2), torch.float32,
                           torch.device("cpu"))
    batch = PagedBatch(torch.zeros(1, 1, dtype=INT), torch.ones(1, dtype=INT), torch.tensor([0, 1], dtype=INT),
                       torch.full((1,), -1, dtype=INT), 4, 1, 1)
    with pytest.raises(ValueError, match="read through registered halves"):
        cpu.paged_attention(torch.zeros(1, 4, 16), *storage.half_stores(0), batch, 0.25)
    from kvserve.attention import triton_kernels
    if triton_kernels.triton_jit is not None:
        with pytest.raises(ValueError, match="do not read mixed-precision blocks"):
            triton_kernels.paged_attention(torch.zeros(1, 4, 16), *storage.half_stores(0), batch, 0.25)

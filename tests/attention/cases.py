"""Random paged caches in any KV format, for testing attention kernels against the reference.

A case stores each sequence's keys and values block by block through the codecs, in
shuffled block ids, with garbage wherever a kernel must not read: the unused tail of an
open block, blocks no table names, and the encoded parts of an open block whose half keeps
a residual row (its real entries are in the row).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

import torch

from kvserve.attention.reference import reference_attention
from kvserve.kv.codecs import HalfCodec, KVFormat, parse_codec
from kvserve.kv.storage import Overlay
from kvserve.kv.storage.layout import HalfLayout, HalfStore, PagedBatch
from kvserve.kv.storage.zip import ZipKVCache


@dataclass(frozen=True)
class Case:
    q: torch.Tensor
    key_codec: HalfCodec
    key: HalfStore
    value_codec: HalfCodec
    value: HalfStore
    batch: PagedBatch
    scale: float
    raw_keys: tuple[torch.Tensor, ...] = ()     # each sequence's keys and values before storing
    raw_values: tuple[torch.Tensor, ...] = ()

    def reference(self) -> torch.Tensor:
        return reference_attention(self.q, self.key_codec, self.key, self.value_codec, self.value, self.batch,
                                   self.scale)


def _store(codec: HalfCodec, data: list[torch.Tensor], tables: list[list[int]], lens: list[int], num_blocks: int,
           block_size: int, heads: int, dim: int, dtype: torch.dtype, g: torch.Generator) -> HalfStore:
    layout = HalfLayout.from_codec(codec)
    garbage = torch.randn(num_blocks, block_size, heads, dim, generator=g) * 3
    blocks = garbage.clone()
    residual = torch.randn(len(data), block_size, heads, dim, generator=g).to(dtype) if layout.encodes_whole_blocks \
        else None
    for s, (x, table, length) in enumerate(zip(data, tables, lens)):
        padded = torch.cat([x, garbage[0, :(-length) % block_size]]).view(-1, block_size, heads, dim)
        open_block = length % block_size != 0
        if residual is not None and open_block:
            residual[s, :length % block_size] = x[length - length % block_size:].to(dtype)
            padded = padded[:-1]          # the open block's parts stay garbage
        blocks[table[:padded.shape[0]]] = padded
    parts = codec.encode(blocks.to(dtype))
    return HalfStore(layout, {name: t.contiguous() for name, t in parts.items()}, residual)


def make_case(key_token: str, value_token: str | None = None, *, lens: list[int], num_queries: list[int],
              num_kv_heads: int = 2, group: int = 1, head_dim: int = 64, block_size: int = 16,
              dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0) -> Case:
    """Sequences of ``lens`` tokens whose last ``num_queries`` tokens are the queries."""
    g = torch.Generator().manual_seed(seed)
    key_codec = parse_codec(key_token, "k", dtype)
    value_codec = parse_codec(value_token or key_token, "v", dtype)
    tables_len = [-(-n // block_size) for n in lens]
    num_blocks = sum(tables_len) + 3
    order = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for n in tables_len:
        tables.append(order[at:at + n])
        at += n
    keys = [torch.randn(n, num_kv_heads, head_dim, generator=g) for n in lens]
    for k in keys:
        k[:, :, 1] *= 8           # an outlier channel, as real keys have
    values = [torch.randn(n, num_kv_heads, head_dim, generator=g) for n in lens]
    key = _store(key_codec, keys, tables, lens, num_blocks, block_size, num_kv_heads, head_dim, dtype, g)
    value = _store(value_codec, values, tables, lens, num_blocks, block_size, num_kv_heads, head_dim, dtype, g)
    max_blocks = max(tables_len)
    table = torch.tensor([t + [order[-1]] * (max_blocks - len(t)) for t in tables], dtype=torch.int32)
    has_residual = key.residual is not None or value.residual is not None
    opens = [s if has_residual and n % block_size else -1 for s, n in enumerate(lens)]
    starts = [0]
    for n in num_queries:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], num_kv_heads * group, head_dim, generator=g).to(dtype)
    batch = PagedBatch(table, torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
                       torch.tensor(opens, dtype=torch.int32), block_size, max(num_queries), max(lens))
    case = Case(q, key_codec, key, value_codec, value, batch, head_dim ** -0.5, tuple(keys), tuple(values))
    return case if device == "cpu" else to_device(case, device)


def to_device(case: Case, device: str) -> Case:
    def half(store: HalfStore) -> HalfStore:
        return HalfStore(store.layout, {n: t.to(device) for n, t in store.parts.items()},
                         None if store.residual is None else store.residual.to(device))

    b = case.batch
    batch = PagedBatch(b.block_tables.to(device), b.context_lens.to(device), b.query_starts.to(device),
                       b.open_rows.to(device), b.block_size, b.max_query_len, b.max_context_len)
    return Case(case.q.to(device), case.key_codec, half(case.key), case.value_codec, half(case.value), batch,
                case.scale, case.raw_keys, case.raw_values)


def with_positions(case: Case, positions: list[list[int]]) -> Case:
    """``case`` with each sequence's queries at ``positions`` (ascending, the last at its last
    context position) instead of its last tokens: a prefill with gaps."""
    from dataclasses import replace

    flat = torch.tensor([p for seq in positions for p in seq], dtype=torch.int32, device=case.batch.context_lens.device)
    return replace(case, batch=replace(case.batch, query_positions=flat))


def stored_keys(case: Case, s: int) -> torch.Tensor:
    """Sequence ``s``'s keys as stored (decoded), [len, kv_heads, head_dim]."""
    b = case.batch
    length = int(b.context_lens[s])
    table = b.block_tables[s, :-(-length // b.block_size)].long()
    parts = {name: t.index_select(0, table) for name, t in case.key.parts.items()}
    return case.key_codec.decode(parts, torch.float32).flatten(0, 1)[:length]


def reference_scores(case: Case, score_from: list[int]) -> torch.Tensor:
    b = case.batch
    num_seqs, kv_heads = b.block_tables.shape[0], case.key.parts[next(iter(case.key.parts))].shape[2]
    group = case.q.shape[1] // kv_heads
    out = torch.zeros(num_seqs, kv_heads, b.max_context_len, dtype=torch.float64)
    for s in range(num_seqs):
        start, end, length = int(b.query_starts[s]), int(b.query_starts[s + 1]), int(b.context_lens[s])
        keys = stored_keys(case, s).double()
        for i in range(score_from[s], end - start):
            visible = length - (end - start) + i + 1
            q = case.q[start + i].double().view(kv_heads, group, -1)
            weights = (torch.einsum("hgd,lhd->hgl", q, keys[:visible]) * case.scale).softmax(-1)
            out[s, :, :visible] += weights.sum(1)
    return out.float()


def dense_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int,
                    scale: float) -> torch.Tensor:
    """q [n, Hq, D] (the last n positions of ``length``) over keys/values [L, H, D]: float64 attention."""
    n, hq, _ = q.shape
    group = hq // keys.shape[1]
    k = keys[:length].double().repeat_interleave(group, dim=1)
    v = values[:length].double().repeat_interleave(group, dim=1)
    logits = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    causal = torch.arange(length, device=q.device)[None, :] <= torch.arange(length - n, length, device=q.device)[:, None]
    return torch.einsum("hnl,lhd->nhd", logits.masked_fill(~causal, float("-inf")).softmax(dim=-1), v)


@dataclass(frozen=True)
class ZipCase:
    """A zip storage (kv/storage/zip.py) on the tiny config holding 3 sequences' keys and values
    (2 KV heads) in every layer, some full blocks with a finer copy and some without (``drop``
    took theirs away): the sequences' block tables, lengths, open rows, the overlay that reads
    their open blocks from rows, and the keys and values written (all sequences' in a row)."""

    storage: ZipKVCache
    fmt: KVFormat
    tables: list[list[int]]
    lens: list[int]
    open_rows: list[int]
    overlay: Overlay
    keys: torch.Tensor
    values: torch.Tensor

    def batch(self, num_queries: list[int]) -> tuple[PagedBatch, list[int]]:
        """A batch of each sequence's last ``num_queries`` positions, and their query starts."""
        starts = [0]
        for n in num_queries:
            starts.append(starts[-1] + n)
        dev = self.keys.device
        width = max(len(t) for t in self.tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32, device=dev)
        as_ints = partial(torch.tensor, dtype=torch.int32, device=dev)
        return PagedBatch(table, as_ints(self.lens), as_ints(starts), as_ints(self.open_rows), self.storage.block_size,
                          max(num_queries), max(self.lens)), starts


def zip_case(spec: str, head_dim: int, block_size: int, device: str, seed: int, drop: list[int]) -> ZipCase:
    from tiny import TINY

    from kvserve.config import CacheConfig, SchedulerConfig
    from kvserve.kv.codecs import parse_kv_format
    from kvserve.kv.storage.factory import make_storage

    config = replace(TINY, head_dim=head_dim)
    fmt = parse_kv_format(spec, config.num_layers, torch.float32, head_dim=head_dim)
    storage = make_storage(config, fmt, CacheConfig(block_size=block_size, num_blocks=16),
                           SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), torch.float32,
                           torch.device(device))
    assert isinstance(storage, ZipKVCache)
    b = block_size
    tables, lens = [[7, 2, 9, 4, 11], [3, 5], [12, 0, 6]], [4 * b + 2, 2 * b, 2 * b + 3]
    planner = storage.planner()
    for table, length in zip(tables, lens):
        planner.add(table, 0, length)
    last = [(i * 5 + (length - 1) // b, table[(length - 1) // b]) for i, (table, length) in enumerate(zip(tables, lens))]
    overlay = planner.overlay(last)
    open_rows = planner.open_rows([blk for _, blk in last])
    writes = planner.build()
    g = torch.Generator().manual_seed(seed)
    k = (torch.randn(sum(lens), 2, head_dim, generator=g) * 2).to(device)
    v = torch.randn(sum(lens), 2, head_dim, generator=g).to(device)
    for layer in range(config.num_layers):
        storage.write(layer, k, v, writes)
    assert storage.refined.block_ids == sorted(blk for t, n in zip(tables, lens) for blk in t[:n // b])
    storage.refined.drop(drop)
    return ZipCase(storage, fmt, tables, lens, open_rows, overlay, k, v)

"""Random paged caches in any KV format, for testing attention kernels against the reference.

A case stores each sequence's keys and values block by block through the codecs, in
shuffled block ids, with garbage wherever a kernel must not read: the unused tail of an
open block, blocks no table names, and the encoded parts of an open block whose half keeps
a residual row (its real entries are in the row).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.reference import reference_attention
from kvserve.kv.codecs import HalfCodec, parse_codec
from kvserve.kv.storage.layout import HalfLayout, HalfStore, PagedBatch


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

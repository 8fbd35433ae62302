"""The reference every attention kernel is tested against: decode each sequence's blocks
with the codec itself (kv/codecs), lay the residual rows of open blocks over them, and
attend in float32 with an explicit causal mask. Slow and simple on purpose.
"""

from __future__ import annotations

import torch

from kvserve.kv.codecs import HalfCodec
from kvserve.kv.storage.layout import HalfStore, PagedBatch


def decode_sequence(codec: HalfCodec, store: HalfStore, block_ids: list[int], num_tokens: int,
                    open_row: int) -> torch.Tensor:
    """The first ``num_tokens`` keys (or values) of a sequence, [num_tokens, H, D] float32."""
    ids = torch.tensor(block_ids, dtype=torch.long, device=next(iter(store.parts.values())).device)
    blocks = codec.decode({name: t.index_select(0, ids) for name, t in store.parts.items()}, torch.float32)
    if open_row >= 0 and store.residual is not None:
        blocks[-1] = store.residual[open_row].float()
    return blocks.reshape(-1, *blocks.shape[2:])[:num_tokens]


def reference_attention(q: torch.Tensor, key_codec: HalfCodec, key: HalfStore, value_codec: HalfCodec,
                        value: HalfStore, batch: PagedBatch, scale: float) -> torch.Tensor:
    """q [T, Hq, D] -> out [T, Hq, D] in q's dtype; Hq a multiple of the stored heads."""
    out = torch.empty_like(q)
    starts = batch.query_starts.tolist()
    lens = batch.context_lens.tolist()
    opens = batch.open_rows.tolist()
    bs = batch.block_size
    for s in range(batch.num_seqs):
        n, length = starts[s + 1] - starts[s], lens[s]
        if n == 0:
            continue
        num_blocks = -(-length // bs)
        ids = batch.block_tables[s, :num_blocks].tolist()
        k = decode_sequence(key_codec, key, ids, length, opens[s])      # [L, H, D]
        v = decode_sequence(value_codec, value, ids, length, opens[s])
        qs = q[starts[s]:starts[s + 1]].float()                        # [n, Hq, D]
        group = qs.shape[1] // k.shape[1]
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        logits = torch.einsum("nhd,lhd->hnl", qs, k) * scale
        query_pos = (torch.arange(length - n, length) if batch.query_positions is None
                     else batch.query_positions[starts[s]:starts[s + 1]].long().cpu())
        causal = torch.arange(length)[None, :] <= query_pos[:, None]   # [n, L]
        logits = logits.masked_fill(~causal.to(logits.device), float("-inf"))
        out[starts[s]:starts[s + 1]] = torch.einsum("hnl,lhd->nhd", logits.softmax(dim=-1), v).to(q.dtype)
    return out

"""The reference every attention kernel is tested against: decode each sequence's blocks
with the codec itself (kv/codecs), lay the residual rows of open blocks over them, and
attend in float32 with an explicit causal mask. Slow and simple on purpose.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

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
        if batch.window is not None:
            causal &= torch.arange(length)[None, :] > query_pos[:, None] - batch.window
        logits = logits.masked_fill(~causal.to(logits.device), float("-inf"))
        out[starts[s]:starts[s + 1]] = torch.einsum("hnl,lhd->nhd", logits.softmax(dim=-1), v).to(q.dtype)
    return out


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int | None = None) -> torch.Tensor:
    """A prompt's dense causal attention, outside any cache: q [T, Hq, D], k and v [T, Hkv, D]
    of positions 0..T-1 -> [T, Hq, D]; under a sliding ``window`` each query sees its last
    ``window`` positions."""
    n, group = q.shape[0], q.shape[1] // k.shape[1]
    mask = None
    if window is not None and window < n:
        pos = torch.arange(n, device=q.device)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - window)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                         is_causal=mask is None, scale=scale, enable_gqa=group > 1)
    return out.transpose(0, 1)

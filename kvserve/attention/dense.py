"""Attention over one sequence's dense keys and values, its queries at given positions: the
portable path of ``AttentionBackend.attend_dense`` (blending's passes over a prompt,
kvserve/blend/blending.py).

    keys, values   | 0 1 2 3 4 5 6 7 8 9 | padding |    positions 0..n-1; the rows after are never read
    queries at       1     4 5       9                ascending, the last one at the last key

Every position a query: one causal ``scaled_dot_product_attention`` call (the plain prefill).
Some: masked calls of ``ROWS_PER_CALL`` queries, each over the keys up to its last query only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROWS_PER_CALL = 64      # queries per masked call: half the work of one masked call over every key


def attend_dense(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """``AttentionBackend.attend_dense`` by ``scaled_dot_product_attention`` (keys and values
    converted to q's dtype)."""
    group = q.shape[1] // key.shape[1]
    qs, ks, vs = (x.transpose(0, 1).unsqueeze(0) for x in (q, key.to(q.dtype), value.to(q.dtype)))
    if positions.numel() == key.shape[0]:
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=group > 1)
        return out[0].transpose(0, 1)
    outs = []
    ends = positions.tolist()
    for first in range(0, len(ends), ROWS_PER_CALL):
        chunk = positions[first:first + ROWS_PER_CALL]
        end = ends[min(first + ROWS_PER_CALL, len(ends)) - 1] + 1
        mask = torch.arange(end, device=key.device)[None, :] <= chunk[:, None]
        outs.append(F.scaled_dot_product_attention(qs[:, :, first:first + ROWS_PER_CALL], ks[:, :, :end],
                                                   vs[:, :, :end], attn_mask=mask, scale=scale,
                                                   enable_gqa=group > 1))
    return torch.cat(outs, dim=2)[0].transpose(0, 1)

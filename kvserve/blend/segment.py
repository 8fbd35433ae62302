"""A segment's keys and values, and computing them standalone.

``SegmentKV`` holds every layer's keys and values for a run of tokens, in the compute dtype,
keys rotated at ``first_position + i``. A segment computed standalone starts at position 0
and attends to nothing before it: that is what gets cached under the segment's keys, and
``moved_to`` places it anywhere else.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvserve.attention.paged import AttentionMetadata, PrefillChunk
from kvserve.blend.rope import RopeTables
from kvserve.kv.storage.paged import PagedKVCache
from kvserve.model.decoder import Decoder


@dataclass(frozen=True)
class SegmentKV:
    token_ids: tuple[int, ...]
    first_position: int
    keys: tuple[torch.Tensor, ...]      # per layer [num_tokens, kv_heads, head_dim], rotated at their positions
    values: tuple[torch.Tensor, ...]    # per layer, the same shape (no position in them)

    def __post_init__(self) -> None:
        if len(self.keys) != len(self.values):
            raise ValueError(f"{len(self.keys)} layers of keys, {len(self.values)} of values")
        n = len(self.token_ids)
        if any(t.shape[0] != n for t in self.keys + self.values):
            raise ValueError(f"every layer's keys and values must hold {n} tokens")
        if self.first_position < 0:
            raise ValueError(f"first_position must be >= 0, got {self.first_position}")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    def moved_to(self, first_position: int, rope: RopeTables) -> SegmentKV:
        """The same tokens' keys and values at positions ``first_position, ...`` (keys
        re-rotated, values shared)."""
        keys = tuple(rope.move_all(self.keys, self.first_position, first_position))
        return SegmentKV(self.token_ids, first_position, keys, self.values)

    def head(self, num_tokens: int) -> SegmentKV:
        """The first ``num_tokens`` tokens (views)."""
        return self.span(0, num_tokens)

    def span(self, start: int, end: int) -> SegmentKV:
        """Tokens ``start..end-1`` (views), at their own positions."""
        return SegmentKV(self.token_ids[start:end], self.first_position + start,
                         tuple(k[start:end] for k in self.keys), tuple(v[start:end] for v in self.values))


def compute_kv(model: Decoder, token_ids: Sequence[int], first_position: int = 0,
               preamble: Sequence[int] = (), rope: RopeTables | None = None) -> SegmentKV:
    """Keys and values of ``token_ids`` attending only to each other, at positions
    ``first_position, ...``: a segment computed standalone when ``first_position`` is 0.

    One causal prefill through the model's own forward, into a scratch native cache of one
    block holding every token, so the keys and values are exactly those a prompt made of
    these tokens alone would write (compute dtype, before any KV format's encoding).

    With a ``preamble`` the tokens are computed after it (it takes positions 0, ...; they attend
    to it and to each other) and their keys and values kept alone, the keys moved to
    ``first_position, ...`` (``rope``: the model's tables, made here when not given): what a
    prompt starting with the preamble writes for them, placed as a standalone segment.
    """
    if preamble:
        full = compute_kv(model, [*preamble, *token_ids])
        kept = full.span(len(preamble), len(preamble) + len(token_ids))
        return kept.moved_to(first_position, rope if rope is not None else RopeTables(model.config))
    n = len(token_ids)
    if n == 0:
        raise ValueError("a segment needs at least one token")
    if first_position < 0 or first_position + n > model.config.max_position_embeddings:
        raise ValueError(f"positions {first_position}..{first_position + n - 1} are outside the model's "
                         f"{model.config.max_position_embeddings}")
    scratch = PagedKVCache(model.config, 1, n, model.dtype, model.device)
    planner = scratch.planner()
    planner.add([0], 0, n)
    meta = AttentionMetadata(write=planner.build(), decode=None, prefills=(PrefillChunk(0, n, 0, None, None),))
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=model.device)
    positions = torch.arange(first_position, first_position + n, device=model.device)
    model.forward(ids, positions, scratch, meta)
    return SegmentKV(tuple(token_ids), first_position, tuple(k[0] for k in scratch.key_caches),
                     tuple(v[0] for v in scratch.value_caches))

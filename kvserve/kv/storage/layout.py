"""What an attention kernel needs to read a paged KV cache in place.

One layer's keys (or values) are stored by a codec (kv/codecs) as a few *parts*, each a
tensor ``[num_blocks, *part.shape]``. ``HalfLayout`` names the codec's arithmetic in the
few integers a kernel dispatches on; ``HalfStore`` pairs it with the part tensors and the
optional full-precision residual rows of open blocks. ``PagedBatch`` says which blocks each
sequence reads and where its queries sit.

    seq s:  block_tables[s] = | b0 | b1 | b2 |        context_lens[s] = 40, B = 16
            tokens            |0-15|16-31|32-39|       the last block is open (8 of 16)
            queries           rows query_starts[s] .. query_starts[s+1] of q: the last n
                              tokens of the context, positions 40-n .. 39, causal
            open_rows[s]      the residual row holding b2 for halves that keep one
                              (codecs that encode whole blocks), or -1
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Protocol

import torch

from kvserve.kv.codecs import AsymQuantCodec, Fp8Codec, HadamardCodec, HalfCodec, Int8Codec, OutlierCodec, PlainCodec


class CodecKind(IntEnum):
    """The inner arithmetic of a half (before ``+had`` / ``+outN``)."""

    PLAIN = 0          # part ``data`` [B, H, D] in float32, float16 or bfloat16
    INT8 = 1           # ``codes`` int8 [B, H, D], ``scale`` f16 [B, H]: x = code * scale
    FP8 = 2            # ``codes`` uint8 [B, H, D] (e4m3 bits), ``scale`` f16 [B, H]
    ASYM_TOKEN = 3     # ``codes`` uint8 [B, H, D*bits/8], ``scale``/``zero`` f16 [B, H, D/G]
    ASYM_CHANNEL = 4   # ``codes`` uint8 [B, H, D*bits/8], ``scale``/``zero`` f16 [H, D]


@dataclass(frozen=True)
class HalfLayout:
    """How one half (K or V) of one layer is stored.

    ``x = scatter(hadamard(inner(parts)), outliers)``: the inner codec decodes; with
    ``hadamard`` the result is multiplied by the orthonormal Sylvester Hadamard matrix (D a
    power of two); with ``num_outliers`` N the N channels named per block and head by
    ``outlier_channels`` (uint8 [H, N]) take the float16 ``outlier_values`` ([B, H, N]).
    Codes of ASYM kinds are packed along D, lowest bits first; x = code * scale + zero.
    """

    kind: CodecKind
    plain_dtype: torch.dtype | None = None   # PLAIN only
    bits: int = 8                            # ASYM kinds: 2 or 4
    group_size: int = 0                      # ASYM_TOKEN: channels per group
    hadamard: bool = False
    num_outliers: int = 0

    @property
    def reads_rotated(self) -> bool:
        """Kernels read this half in the rotated domain (``+had`` without ``+outN``: the query or
        the output is rotated instead of every row)."""
        return self.hadamard and not self.num_outliers

    @property
    def encodes_whole_blocks(self) -> bool:
        """Whether an open block of this half lives in a residual row until it is full."""
        return self.kind == CodecKind.ASYM_CHANNEL or self.num_outliers > 0

    @classmethod
    def from_codec(cls, codec: HalfCodec) -> HalfLayout:
        """The layout of a codec built by ``parse_codec``; ValueError for any other codec."""
        outliers = 0
        if isinstance(codec, OutlierCodec):
            outliers, codec = codec.num_outliers, codec.inner
        hadamard = isinstance(codec, HadamardCodec)
        if isinstance(codec, HadamardCodec):
            codec = codec.inner
        if isinstance(codec, PlainCodec):
            return cls(CodecKind.PLAIN, plain_dtype=codec.dtype, hadamard=hadamard, num_outliers=outliers)
        if isinstance(codec, Int8Codec):
            return cls(CodecKind.INT8, hadamard=hadamard, num_outliers=outliers)
        if isinstance(codec, Fp8Codec):
            return cls(CodecKind.FP8, hadamard=hadamard, num_outliers=outliers)
        if isinstance(codec, AsymQuantCodec):
            if codec.axis == "channel":
                return cls(CodecKind.ASYM_CHANNEL, bits=codec.bits, hadamard=hadamard, num_outliers=outliers)
            return cls(CodecKind.ASYM_TOKEN, bits=codec.bits, group_size=codec.group_size, hadamard=hadamard,
                       num_outliers=outliers)
        raise ValueError(f"no attention kernel reads codec {codec.name!r} ({type(codec).__name__})")


@dataclass(frozen=True)
class RefinedHalf:
    """A half's finer format under precision by saliency (kv/storage/zip.py): its layout, its
    parts (each ``[num_side_slots, *part.shape]``) and the side map (int64 ``[num_blocks]``: a
    block's side slot, or -1 where the block is read from the half's own parts)."""

    layout: HalfLayout
    parts: Mapping[str, torch.Tensor]
    side_map: torch.Tensor


@dataclass(frozen=True)
class HalfStore:
    """One half of one layer as a kernel reads it: its layout, its part tensors (each
    ``[num_blocks, *part.shape]``, named as the codec names them), for halves that
    encode whole blocks (and every half of a zip storage) residual rows ``[num_rows, B, H, D]``
    in the compute dtype, and under precision by saliency the finer copies (``refined``)."""

    layout: HalfLayout
    parts: Mapping[str, torch.Tensor]
    residual: torch.Tensor | None = None
    refined: RefinedHalf | None = None

    def __post_init__(self) -> None:
        if self.layout.encodes_whole_blocks and self.residual is None:
            raise ValueError("a half that encodes whole blocks needs its residual rows")


class RowWriter(Protocol):
    """Writes a step's new keys and values of one layer into its halves, as the storage's
    torch path would, byte for byte (the index tensors: ``StepWrites``' fields, int64; the
    refine ones: the filled blocks' rows that have a side slot, and those slots, kv/storage/zip.py)."""

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
              residual_slots: torch.Tensor | None = None, encode_rows: torch.Tensor | None = None,
              encode_block_ids: torch.Tensor | None = None, refine_rows: torch.Tensor | None = None,
              refine_slots: torch.Tensor | None = None) -> None: ...

    def bind(self, slots: torch.Tensor, residual_slots: torch.Tensor | None = None,
             encode_rows: torch.Tensor | None = None,
             encode_block_ids: torch.Tensor | None = None) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
        """``write`` with one step's index tensors bound: (layer, key, value) -> None."""
        ...


# (device, each layer's (key, value) halves, head_dim) -> a writer, or None where it cannot run
MakeRowWriter = Callable[[torch.device, Sequence[tuple[HalfStore, HalfStore]], int], RowWriter | None]


@dataclass(frozen=True)
class AttentionScores:
    """Where a backend that scores adds the attention weights keys get: ``weights`` [num_seqs,
    kv_heads, max_context] float32 (zeros to start), entry [s, h, j] growing by the softmax weight
    of key j for every query of sequence s from its row ``score_from[s]`` on (int32 [num_seqs];
    past its last query: none) and every query head of KV head h. What KV budgets score by."""

    weights: torch.Tensor
    score_from: torch.Tensor


@dataclass(frozen=True)
class PagedBatch:
    """The sequences of one attention call (see the module docstring). Index tensors are
    int32 on the device of the cache; the two maxima are host ints for grid sizes."""

    block_tables: torch.Tensor   # [S, max_blocks] block ids; entries past a sequence's blocks are ignored
    context_lens: torch.Tensor   # [S] tokens of each sequence in the cache, this step's included
    query_starts: torch.Tensor   # [S + 1] each sequence's rows of q (its last n tokens)
    open_rows: torch.Tensor      # [S] residual row of the sequence's open last block, or -1
    block_size: int
    max_query_len: int
    max_context_len: int
    # [T] each query's position, ascending within its sequence and ending at its last context
    # position (a prefill with gaps: a blend's rows); None: a sequence's queries are its last n
    query_positions: torch.Tensor | None = None
    # a sliding-window layer's window: each query sees only the keys at most window - 1 positions
    # before it (the blocks wholly before are never read); None: every key up to the query
    window: int | None = None

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

"""The codec contract and the arithmetic helpers every codec shares.

A *half codec* stores either the keys or the values of full blocks of one layer
as a few *parts* (tensors). The paged cache keeps, per layer and half, one tensor
per part of shape ``[num_blocks, *part.shape]``; reading blocks is an
``index_select`` of every part followed by ``decode``, writing is ``encode`` of
whole blocks followed by an ``index_copy_`` of every part.

    x [n, block_size, H, D] --encode--> {part name: [n, *spec.shape]} --decode--> [n, block_size, H, D]

Error bounds are elementwise and exact: they are computed from the same stored
scales and zero points that ``encode`` produces, plus ``FP32_SLACK`` for the
float32 arithmetic of encode and decode (a few roundings of 2**-24 each).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

SCALE_DTYPE = torch.float16
# Relative slack for float32 arithmetic (a division, a subtraction, an addition,
# each rounded to 2**-24 relative): 16 ulps, far below any quantization step.
FP32_SLACK = 2.0 ** -20


@dataclass(frozen=True)
class PartSpec:
    """One stored tensor of a block, excluding the leading ``num_blocks`` dim."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class HalfCodec(ABC):
    """Encodes either the keys or the values of full blocks of one layer.

    Codecs are immutable and stateless: ``encode`` is a pure function of its input,
    deterministic, and each block's parts depend only on that block (encoding a
    batch of blocks gives, byte for byte, what encoding each alone gives), so a
    prefix-cache hit reads exactly what a cold run would have stored.
    Inputs must lie in the float16 range (|x| <= 65504): scales, zero points and
    protected outliers are stored in float16. Parts may share memory with the input,
    and a decoded result with the parts (plain storage in the same dtype): copy before
    writing into either.
    """

    @property
    @abstractmethod
    def name(self) -> str:
        """Canonical spec token of this half (e.g. ``int4g32``, ``kivi2+had``)."""

    @property
    def encodes_whole_blocks(self) -> bool:
        """Whether a token's stored form depends on the other tokens of its block (statistics
        over the block's tokens), so a block can be encoded only once it is full."""
        return False

    def check_head_dim(self, head_dim: int) -> None:
        """Raise ValueError when the codec cannot store heads of ``head_dim`` channels."""
        if head_dim < 1:
            raise ValueError(f"head_dim must be positive, got {head_dim}")

    @abstractmethod
    def parts(self, block_size: int, num_heads: int, head_dim: int) -> tuple[PartSpec, ...]:
        """The stored tensors of one block (validates the shape, ValueError if unsupported)."""

    @abstractmethod
    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """x: [n, block_size, H, D] float (float32 or the compute dtype) -> each part [n, *spec.shape]."""

    @abstractmethod
    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Parts [n, *spec.shape] -> [n, block_size, H, D] in ``dtype``."""

    @abstractmethod
    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise bound on |decode(encode(x), float32) - x| guaranteed for this x
        (same shape as x, float32). Decoding to a narrower dtype adds its rounding."""

    def nbytes_per_block(self, block_size: int, num_heads: int, head_dim: int) -> int:
        """Exact bytes one block of this half occupies (the sum over its parts)."""
        return sum(p.nbytes for p in self.parts(block_size, num_heads, head_dim))


def half_ulp(a: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the spacing of ``dtype`` at magnitude ``a`` (>= 0): the largest error of
    rounding a value of magnitude ``a`` to nearest in ``dtype`` (within its range).
    Below the smallest normal the spacing is that of the subnormals."""
    fi = torch.finfo(dtype)
    _, exponent = torch.frexp(a.float().clamp_min(fi.tiny))   # a in [2**(e-1), 2**e)
    return torch.ldexp(torch.full_like(a, fi.eps / 2, dtype=torch.float32), exponent - 1)


def to_scale(t: torch.Tensor) -> torch.Tensor:
    """Round float32 scales / zero points to their stored dtype (nearest)."""
    return t.to(SCALE_DTYPE)


def safe_divide(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den where den > 0, else 0 (a zero scale encodes code 0)."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack unsigned ``bits``-bit codes (uint8, last dim divisible by 8 // bits) into
    bytes along the last dim; code j of a byte sits at bits [j*bits, (j+1)*bits)."""
    if bits == 8:
        return codes
    per_byte = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=codes.device)
    grouped = codes.view(*codes.shape[:-1], codes.shape[-1] // per_byte, per_byte)
    return (grouped << shifts).sum(dim=-1, dtype=torch.uint8)


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_bits``: uint8 codes, last dim multiplied by 8 // bits."""
    if bits == 8:
        return packed
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
    mask = (1 << bits) - 1
    codes = (packed.unsqueeze(-1) >> shifts) & mask
    return codes.view(*packed.shape[:-1], packed.shape[-1] * (8 // bits))


def check_block(x: torch.Tensor) -> torch.Tensor:
    """Validate a batch of blocks and return it as float32."""
    if x.dim() != 4:
        raise ValueError(f"expected blocks [n, block_size, heads, head_dim], got shape {tuple(x.shape)}")
    if x.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"expected float32, float16 or bfloat16 blocks, got {x.dtype}")
    return x.float()

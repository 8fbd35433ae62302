"""Asymmetric (min / scale) integer quantization with packed 2- or 4-bit codes.

Two group shapes, the two halves of KIVI (Liu et al. 2024):

    axis="token"   : per token and head, groups of ``group_size`` consecutive channels
                     codes [B, H, D*bits/8], scale and zero float16 [B, H, D/G]
                     -> bits*D/8 + 4*D/G bytes per token and head   (int4, int2, KIVI values)
    axis="channel" : per head and channel, across the block's B tokens
                     codes [B, H, D*bits/8], scale and zero float16 [H, D]
                     -> bits*B*D/8 + 4*D bytes per block and head   (KIVI keys)

A group with minimum m and maximum M stores zero z = fp16(m), scale s = fp16((M - m) / L)
with L = 2**bits - 1, and codes q = clamp(round((x - z) / s), 0, L); it decodes q*s + z.
Codes are packed along D, lowest bits first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvserve.kv.codecs.base import (
    FP32_SLACK,
    HalfCodec,
    PartSpec,
    check_block,
    pack_bits,
    safe_divide,
    to_scale,
    unpack_bits,
)

Axis = Literal["token", "channel"]


@dataclass(frozen=True)
class AsymQuantCodec(HalfCodec):
    bits: int
    axis: Axis
    group_size: int = 32  # channels per group; axis="token" only

    def __post_init__(self) -> None:
        if self.bits not in (2, 4):
            raise ValueError(f"asymmetric codes are 2 or 4 bits, got {self.bits}")
        if self.axis not in ("token", "channel"):
            raise ValueError(f"axis must be 'token' or 'channel', got {self.axis!r}")
        if self.group_size < 1:
            raise ValueError(f"group size must be positive, got {self.group_size}")

    @property
    def name(self) -> str:
        if self.axis == "channel":
            return f"kivi{self.bits}"
        return f"int{self.bits}g{self.group_size}"

    @property
    def encodes_whole_blocks(self) -> bool:
        return self.axis == "channel"

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    def check_head_dim(self, head_dim: int) -> None:
        super().check_head_dim(head_dim)
        per_byte = 8 // self.bits
        if head_dim % per_byte:
            raise ValueError(f"{self.name}: head_dim {head_dim} is not a multiple of {per_byte} "
                             f"({self.bits}-bit codes are packed {per_byte} per byte)")
        if self.axis == "token" and head_dim % self.group_size:
            raise ValueError(f"{self.name}: group size {self.group_size} does not divide head_dim {head_dim}")

    def parts(self, block_size: int, num_heads: int, head_dim: int) -> tuple[PartSpec, ...]:
        self.check_head_dim(head_dim)
        codes = PartSpec("codes", (block_size, num_heads, head_dim * self.bits // 8), torch.uint8)
        if self.axis == "channel":
            param_shape: tuple[int, ...] = (num_heads, head_dim)
        else:
            param_shape = (block_size, num_heads, head_dim // self.group_size)
        return (codes, PartSpec("scale", param_shape, torch.float16), PartSpec("zero", param_shape, torch.float16))

    # Groups are laid out so that one dim (`_dim`) runs over the members of a group:
    # token axis: [n, B, H, D/G, G] reduced over -1; channel axis: [n, B, H, D] over 1.
    @property
    def _dim(self) -> int:
        return 1 if self.axis == "channel" else -1

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        if self.axis == "channel":
            return x
        return x.reshape(*x.shape[:-1], x.shape[-1] // self.group_size, self.group_size)

    def _params(self, xg: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(min, max, scale, zero) of each group, keepdim; scale and zero rounded to float16."""
        mn = xg.amin(dim=self._dim, keepdim=True)
        mx = xg.amax(dim=self._dim, keepdim=True)
        return mn, mx, to_scale((mx - mn) / self.levels), to_scale(mn)

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        x32 = check_block(x)
        self.check_head_dim(x32.shape[-1])
        xg = self._grouped(x32)
        _, _, scale, zero = self._params(xg)
        codes = safe_divide(xg - zero.float(), scale.float()).round().clamp(0, self.levels)
        codes = codes.to(torch.uint8).reshape(x32.shape)
        return {"codes": pack_bits(codes, self.bits), "scale": scale.squeeze(self._dim),
                "zero": zero.squeeze(self._dim)}

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes = unpack_bits(parts["codes"], self.bits).float()
        scale = parts["scale"].float().unsqueeze(self._dim)
        zero = parts["zero"].float().unsqueeze(self._dim)
        return torch.addcmul(zero, self._grouped(codes), scale).reshape(codes.shape).to(dtype)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        # Unclamped codes err by at most s/2. Clamping at 0 happens only below z
        # (error <= z - min); at L only above L*s + z (error <= max - z - L*s). Both are
        # float16 rounding leftovers of z and s; a zero scale stores z for the whole group.
        x32 = check_block(x)
        xg = self._grouped(x32)
        mn, mx, scale, zero = self._params(xg)
        s, z = scale.float(), zero.float()
        bound = torch.maximum(torch.maximum(s / 2, z - mn), mx - z - self.levels * s)
        slack = FP32_SLACK * (xg.abs() + z.abs() + self.levels * s)
        return (bound + slack).reshape(x32.shape)

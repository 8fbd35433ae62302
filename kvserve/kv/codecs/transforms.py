"""Options that wrap a quantized codec: ``+had`` (Hadamard rotation) and ``+outN``
(outlier channels kept in float16).

When both are given, outliers are taken out first, in the original channels (so
their indices name real channels), and the rest is rotated and quantized:

    x --zero the N outlier channels--> x_rest --H--> inner.encode ... inner.decode --H--> + outliers
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvserve.kv.codecs.base import HalfCodec, PartSpec, check_block, half_ulp

U32 = 2.0 ** -24   # unit roundoff of float32


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x @ H for the orthonormal Sylvester Hadamard matrix H (symmetric, H @ H = I),
    along the last dim (a power of two), by the fast Walsh-Hadamard transform:
    log2(D) add/subtract stages, elementwise, so each row's result never depends on
    the other rows (blocks encode the same alone or in a batch)."""
    d = x.shape[-1]
    y = x.float().reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return y.reshape(x.shape) * d ** -0.5


@dataclass(frozen=True)
class HadamardCodec(HalfCodec):
    """Rotate each (token, head) vector by H before ``inner`` quantizes it, rotate back
    on decode. Adds no storage. A rotation spreads an outlier channel over all D
    channels, so per-token scales are no longer set by one large channel."""

    inner: HalfCodec

    @property
    def name(self) -> str:
        return f"{self.inner.name}+had"

    @property
    def encodes_whole_blocks(self) -> bool:
        return self.inner.encodes_whole_blocks

    def check_head_dim(self, head_dim: int) -> None:
        self.inner.check_head_dim(head_dim)
        if head_dim & (head_dim - 1):
            raise ValueError(f"{self.name}: the Hadamard rotation needs a power-of-two head_dim, got {head_dim}")

    def parts(self, block_size: int, num_heads: int, head_dim: int) -> tuple[PartSpec, ...]:
        self.check_head_dim(head_dim)
        return self.inner.parts(block_size, num_heads, head_dim)

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        x32 = check_block(x)
        self.check_head_dim(x32.shape[-1])
        return self.inner.encode(hadamard_rotate(x32))

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return hadamard_rotate(self.inner.decode(parts, torch.float32)).to(dtype)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        # With e = decoded - rotated (|e_j| <= b_j), the result errs by (H e)_i, and
        # |(H e)_i| <= sum_j |e_j| / sqrt(D): the same bound for every channel of a
        # (token, head). Slack: each FWHT output sums D terms over log2(D) stages,
        # (log2 D + 1) roundings of the L1 norm (derivation in docs/kv_formats.md).
        x32 = check_block(x)
        d = x32.shape[-1]
        b = self.inner.error_bound(hadamard_rotate(x32)).sum(dim=-1, keepdim=True) / math.sqrt(d)
        gamma = 2 * (math.log2(d) + 2) * U32
        slack = gamma * (2 * x32.abs().sum(dim=-1, keepdim=True) + b)
        return (b + slack).expand_as(x32).contiguous()


@dataclass(frozen=True)
class OutlierCodec(HalfCodec):
    """Per block and head, the ``num_outliers`` channels of largest |x| (over the block's
    tokens) are stored in float16 with their channel indices and zeroed before
    ``inner`` quantizes the block. Extra parts: ``outlier_values`` float16 [B, H, N]
    and ``outlier_channels`` uint8 [H, N]: 2*N*B + N bytes per block and head."""

    inner: HalfCodec
    num_outliers: int

    def __post_init__(self) -> None:
        if self.num_outliers < 1:
            raise ValueError(f"+out needs at least one channel, got {self.num_outliers}")

    @property
    def name(self) -> str:
        return f"{self.inner.name}+out{self.num_outliers}"

    @property
    def encodes_whole_blocks(self) -> bool:
        return True     # the outlier channels are chosen over the block's tokens

    def check_head_dim(self, head_dim: int) -> None:
        self.inner.check_head_dim(head_dim)
        if head_dim > 256:
            raise ValueError(f"{self.name}: outlier channel indices are uint8, head_dim {head_dim} > 256")
        if self.num_outliers >= head_dim:
            raise ValueError(f"{self.name}: {self.num_outliers} outlier channels leave none of "
                             f"head_dim {head_dim} to quantize")

    def parts(self, block_size: int, num_heads: int, head_dim: int) -> tuple[PartSpec, ...]:
        self.check_head_dim(head_dim)
        n = self.num_outliers
        return (*self.inner.parts(block_size, num_heads, head_dim),
                PartSpec("outlier_values", (block_size, num_heads, n), torch.float16),
                PartSpec("outlier_channels", (num_heads, n), torch.uint8))

    def _split(self, x32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(channels [n, H, N] ascending, their gather index [n, B, H, N], x with them zeroed)."""
        self.check_head_dim(x32.shape[-1])
        peak = x32.abs().amax(dim=1)                                   # [n, H, D]
        # stable sort: ties go to the lower channel, on every device
        top = torch.sort(peak, dim=-1, descending=True, stable=True).indices[..., :self.num_outliers]
        channels = top.sort(dim=-1).values
        index = channels.unsqueeze(1).expand(-1, x32.shape[1], -1, -1)
        return channels, index, x32.scatter(-1, index, 0.0)

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        x32 = check_block(x)
        channels, index, rest = self._split(x32)
        parts = self.inner.encode(rest)
        parts["outlier_values"] = x32.gather(-1, index).to(torch.float16)
        parts["outlier_channels"] = channels.to(torch.uint8)
        return parts

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        y = self.inner.decode(parts, torch.float32)
        index = parts["outlier_channels"].long().unsqueeze(1).expand(-1, y.shape[1], -1, -1)
        return y.scatter(-1, index, parts["outlier_values"].float()).to(dtype)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        # Outlier channels: float16 rounding; the others: the inner bound on x_rest.
        x32 = check_block(x)
        _, index, rest = self._split(x32)
        bound = self.inner.error_bound(rest)
        return bound.scatter(-1, index, half_ulp(x32.gather(-1, index).abs(), torch.float16))

"""Symmetric per-(token, head) quantization: one float16 scale = absmax / qmax for the
D channels of each token and head.

``int8``: int8 codes in [-127, 127]; ``fp8``: float8 e4m3 codes in [-448, 448],
stored as their uint8 bit patterns (index_copy_ has no float8 kernel on CPU).
Both take D + 2 bytes per token and head.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kv.codecs.base import FP32_SLACK, HalfCodec, PartSpec, check_block, half_ulp, safe_divide, to_scale

FP8_DTYPE: torch.dtype | None = getattr(torch, "float8_e4m3fn", None)
FP8_MAX = 448.0
INT8_MAX = 127.0


def fp8_supported() -> bool:
    """Whether this torch build can cast to and from float8 e4m3."""
    if FP8_DTYPE is None:
        return False
    try:
        return bool(torch.ones(1).to(FP8_DTYPE).float().item() == 1.0)
    except (RuntimeError, TypeError):
        return False


def _fp8_dtype() -> torch.dtype:
    if FP8_DTYPE is None:
        raise ValueError(f"torch {torch.__version__} has no float8_e4m3fn")
    return FP8_DTYPE


def _scale(x32: torch.Tensor, qmax: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(absmax [n, B, H, 1] float32, stored scale [n, B, H] float16)."""
    amax = x32.abs().amax(dim=-1, keepdim=True)
    return amax, to_scale(amax / qmax).squeeze(-1)


@dataclass(frozen=True)
class Int8Codec(HalfCodec):
    """Parts: ``codes`` int8 [B, H, D], ``scale`` float16 [B, H]."""

    @property
    def name(self) -> str:
        return "int8"

    def parts(self, block_size: int, num_heads: int, head_dim: int) -> tuple[PartSpec, ...]:
        self.check_head_dim(head_dim)
        return (PartSpec("codes", (block_size, num_heads, head_dim), torch.int8),
                PartSpec("scale", (block_size, num_heads), torch.float16))

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        x32 = check_block(x)
        _, scale = _scale(x32, INT8_MAX)
        codes = safe_divide(x32, scale.float().unsqueeze(-1)).round().clamp(-INT8_MAX, INT8_MAX)
        return {"codes": codes.to(torch.int8), "scale": scale}

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return (parts["codes"].float() * parts["scale"].float().unsqueeze(-1)).to(dtype)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        # Unclamped codes err by at most s/2. A code is clamped only when the scale
        # rounded down (127 s < absmax), and then errs by |x| - 127 s <= absmax - 127 s.
        # A zero scale (absmax below float16's range) stores 0: error |x| <= absmax.
        x32 = check_block(x)
        amax, scale = _scale(x32, INT8_MAX)
        s = scale.float().unsqueeze(-1)
        bound = torch.maximum(s / 2, amax - INT8_MAX * s)
        return bound.expand_as(x32) + FP32_SLACK * x32.abs()


@dataclass(frozen=True)
class Fp8Codec(HalfCodec):
    """Parts: ``codes`` uint8 [B, H, D] (float8 e4m3 bit patterns), ``scale`` float16 [B, H]."""

    def __post_init__(self) -> None:
        if not fp8_supported():
            raise ValueError(f"fp8 KV storage needs torch.float8_e4m3fn, which torch {torch.__version__} "
                             "does not support here; choose int8 (same size)")

    @property
    def name(self) -> str:
        return "fp8"

    def parts(self, block_size: int, num_heads: int, head_dim: int) -> tuple[PartSpec, ...]:
        self.check_head_dim(head_dim)
        return (PartSpec("codes", (block_size, num_heads, head_dim), torch.uint8),
                PartSpec("scale", (block_size, num_heads), torch.float16))

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        x32 = check_block(x)
        _, scale = _scale(x32, FP8_MAX)
        # Clamp first: CUDA's cast turns out-of-range values into NaN, CPU's saturates.
        v = safe_divide(x32, scale.float().unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
        return {"codes": v.to(_fp8_dtype()).view(torch.uint8), "scale": scale}

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        codes = parts["codes"].view(_fp8_dtype()).float()
        return (codes * parts["scale"].float().unsqueeze(-1)).to(dtype)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        # v = x / s rounds to nearest e4m3: error half an e4m3 ulp at |v|, times s.
        # |v| > 448 happens only when the scale rounded down; the clamp errs by |v| - 448.
        x32 = check_block(x)
        _, scale = _scale(x32, FP8_MAX)
        s = scale.float().unsqueeze(-1)
        v = safe_divide(x32, s).abs()
        grid = torch.where(v > FP8_MAX, v - FP8_MAX, half_ulp(v.clamp_max(FP8_MAX), _fp8_dtype()))
        bound = torch.where(s > 0, grid * s, x32.abs())
        return bound + FP32_SLACK * x32.abs()

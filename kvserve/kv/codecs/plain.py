"""Plain storage: the block's keys or values as they are, in a float dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kv.codecs.base import HalfCodec, PartSpec, check_block, half_ulp

PLAIN_DTYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass(frozen=True)
class PlainCodec(HalfCodec):
    """One part, ``data`` [block_size, H, D] in ``dtype``: 4D / 2D / 2D bytes per token and head."""

    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.dtype not in PLAIN_DTYPES:
            raise ValueError(f"plain storage supports {sorted(PLAIN_DTYPES.values())}, got {self.dtype}")

    @property
    def name(self) -> str:
        return PLAIN_DTYPES[self.dtype]

    def parts(self, block_size: int, num_heads: int, head_dim: int) -> tuple[PartSpec, ...]:
        self.check_head_dim(head_dim)
        return (PartSpec("data", (block_size, num_heads, head_dim), self.dtype),)

    def encode(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        check_block(x)
        return {"data": x.to(self.dtype).contiguous()}

    def decode(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return parts["data"].to(dtype)

    def error_bound(self, x: torch.Tensor) -> torch.Tensor:
        # Rounding to nearest in the storage dtype; nothing to round when it holds x exactly.
        if self.dtype == torch.float32 or x.dtype == self.dtype:
            return torch.zeros_like(x, dtype=torch.float32)
        return half_ulp(x.float().abs(), self.dtype)

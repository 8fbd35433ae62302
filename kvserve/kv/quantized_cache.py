"""KV storage through a codec, with full-precision residual rows for open blocks.

Per layer and half (K, V): one tensor per codec part, ``[num_blocks, *part.shape]``,
plus residual rows ``[num_rows, block_size, heads, dim]`` in the compute dtype.

A step writes every new token into its block's residual row, then encodes the
blocks that the step filled. Reads decode whole blocks and lay the residual rows
of still-open blocks over them. Attention reads what is stored, for old and new
tokens alike, so a prefix-cache hit sees exactly what a cold run saw.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvserve.config import ModelConfig

if TYPE_CHECKING:
    from kvserve.kv.codecs import KVFormat


@dataclass(frozen=True)
class ResidualWrite:
    """Where a step's new tokens go and which blocks it fills."""

    slots: torch.Tensor            # [num_tokens] row * block_size + offset, per new token
    encode_rows: torch.Tensor      # [n] residual rows of the blocks full after this step
    encode_block_ids: torch.Tensor  # [n] their block ids


@dataclass(frozen=True)
class Overlay:
    """Open blocks inside a gathered block table: flat block positions and their rows."""

    positions: torch.Tensor   # [m] indices into block_table.view(-1)
    rows: torch.Tensor        # [m]


class QuantizedKVCache:
    is_lossless = False

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, fmt: KVFormat,
                 num_residual_rows: int, dtype: torch.dtype, device: torch.device) -> None:
        if len(fmt.layers) != config.num_layers:
            raise ValueError(f"KV format has {len(fmt.layers)} layers, the model {config.num_layers}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.format = fmt
        self.dtype = dtype
        h, d = config.num_kv_heads, config.head_dim
        self.key_parts: list[dict[str, torch.Tensor]] = []
        self.value_parts: list[dict[str, torch.Tensor]] = []
        for lf in fmt.layers:
            for codec, store in ((lf.key, self.key_parts), (lf.value, self.value_parts)):
                store.append({p.name: torch.zeros((num_blocks, *p.shape), dtype=p.dtype, device=device)
                              for p in codec.parts(block_size, h, d)})
        shape = (num_residual_rows, block_size, h, d)
        self.key_residual = [torch.zeros(shape, dtype=dtype, device=device) for _ in fmt.layers]
        self.value_residual = [torch.zeros(shape, dtype=dtype, device=device) for _ in fmt.layers]

    @staticmethod
    def residual_row_nbytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * block_size

    def block_tensors(self) -> list[torch.Tensor]:
        """Per-block tensors in payload order (see kv/block_io.py): per layer, the
        key parts then the value parts, each in the codec's part order."""
        out: list[torch.Tensor] = []
        for kp, vp in zip(self.key_parts, self.value_parts):
            out.extend(kp.values())
            out.extend(vp.values())
        return out

    @property
    def nbytes(self) -> int:
        parts = [t for store in self.key_parts + self.value_parts for t in store.values()]
        return sum(t.numel() * t.element_size() for t in parts + self.key_residual + self.value_residual)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, plan: ResidualWrite) -> None:
        lf = self.format.layers[layer]
        for x, residual, codec, store in ((key, self.key_residual[layer], lf.key, self.key_parts[layer]),
                                          (value, self.value_residual[layer], lf.value, self.value_parts[layer])):
            residual.view(-1, *x.shape[1:]).index_copy_(0, plan.slots, x.to(residual.dtype))
            if plan.encode_rows.numel():
                encoded = codec.encode(residual.index_select(0, plan.encode_rows))
                for name, part in encoded.items():
                    store[name].index_copy_(0, plan.encode_block_ids, part)

    def gather(self, layer: int, block_table: torch.Tensor,
               overlay: Overlay | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Decoded keys and values of ``block_table`` ([B, nb]) as [B, nb * block_size, H, D]."""
        lf = self.format.layers[layer]
        flat = block_table.reshape(-1)
        out: list[torch.Tensor] = []
        for codec, store, residual in ((lf.key, self.key_parts[layer], self.key_residual[layer]),
                                       (lf.value, self.value_parts[layer], self.value_residual[layer])):
            blocks = codec.decode({name: t.index_select(0, flat) for name, t in store.items()}, self.dtype)
            if overlay is not None and overlay.positions.numel():
                blocks[overlay.positions] = residual.index_select(0, overlay.rows)
            out.append(blocks.view(block_table.shape[0], -1, *blocks.shape[2:]))
        return out[0], out[1]

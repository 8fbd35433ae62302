"""KV storage through a codec, with full-precision residual rows for open blocks.

Per layer and half (K, V): one tensor per codec part, ``[num_blocks, *part.shape]``,
plus residual rows ``[num_rows, block_size, heads, dim]`` in the compute dtype.

A step writes every new token into its block's residual row, then encodes the
blocks that the step filled. Reads decode whole blocks and lay the residual rows
of still-open blocks over them. Attention reads what is stored, for old and new
tokens alike, so a prefix-cache hit sees exactly what a cold run saw.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig
from kvserve.kv.residual import ResidualRows, num_residual_rows
from kvserve.kv.storage.base import KVStorage, Overlay, StepWrites, WritePlanner

if TYPE_CHECKING:
    from typing import Self

    from kvserve.kv.codecs import KVFormat


class QuantizedKVCache(KVStorage):
    """``StepWrites.slots`` are residual slots (row * block_size + offset); the blocks the
    step fills are encoded from their rows, which ``finish_step`` then frees."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, fmt: KVFormat,
                 num_residual_rows: int, dtype: torch.dtype, device: torch.device) -> None:
        if len(fmt.layers) != config.num_layers:
            raise ValueError(f"KV format has {len(fmt.layers)} layers, the model {config.num_layers}")
        self.num_layers = config.num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.format = fmt
        self.dtype = dtype
        self.device = device
        self.residual = ResidualRows(num_residual_rows)
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

    @classmethod
    def build(cls, model: ModelConfig, fmt: KVFormat, cache: CacheConfig, scheduler: SchedulerConfig,
              dtype: torch.dtype, device: torch.device) -> Self:
        """The residual rows are reserved out of the memory first (kv/residual.py says how many)."""
        bs = cache.block_size
        num_rows = num_residual_rows(bs, scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
        reserved = num_rows * cls.residual_row_nbytes(model, bs, dtype)
        per_block = fmt.nbytes_per_block(bs, model.num_kv_heads, model.head_dim)
        if cache.num_blocks is None and reserved + per_block > cache.memory_bytes:
            raise ValueError(
                f"KV format {fmt.spec} keeps {num_rows} full-precision residual rows ({reserved} bytes: one open "
                f"block per running request plus the blocks a step fills), more than the KV cache memory "
                f"({cache.memory_bytes} bytes); lower max_num_seqs ({scheduler.max_num_seqs}) or "
                f"max_num_batched_tokens ({scheduler.max_num_batched_tokens}), or give the KV cache more memory")
        num_blocks = cache.resolve_num_blocks(per_block, reserved)
        return cls(model, num_blocks, bs, fmt, num_rows, dtype, device)

    @staticmethod
    def residual_row_nbytes(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        return config.kv_bytes_per_token(torch.empty((), dtype=dtype).element_size()) * block_size

    def block_tensors(self) -> list[torch.Tensor]:
        """Per layer, the key parts then the value parts, each in the codec's part order."""
        out: list[torch.Tensor] = []
        for kp, vp in zip(self.key_parts, self.value_parts):
            out.extend(kp.values())
            out.extend(vp.values())
        return out

    @property
    def nbytes(self) -> int:
        parts = [t for store in self.key_parts + self.value_parts for t in store.values()]
        return sum(t.numel() * t.element_size() for t in parts + self.key_residual + self.value_residual)

    def planner(self) -> WritePlanner:
        return _ResidualPlanner(self.residual, self.block_size, self.device)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, writes: StepWrites) -> None:
        lf = self.format.layers[layer]
        for x, residual, codec, store in ((key, self.key_residual[layer], lf.key, self.key_parts[layer]),
                                          (value, self.value_residual[layer], lf.value, self.value_parts[layer])):
            residual.view(-1, *x.shape[1:]).index_copy_(0, writes.slots, x.to(residual.dtype))
            if writes.encode_rows.numel():
                encoded = codec.encode(residual.index_select(0, writes.encode_rows))
                for name, part in encoded.items():
                    store[name].index_copy_(0, writes.encode_block_ids, part)

    def gather(self, layer: int, block_table: torch.Tensor,
               overlay: Overlay | None = None) -> tuple[torch.Tensor, torch.Tensor]:
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

    def finish_step(self, writes: StepWrites) -> None:
        # the blocks filled this step are encoded now: their rows are free again
        self.residual.release(writes.encode_block_ids.tolist())


class _ResidualPlanner(WritePlanner):
    """Every block a chunk touches gets a residual row; the blocks it fills are encoded;
    the block it leaves open is read from its row."""

    def __init__(self, residual: ResidualRows, block_size: int, device: torch.device) -> None:
        self.residual = residual
        self.block_size = block_size
        self.device = device
        self.slots: list[int] = []
        self.encode_rows: list[int] = []
        self.encode_blocks: list[int] = []
        self.open_rows: dict[int, int] = {}      # block id -> row, blocks left open by this step

    def add(self, block_ids: list[int], first_slot: int, num_new: int) -> None:
        bs = self.block_size
        start, end = first_slot, first_slot + num_new
        rows = {i: self.residual.assign(block_ids[i]) for i in range(start // bs, (end - 1) // bs + 1)}
        self.slots.extend(rows[p // bs] * bs + p % bs for p in range(start, end))
        for i, row in rows.items():
            if (i + 1) * bs <= end:
                self.encode_rows.append(row)
                self.encode_blocks.append(block_ids[i])
        if end % bs:
            self.open_rows[block_ids[end // bs]] = rows[end // bs]

    def overlay(self, last_blocks: Sequence[tuple[int, int]]) -> Overlay | None:
        hits = [(position, self.open_rows[block]) for position, block in last_blocks if block in self.open_rows]
        if not hits:
            return None
        return Overlay(torch.tensor([p for p, _ in hits], dtype=torch.long, device=self.device),
                       torch.tensor([r for _, r in hits], dtype=torch.long, device=self.device))

    def build(self) -> StepWrites:
        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return StepWrites(tensor(self.slots), tensor(self.encode_rows), tensor(self.encode_blocks))

"""Precision by saliency (``zip:hi=...,lo=...,salient=f``): every block in a low base format,
the salient ones also in a finer format in a side pool.

    block pool  | b0 | b1 | b2 | b3 | b4 | ...      base (lo) parts, one per block, always
    side pool   | s0 | s1 | s2 |                    finer (hi) parts, ``salient`` of the blocks
    side map      b0->s1  b3->s0  b4->s2            -1 elsewhere (``RefinedBlocks``)

Every half keeps its open blocks in full-precision residual rows, so that a block is encoded
once, when it is full, into its base parts and, where a side slot is free, into its finer
parts as well: the finer copy is made from the real keys and values, never from the base
one. Reads take the finer copy where a block has one. Which blocks keep theirs is the KV
budgets' business (kv/budget/precision.py: the least salient lose it as the context grows);
dropping a refinement frees its side slot, which the next full block takes. The memory is
sized so: ``lo + salient * hi`` per block, plus a side slot for every block a step can fill
(the residual rows' count), since a step refines what it fills before saliency is known.

A block's finer copy goes with the block's content: it is dropped when the block is handed
out again (``RefinedRows.renew``), and tiers carry the base parts alone (``block_tensors``),
so a block brought back from a tier is read at the base precision.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from kvserve.config import ModelConfig
from kvserve.kv.block_io import block_nbytes, read_blocks, write_blocks
from kvserve.kv.residual import ResidualRows
from kvserve.kv.storage.base import KVStorage, Overlay, StepWrites, WritePlanner
from kvserve.kv.storage.layout import HalfLayout, HalfStore, MakeRowWriter, RefinedHalf
from kvserve.kv.storage.quantized import QuantizedKVCache, _QuantizedPlanner, layer_parts

if TYPE_CHECKING:
    from typing import Self

    from kvserve.kv.codecs import KVFormat


class RefinedBlocks:
    """Which blocks hold a finer copy, and where: host bookkeeping plus the device's side map
    (``side_map[block]`` = its side slot or -1) that reads index by."""

    def __init__(self, num_blocks: int, num_slots: int, device: torch.device) -> None:
        self.num_slots = num_slots
        self.side_map = torch.full((num_blocks,), -1, dtype=torch.long, device=device)
        self._slot_of: dict[int, int] = {}
        self._free = list(range(num_slots - 1, -1, -1))   # pop() hands out slot 0 first

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    @property
    def block_ids(self) -> list[int]:
        return sorted(self._slot_of)

    def slot(self, block_id: int) -> int | None:
        return self._slot_of.get(block_id)

    def assign(self, block_id: int) -> int | None:
        """The block's side slot, taking a free one the first time; None when none is free."""
        slot = self._slot_of.get(block_id)
        if slot is None and self._free:
            slot = self._free.pop()
            self._slot_of[block_id] = slot
            self.side_map[block_id] = slot
        return slot

    def drop(self, block_ids: Iterable[int]) -> list[int]:
        """Drop the finer copies of ``block_ids`` (blocks without one are skipped); returns the
        blocks that had one."""
        dropped = [b for b in block_ids if b in self._slot_of]
        for block_id in dropped:
            self._free.append(self._slot_of.pop(block_id))
        if dropped:
            self.side_map[torch.tensor(dropped, dtype=torch.long, device=self.side_map.device)] = -1
        return dropped

    def check_integrity(self) -> None:
        used = set(self._slot_of.values())
        assert len(used) == len(self._slot_of), "two blocks share a side slot"
        assert not used & set(self._free), "a side slot is both used and free"
        assert len(used) + len(self._free) == self.num_slots, "side slots leaked"
        mapped = (self.side_map >= 0).nonzero().flatten().tolist()
        assert mapped == self.block_ids, "the side map disagrees with the refined blocks"
        assert all(int(self.side_map[b]) == s for b, s in self._slot_of.items()), "the side map names other slots"


class RefinedRows(ResidualRows):
    """The residual rows of a zip storage, with its refined blocks: what the KV manager holds
    as the storage's per-block bookkeeping (``renew`` as it hands blocks out again)."""

    def __init__(self, num_rows: int, refined: RefinedBlocks) -> None:
        super().__init__(num_rows)
        self.refined = refined

    def renew(self, block_ids: Iterable[int]) -> None:
        self.refined.drop(block_ids)

    def check_integrity(self) -> None:
        super().check_integrity()
        self.refined.check_integrity()


class ZipKVCache(QuantizedKVCache):
    """A ``QuantizedKVCache`` of the base format whose every half keeps rows, plus the side
    pool of the finer format (module docstring). ``gather`` reads mixed blocks for the torch
    path; ``half_stores`` hands the C++ kernel each half with its finer copies and side map
    (``HalfStore.refined``), which it reads in place."""

    #: no entry is written again at another slot: the budgets here keep whole blocks
    #: (kv/budget/precision.py, ``SaliencyPrecision.kept_blocks``)
    supports_budgets = False

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, fmt: KVFormat,
                 num_residual_rows: int, dtype: torch.dtype, device: torch.device, *, num_side_slots: int,
                 make_writer: MakeRowWriter | None = None) -> None:
        if fmt.refine is None:
            raise ValueError(f"KV format {fmt.spec} has no refinement (zip:hi=...,lo=...)")
        self.refined = RefinedBlocks(num_blocks, num_side_slots, device)
        # (the writer is made below, over the halves with their finer formats)
        super().__init__(config, num_blocks, block_size, fmt, num_residual_rows, dtype, device)
        h, d = config.num_kv_heads, config.head_dim
        self.refine_layers = fmt.refine.layers
        self.side_key_parts, self.side_value_parts = layer_parts(self.refine_layers, num_side_slots, block_size, h, d,
                                                                 device)
        side = self.refined.side_map
        self._refined_halves = [
            (HalfStore(self.key_layouts[i], self.key_parts[i], self.key_residual[i],
                       RefinedHalf(HalfLayout.from_codec(lf.key), self.side_key_parts[i], side)),
             HalfStore(self.value_layouts[i], self.value_parts[i], self.value_residual[i],
                       RefinedHalf(HalfLayout.from_codec(lf.value), self.side_value_parts[i], side)))
            for i, lf in enumerate(self.refine_layers)]
        self._writer = make_writer(device, self._refined_halves, d) if make_writer is not None else None
        self._side_tensors = [t for store in self.side_key_parts + self.side_value_parts for t in store.values()]
        self.finer_nbytes = block_nbytes(self._side_tensors)     # one block's finer copy, every layer

    def make_residual(self, num_rows: int) -> ResidualRows:
        return RefinedRows(num_rows, self.refined)

    rows_hold = "of every half and as many side slots for the blocks a step fills"

    @classmethod
    def reserved_nbytes_per_row(cls, model: ModelConfig, fmt: KVFormat, block_size: int, dtype: torch.dtype) -> int:
        """A row and a side slot: a step refines what it fills before saliency is known."""
        return (cls.residual_row_nbytes(model, fmt, block_size, dtype)
                + fmt.refined_nbytes_per_block(block_size, model.num_kv_heads, model.head_dim))

    @classmethod
    def sized(cls, model: ModelConfig, fmt: KVFormat, num_blocks: int, num_rows: int, block_size: int,
              dtype: torch.dtype, device: torch.device, make_writer: MakeRowWriter | None) -> Self:
        """Blocks at ``lo + salient * hi`` bytes (``build``), so ``salient`` of them side slots beyond
        the rows'. ``make_writer`` gets the halves with their finer formats (``HalfStore.refined``):
        the C++ writer then sends every token to its row."""
        assert fmt.refine is not None
        num_side = int(fmt.refine.salient * num_blocks) + num_rows
        return cls(model, num_blocks, block_size, fmt, num_rows, dtype, device, num_side_slots=num_side,
                   make_writer=make_writer)

    @property
    def nbytes(self) -> int:
        side = [t for store in self.side_key_parts + self.side_value_parts for t in store.values()]
        return super().nbytes + sum(t.numel() * t.element_size() for t in side) + self.refined.side_map.numel() * 8

    def planner(self) -> WritePlanner:
        return _ZipPlanner(self.residual, self.block_size, self.device, self.refined)

    def step_writer(self, writes: StepWrites) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
        # the refine indexes ride along: every layer through ``write``
        return KVStorage.step_writer(self, writes)

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, writes: StepWrites) -> None:
        rows, side = writes.refine_rows, writes.refine_slots
        assert rows is not None and side is not None, "writes planned by another storage's planner"
        if self._writer is not None:
            self._writer.write(layer, key, value, writes.slots, writes.residual_slots, writes.encode_rows,
                               writes.encode_block_ids, rows, side)
            return
        self._write_torch(layer, key, value, writes)
        if not rows.numel():
            return
        lf = self.refine_layers[layer]
        for codec, residual, store in ((lf.key, self.key_residual[layer], self.side_key_parts[layer]),
                                       (lf.value, self.value_residual[layer], self.side_value_parts[layer])):
            assert residual is not None
            for name, part in codec.encode(residual.index_select(0, rows)).items():
                store[name].index_copy_(0, side, part)

    def gather(self, layer: int, block_table: torch.Tensor,
               overlay: Overlay | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().gather(layer, block_table, overlay)
        flat = block_table.reshape(-1)
        side = self.refined.side_map.index_select(0, flat)
        at = (side >= 0).nonzero().flatten()
        if overlay is not None and overlay.positions.numel():
            at = at[~torch.isin(at, overlay.positions)]     # open blocks are read from their rows
        if not at.numel():
            return keys, values
        slots = side.index_select(0, at)
        lf = self.refine_layers[layer]
        for x, codec, store in ((keys, lf.key, self.side_key_parts[layer]), (values, lf.value, self.side_value_parts[layer])):
            blocks = x.view(-1, self.block_size, *x.shape[2:])    # (a fresh decode: written in place)
            blocks[at] = codec.decode({name: t.index_select(0, slots) for name, t in store.items()}, self.dtype)
        return keys, values

    def finer_copies(self, block_ids: list[int]) -> torch.Tensor:
        """The finer copies of ``block_ids`` (each holds one) as bytes, one CPU uint8 row per block
        (every layer's key parts, then every layer's value parts): what ``restore_finer`` takes back."""
        slots = [self.refined.slot(b) for b in block_ids]
        assert all(s is not None for s in slots), "a block without a finer copy"
        return read_blocks(self._side_tensors, [s for s in slots if s is not None])

    def restore_finer(self, block_ids: list[int], copies: torch.Tensor) -> list[int]:
        """Give ``block_ids`` (none holds a finer copy) their finer copies back from ``copies``
        (``finer_copies``' rows, in the same order), each into a free side slot while one is free;
        returns the blocks that got theirs."""
        assert all(self.refined.slot(b) is None for b in block_ids), "a block already holds a finer copy"
        slots = []
        for block_id in block_ids:
            slot = self.refined.assign(block_id)
            if slot is None:
                break
            slots.append(slot)
        if slots:
            write_blocks(self._side_tensors, slots, copies[:len(slots)])
        return block_ids[:len(slots)]

    @property
    def mixes_rotation_domains(self) -> bool:
        """Some half's finer format is Hadamard-rotated (``+had`` without ``+outN``) and its base
        not, or the other way round: the C++ kernel then rotates those blocks' rows as it reads them."""
        return any(h.layout.reads_rotated != h.refined.layout.reads_rotated
                   for pair in self._refined_halves for h in pair if h.refined is not None)

    def half_stores(self, layer: int) -> tuple[HalfStore, HalfStore]:
        return self._refined_halves[layer]


class _ZipPlanner(_QuantizedPlanner):
    """The quantized planner (every half keeps rows), and a side slot for each block a step fills,
    while one is free; a block written from its first slot holds new content: any finer copy of
    what it held before is dropped."""

    def __init__(self, residual: ResidualRows, block_size: int, device: torch.device, refined: RefinedBlocks) -> None:
        super().__init__(residual, block_size, device)
        self.refined = refined
        self.refine_rows: list[int] = []
        self.refine_slots: list[int] = []

    def add(self, block_ids: list[int], first_slot: int, num_new: int, num_drafted: int = 0) -> None:
        bs = self.block_size
        first_fresh = -(-first_slot // bs)
        self.refined.drop(block_ids[first_fresh:-(-(first_slot + num_new) // bs)])
        filled = len(self.encode_blocks)
        super().add(block_ids, first_slot, num_new, num_drafted)
        for row, block_id in zip(self.encode_rows[filled:], self.encode_blocks[filled:]):
            slot = self.refined.assign(block_id)
            if slot is not None:
                self.refine_rows.append(row)
                self.refine_slots.append(slot)

    def build(self) -> StepWrites:
        writes = super().build()

        def tensor(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return replace(writes, refine_rows=tensor(self.refine_rows), refine_slots=tensor(self.refine_slots))


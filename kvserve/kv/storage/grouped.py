"""A model's layers over a storage of fewer layers: layer groups (kv/groups.py) share the
storage's slots, each group's blocks its own.

The storage is built for ``num_slots`` layers; layer ``l`` reads and writes slot
``slot_of_layer[l]`` of the blocks its group's table names (the batch gives each layer its
group's table and write plan: kvserve/attention/batch.py). A block is ``num_slots`` layers'
keys and values, whichever group holds it: so the block mover and the tiers move a group's
block as any other.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from kvserve.kv.groups import LayerGroups
from kvserve.kv.storage.base import KVStorage, Overlay, StepWrites, WritePlanner
from kvserve.kv.storage.layout import HalfStore

if TYPE_CHECKING:
    from typing import Self

    from kvserve.config import CacheConfig, ModelConfig, SchedulerConfig
    from kvserve.kv.codecs import KVFormat
    from kvserve.kv.storage.layout import MakeRowWriter


def slot_format(fmt: KVFormat, groups: LayerGroups) -> KVFormat:
    """``fmt`` for the storage's slots: the layers sharing a slot must share a format."""
    if fmt.refine is not None:
        raise ValueError(f"KV format {fmt.spec}: precision by saliency (zip:) ranks a request's blocks over every "
                         "layer, and a model with sliding-window layers keeps each group's blocks apart; use a "
                         "plain format (native, fp16, int8, kivi2, ...)")
    slots = []
    for slot in range(groups.num_slots):
        formats = {fmt.layers[g.layers[slot]] for g in groups.groups if slot < len(g.layers)}
        if len(formats) > 1:
            layers = [g.layers[slot] for g in groups.groups if slot < len(g.layers)]
            raise ValueError(f"KV format {fmt.spec}: layers {layers} share storage (their groups' slot {slot}) and "
                             "must have one format; give every layer of a kind the same format")
        slots.append(formats.pop())
    return replace(fmt, layers=tuple(slots))


class GroupedStorage(KVStorage):
    """The model's layers over ``inner``'s slots (every call's ``layer`` mapped to its slot)."""

    def __init__(self, inner: KVStorage, groups: LayerGroups) -> None:
        if inner.num_layers != groups.num_slots:
            raise ValueError(f"the storage has {inner.num_layers} layers, the groups {groups.num_slots} slots")
        self.inner = inner
        self.slot_of_layer = groups.slot_of_layer
        self.num_layers = groups.num_layers
        self.num_blocks, self.block_size = inner.num_blocks, inner.block_size
        self.dtype, self.device, self.residual = inner.dtype, inner.device, inner.residual
        self.reads_as_written = inner.reads_as_written
        self.supports_budgets = False        # budgets are refused on models with sliding layers
        self.stashes_decoded = inner.stashes_decoded

    @classmethod
    def build(cls, model: ModelConfig, fmt: KVFormat, cache: CacheConfig, scheduler: SchedulerConfig,
              dtype: torch.dtype, device: torch.device, make_writer: MakeRowWriter | None = None) -> Self:
        raise TypeError("GroupedStorage wraps a built storage: kvserve/kv/storage/factory.py makes it")

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes

    def block_tensors(self) -> list[torch.Tensor]:
        return self.inner.block_tensors()

    def planner(self) -> WritePlanner:
        return self.inner.planner()

    def write(self, layer: int, key: torch.Tensor, value: torch.Tensor, writes: StepWrites) -> None:
        self.inner.write(self.slot_of_layer[layer], key, value, writes)

    def step_writer(self, writes: StepWrites) -> Callable[[int, torch.Tensor, torch.Tensor], None]:
        inner, slot_of_layer = self.inner.step_writer(writes), self.slot_of_layer
        return lambda layer, key, value: inner(slot_of_layer[layer], key, value)

    def gather(self, layer: int, block_table: torch.Tensor,
               overlay: Overlay | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.inner.gather(self.slot_of_layer[layer], block_table, overlay)

    def gather_keys(self, layer: int, block_table: torch.Tensor, overlay: Overlay | None = None) -> torch.Tensor:
        return self.inner.gather_keys(self.slot_of_layer[layer], block_table, overlay)

    def open_overlay(self, block_ids: Sequence[int]) -> Overlay | None:
        return self.inner.open_overlay(block_ids)

    def half_stores(self, layer: int) -> tuple[HalfStore, HalfStore]:
        return self.inner.half_stores(self.slot_of_layer[layer])

    def finish_step(self, writes: StepWrites) -> None:
        self.inner.finish_step(writes)

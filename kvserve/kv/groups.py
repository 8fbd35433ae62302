"""Layer groups: layers of one attention kind share a block table, all groups one pool.

A model whose layers all attend over the whole context has one group: every block holds every
layer, as always. A model with sliding-window layers (Gemma 3: 5 of every 6 attend over their
last 512 positions) has several. Every group holds the same number of layers (``num_slots``: the
storage keeps that many tensors per half, each ``[num_blocks, ...]``), so one pool of equal blocks
serves them all (vLLM's hybrid allocator makes the same choice) and no split of the memory
between kinds has to be guessed at start:

    Gemma 3 270M, 18 layers: full 5, 11, 17; sliding (512) the other 15; 3 slots a block
    group 0  full     layers  5 11 17      a request's table: every block of its context
    group 1  sliding  layers  0  1  2      tables: only the blocks its window still reaches,
    group 2  sliding  layers  3  4  6      the older entries released (None)
    ...
    group 5  sliding  layers 15 16 --     (a group short of layers leaves its last slots unused)

A group's blocks are keyed apart (``group_key``): the same tokens give another key in each
group, so a prefix hit finds each group's own blocks, and a tier keeps each as its own entry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    """Layers sharing a block table: ``layers[s]`` lives in slot ``s`` of the group's blocks."""

    index: int
    layers: tuple[int, ...]
    window: int | None          # sliding window in positions; None: full attention

    @property
    def kind(self) -> str:
        return "full" if self.window is None else "sliding"

    def first_needed_block(self, position: int, block_size: int) -> int:
        """The first block a query at ``position`` reads (its window's; 0 for full attention)."""
        if self.window is None:
            return 0
        return max(0, position - self.window + 1) // block_size


@dataclass(frozen=True)
class LayerGroups:
    groups: tuple[KVGroup, ...]
    num_slots: int              # layers a block holds (the most any group has)
    num_layers: int

    def __post_init__(self) -> None:
        placed = sorted(layer for g in self.groups for layer in g.layers)
        if placed != list(range(self.num_layers)):
            raise ValueError(f"layer groups must place each of {self.num_layers} layers once, got {placed}")
        if any(not 0 < len(g.layers) <= self.num_slots for g in self.groups):
            raise ValueError(f"each group holds 1..{self.num_slots} layers")

    @classmethod
    def of(cls, windows: Sequence[int | None]) -> LayerGroups:
        """Groups for layers with these windows: layers of one window in order, cut into groups
        as large as the smallest kind (full attention's first), so no group mixes kinds."""
        kinds: dict[int | None, list[int]] = {}
        for layer, window in sorted(enumerate(windows), key=lambda lw: (lw[1] is not None, lw[1] or 0, lw[0])):
            kinds.setdefault(window, []).append(layer)
        size = min(len(layers) for layers in kinds.values())
        groups = [(window, tuple(layers[i:i + size])) for window, layers in kinds.items()
                  for i in range(0, len(layers), size)]
        return cls(tuple(KVGroup(i, layers, window) for i, (window, layers) in enumerate(groups)), size, len(windows))

    @property
    def is_single(self) -> bool:
        return len(self.groups) == 1

    @property
    def group_of_layer(self) -> tuple[int, ...]:
        out = [0] * self.num_layers
        for g in self.groups:
            for layer in g.layers:
                out[layer] = g.index
        return tuple(out)

    @property
    def slot_of_layer(self) -> tuple[int, ...]:
        out = [0] * self.num_layers
        for g in self.groups:
            for slot, layer in enumerate(g.layers):
                out[layer] = slot
        return tuple(out)

    def layers_of_kind(self, kind: str) -> int:
        return sum(len(g.layers) for g in self.groups if g.kind == kind)


def group_key(key: bytes, group: int) -> bytes:
    """A block's key in ``group``: the prefix key itself in group 0 (a model with one group keys
    its blocks as it always has, and a cluster's router reads group 0's keys), else a digest of
    the key and the group."""
    if group == 0:
        return key
    return hashlib.sha256(key + b"\x00group" + group.to_bytes(2, "little")).digest()

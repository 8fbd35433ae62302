"""Host memory for the blocks ArkVale moves off the device: one store per engine, bounded
in bytes, the least recently stashed block out first.

A block is stashed when a compaction or a recall takes it off the device and leaves the
store when it is recalled (so the stash order is also the order of last use). When a new
block does not fit, the oldest blocks of any request are evicted: those are gone, their
request can no longer recall them (its ranking skips them), and the store counts them.
A request's blocks leave with the request (``drop_owner``: finished, aborted, preempted).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

import torch

HostBlock = tuple[torch.Tensor, torch.Tensor]   # keys, values of one block and layer: [block_size, heads, dim]


class StashKey(NamedTuple):
    owner: str      # request id
    layer: int
    block: int      # the block's index in its request's sequence (block j: positions j * block_size ...)


def host_block_nbytes(block: HostBlock) -> int:
    return block[0].nbytes + block[1].nbytes


class HostBlockStore:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"host store capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._blocks: OrderedDict[StashKey, HostBlock] = OrderedDict()   # oldest first
        self._owned: dict[str, set[StashKey]] = {}
        self._owner_nbytes: dict[str, int] = {}
        self._owner_evicted: dict[str, int] = {}
        self.nbytes = 0
        self.num_evicted = 0      # blocks pushed out for room (never recalled), all requests

    @property
    def num_blocks(self) -> int:
        return len(self._blocks)

    def contains(self, key: StashKey) -> bool:
        return key in self._blocks

    def put(self, key: StashKey, block: HostBlock) -> None:
        """Stash ``block`` (host tensors) as the newest, evicting the oldest blocks until it
        fits; a block larger than the whole store is not kept (and counts as evicted)."""
        assert key not in self._blocks, f"{key} is already stashed"
        size = host_block_nbytes(block)
        if size > self.capacity_bytes:
            self._count_evicted(key.owner)
            return
        while self.nbytes + size > self.capacity_bytes:
            oldest = next(iter(self._blocks))
            self._remove(oldest)
            self._count_evicted(oldest.owner)
        self._blocks[key] = block
        self._owned.setdefault(key.owner, set()).add(key)
        self._owner_nbytes[key.owner] = self._owner_nbytes.get(key.owner, 0) + size
        self.nbytes += size

    def peek(self, key: StashKey) -> HostBlock:
        """The stashed block, left in place (KeyError when it is not here)."""
        return self._blocks[key]

    def take(self, key: StashKey) -> HostBlock:
        """Remove and return the stashed block (a recall)."""
        block = self._blocks[key]
        self._remove(key)
        return block

    def remove(self, key: StashKey) -> None:
        self._remove(key)

    def drop_owner(self, owner: str) -> None:
        """Forget every block of ``owner`` (and its eviction count)."""
        for key in list(self._owned.get(owner, ())):
            self._remove(key)
        self._owner_evicted.pop(owner, None)

    # -- reading -----------------------------------------------------------
    def owners(self) -> set[str]:
        return set(self._owned)

    def nbytes_of(self, owner: str) -> int:
        return self._owner_nbytes.get(owner, 0)

    def num_evicted_of(self, owner: str) -> int:
        """Blocks of ``owner`` evicted for room since it stashed its first."""
        return self._owner_evicted.get(owner, 0)

    def blocks_of(self, owner: str, layer: int) -> dict[int, HostBlock]:
        """``owner``'s stashed blocks of ``layer`` by index (a copy of the index, not the tensors)."""
        return {k.block: self._blocks[k] for k in self._owned.get(owner, ()) if k.layer == layer}

    def check_integrity(self) -> None:
        assert self.nbytes == sum(host_block_nbytes(b) for b in self._blocks.values()), "host store bytes drifted"
        assert self.nbytes <= self.capacity_bytes, "host store over its capacity"
        owned = [k for keys in self._owned.values() for k in keys]
        assert len(owned) == len(self._blocks) and set(owned) == self._blocks.keys(), "host store owners drifted"
        for owner, keys in self._owned.items():
            assert keys and all(k.owner == owner for k in keys), f"bad owner index for {owner!r}"
            assert self._owner_nbytes[owner] == sum(host_block_nbytes(self._blocks[k]) for k in keys), (
                f"host bytes of {owner!r} drifted")
        assert self._owner_nbytes.keys() == self._owned.keys(), "host bytes kept for an owner with no blocks"

    def _remove(self, key: StashKey) -> None:
        block = self._blocks.pop(key)
        size = host_block_nbytes(block)
        self.nbytes -= size
        keys = self._owned[key.owner]
        keys.discard(key)
        self._owner_nbytes[key.owner] -= size
        if not keys:
            del self._owned[key.owner]
            del self._owner_nbytes[key.owner]

    def _count_evicted(self, owner: str) -> None:
        self.num_evicted += 1
        self._owner_evicted[owner] = self._owner_evicted.get(owner, 0) + 1

"""Host memory for the blocks ArkVale moves off the device: one store per engine, bounded
in bytes, the least recently stashed block out first.

A block is stashed when a compaction or a recall takes it off the device and leaves the
store when it is recalled (so the stash order is also the order of last use). When a new
block does not fit, the oldest blocks of any request are evicted: those are gone, their
request can no longer recall them (its ranking skips them), and the store counts them.
A request's blocks leave with the request (``drop_owner``: finished, aborted, preempted).

The blocks live in one pool, ``[rows, 2, *block shape]`` (keys then values), grown by
doubling up to the capacity, so stashing the n blocks of a layer's compaction is one copy
whatever n is. Every block of a store has the shape and dtype of the first (one engine's
blocks as its storage stashes them, ``KVStorage.stored_blocks``: ``[block_size, kv_heads,
head_dim]`` in the compute dtype, or a quantized format's bytes); a row is free when its
block has left, and freed rows are reused.

Beside the stash order, the store keeps per request and layer the pool row of each block
(``rows_of``: -1 where none), which ArkVale's C++ decode pass reads and changes in place
when it trades blocks between the pool and the device (``swapped`` then moves the keys).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import NamedTuple

import numpy as np
import torch

from kvserve.kv.budget.pages import load_extension

HostBlock = tuple[torch.Tensor, torch.Tensor]   # keys, values of one block and layer, as the storage stashes them

FIRST_ROWS = 64        # rows the pool starts with (then doubles, up to the capacity)


class StashKey(NamedTuple):
    owner: str      # request id
    layer: int
    block: int      # the block's index in its request's sequence (block j: positions j * block_size ...)


class HostBlockStore:
    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"host store capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._rows: OrderedDict[StashKey, int] = OrderedDict()    # oldest first: the pool row of each block
        self._owned: dict[str, set[StashKey]] = {}
        self._owner_evicted: dict[str, int] = {}
        self._pool: torch.Tensor | None = None
        # owner -> layer -> the pool row of each block (-1: none): a tensor and a numpy view of it
        self._index: dict[str, dict[int, tuple[torch.Tensor, np.ndarray]]] = {}
        self._free_rows: list[int] = []
        self._shape: tuple[int, ...] = ()
        self._dtype = torch.float32
        self.block_nbytes = 0            # K + V of one block, set by the first block stashed
        self.nbytes = 0
        self.num_evicted = 0      # blocks pushed out for room (never recalled), all requests

    @property
    def num_blocks(self) -> int:
        return len(self._rows)

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_bytes // self.block_nbytes if self.block_nbytes else 0

    @property
    def pool(self) -> torch.Tensor | None:
        """``[rows, 2, *block shape]``: every stashed block's keys then values (None before the first)."""
        return self._pool

    def contains(self, key: StashKey) -> bool:
        return key in self._rows

    def rows_of(self, owner: str, layer: int, num_blocks: int) -> torch.Tensor:
        """The pool row of each of ``owner``'s blocks of ``layer`` by block index, -1 where the
        store holds none: int64 ``[>= num_blocks]``, the store's own index (kept as blocks come,
        go and are evicted). A caller that trades blocks in place through it (kv/csrc/pages.cpp's
        ``swap_pages``) then reports the trades with ``swapped``."""
        return self._index_of(owner, layer, num_blocks)[0]

    def swapped(self, owner: str, layer: int, pairs: list[tuple[int, int]]) -> None:
        """Each pair ``(j_in, j_out)``: block ``j_out`` of ``owner`` and ``layer`` took the pool row
        block ``j_in`` left (already so in ``rows_of``'s index), and is the newest stashed."""
        owned, rows = self._owned[owner], self._rows
        for j_in, j_out in pairs:
            key_in, key_out = StashKey(owner, layer, j_in), StashKey(owner, layer, j_out)
            rows[key_out] = rows.pop(key_in)
            owned.remove(key_in)
            owned.add(key_out)

    def put(self, key: StashKey, block: HostBlock) -> None:
        self.put_many([key], block[0][None], block[1][None])

    def put_many(self, keys: list[StashKey], keys_data: torch.Tensor, values_data: torch.Tensor) -> None:
        """Stash block i of ``keys_data``/``values_data`` ([n, *block shape], any device) under
        ``keys[i]``, in order, each the newest, evicting the oldest blocks until each fits; when
        the store holds no block of this size at all, none is kept (each counts as evicted)."""
        if not keys:
            return
        self._check_shape(keys_data.shape[1:], values_data.shape[1:], keys_data.dtype, values_data.dtype)
        if keys_data.shape[0] != len(keys) or values_data.shape[0] != len(keys):
            raise ValueError(f"{len(keys)} blocks, but {keys_data.shape[0]} keys and {values_data.shape[0]} values")
        placed = self._place(keys)
        if not placed:
            return
        pool = self._pool
        assert pool is not None
        rows = [row for _, row in placed]
        if len(placed) < len(keys):
            chosen = torch.tensor([n for n, _ in placed], dtype=torch.long, device=keys_data.device)
            keys_data, values_data = keys_data.index_select(0, chosen), values_data.index_select(0, chosen)
        index = torch.tensor(rows, dtype=torch.long)
        pool[:, 0].index_copy_(0, index, keys_data.to(pool.device, pool.dtype))
        pool[:, 1].index_copy_(0, index, values_data.to(pool.device, pool.dtype))

    def can_exchange(self, parts: tuple[list[torch.Tensor], list[torch.Tensor]]) -> bool:
        """Whether these device blocks (a layer's per-block tensors, ``KVStorage.layer_parts``) can
        trade places with pool rows in place, through ``rows_of`` (kv/csrc/pages.cpp's
        ``swap_pages``): contiguous CPU tensors, where the C++ pass is built."""
        tensors = [*parts[0], *parts[1]]
        return (all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
                and load_extension() is not None)

    def peek(self, key: StashKey) -> HostBlock:
        """The stashed block, left in place (KeyError when it is not here): views of the pool,
        valid until the block leaves."""
        assert self._pool is not None
        row = self._pool[self._rows[key]]
        return row[0], row[1]

    def take(self, key: StashKey) -> HostBlock:
        """Remove and return the stashed block (a recall)."""
        k, v = self.take_many([key])
        return k[0], v[0]

    def take_many(self, keys: list[StashKey]) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove the stashed blocks and return copies of them: keys, values [n, *block shape]."""
        assert self._pool is not None
        index = torch.tensor([self._rows[key] for key in keys], dtype=torch.long)
        taken = self._pool.index_select(0, index)
        for key in keys:
            self._remove(key)
        return taken[:, 0], taken[:, 1]

    def remove(self, key: StashKey) -> None:
        self._remove(key)

    def drop_owner(self, owner: str) -> None:
        """Forget every block of ``owner`` (and its eviction count)."""
        for key in list(self._owned.get(owner, ())):
            self._remove(key)
        self._owner_evicted.pop(owner, None)
        self._index.pop(owner, None)

    # -- reading -----------------------------------------------------------
    def owners(self) -> set[str]:
        return set(self._owned)

    def nbytes_of(self, owner: str) -> int:
        return len(self._owned.get(owner, ())) * self.block_nbytes

    def num_evicted_of(self, owner: str) -> int:
        """Blocks of ``owner`` evicted for room since it stashed its first."""
        return self._owner_evicted.get(owner, 0)

    def blocks_of(self, owner: str, layer: int) -> dict[int, HostBlock]:
        """``owner``'s stashed blocks of ``layer`` by index (views of the pool, see ``peek``)."""
        return {k.block: self.peek(k) for k in self._owned.get(owner, ()) if k.layer == layer}

    def check_integrity(self) -> None:
        assert self.nbytes == len(self._rows) * self.block_nbytes, "host store bytes drifted"
        assert self.nbytes <= self.capacity_bytes, "host store over its capacity"
        owned = [k for keys in self._owned.values() for k in keys]
        assert len(owned) == len(self._rows) and set(owned) == self._rows.keys(), "host store owners drifted"
        assert all(keys and all(k.owner == owner for k in keys) for owner, keys in self._owned.items()), (
            "bad owner index")
        rows = list(self._rows.values())
        num_rows = 0 if self._pool is None else self._pool.shape[0]
        assert len(set(rows)) == len(rows), "two blocks share a pool row"
        assert sorted(rows + self._free_rows) == list(range(num_rows)), "pool rows lost or doubled"
        indexed = {StashKey(owner, layer, int(j)): int(view[j])
                   for owner, layers in self._index.items() for layer, (_, view) in layers.items()
                   for j in np.flatnonzero(view >= 0)}
        assert indexed == dict(self._rows), "the row index and the stash disagree"

    # -- internals ---------------------------------------------------------
    def _check_shape(self, key_shape: torch.Size, value_shape: torch.Size, key_dtype: torch.dtype,
                     value_dtype: torch.dtype) -> None:
        if key_shape != value_shape or key_dtype != value_dtype:
            raise ValueError(f"a block's keys and values need one shape and dtype, got {tuple(key_shape)} "
                             f"{key_dtype} and {tuple(value_shape)} {value_dtype}")
        if not self.block_nbytes:
            self.block_nbytes = 2 * math.prod(key_shape) * key_dtype.itemsize
            self._shape, self._dtype = tuple(key_shape), key_dtype
        elif (tuple(key_shape), key_dtype) != (self._shape, self._dtype):
            raise ValueError(f"this store holds blocks of {self._shape} {self._dtype}, got {tuple(key_shape)} {key_dtype}")

    def _place(self, keys: list[StashKey]) -> list[tuple[int, int]]:
        """Make ``keys`` the newest blocks, evicting the oldest as each needs room: (index in
        ``keys``, pool row) of those kept, one per row (a row freed and reused within the call
        holds the later block)."""
        placed: dict[int, int] = {}      # row -> index in keys
        for n, key in enumerate(keys):
            assert key not in self._rows, f"{key} is already stashed"
            if self.capacity_blocks == 0:
                self._count_evicted(key.owner)
                continue
            while len(self._rows) >= self.capacity_blocks:
                oldest = next(iter(self._rows))
                self._remove(oldest)
                self._count_evicted(oldest.owner)
            row = self._take_row()
            self._rows[key] = row
            self._index_of(key.owner, key.layer, key.block + 1)[1][key.block] = row
            self._owned.setdefault(key.owner, set()).add(key)
            self.nbytes += self.block_nbytes
            placed.pop(row, None)
            placed[row] = n
        return [(n, row) for row, n in placed.items()]

    def _take_row(self) -> int:
        if not self._free_rows:
            self._grow()
        return self._free_rows.pop()

    def _grow(self) -> None:
        old = 0 if self._pool is None else self._pool.shape[0]
        new = min(max(FIRST_ROWS, 2 * old), self.capacity_blocks)
        assert new > old, "grown past the capacity"
        pool = torch.empty((new, 2, *self._shape), dtype=self._dtype)
        if self._pool is not None:
            pool[:old] = self._pool
        self._pool = pool
        self._free_rows.extend(range(new - 1, old - 1, -1))     # the lowest row is used first

    def _index_of(self, owner: str, layer: int, num_blocks: int) -> tuple[torch.Tensor, np.ndarray]:
        layers = self._index.setdefault(owner, {})
        entry = layers.get(layer)
        if entry is None or entry[0].shape[0] < num_blocks:
            old = 0 if entry is None else entry[0].shape[0]
            grown = torch.full((max(num_blocks, 2 * old, FIRST_ROWS),), -1, dtype=torch.long)
            if entry is not None:
                grown[:old] = entry[0]
            layers[layer] = entry = (grown, grown.numpy())
        return entry

    def _remove(self, key: StashKey) -> None:
        row = self._rows.pop(key)
        self._index[key.owner][key.layer][1][key.block] = -1
        self._free_rows.append(row)
        self.nbytes -= self.block_nbytes
        keys = self._owned[key.owner]
        keys.discard(key)
        if not keys:
            del self._owned[key.owner]

    def _count_evicted(self, owner: str) -> None:
        self.num_evicted += 1
        self._owner_evicted[owner] = self._owner_evicted.get(owner, 0) + 1

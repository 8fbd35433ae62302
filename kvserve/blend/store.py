"""Segments' standalone KV in the engine's block pool, under segment keys.

A segment's full blocks are pool blocks like any prompt's: cached with no reference (in the
free queue, so in LRU order) until an allocation evicts them, which demotes them to the
offload tiers like any cached block; a lookup finds them on the device, then in the tiers.
Its last, partial block is never stored (the pool caches full blocks only): a reuse computes
those few tokens along with the ones blending recomputes.

    segment tokens   |0........15|16.......31|32..38|
    keys             | s0        | s1        |  --  |      s_i = segment_block_keys(...)[i]
    stored           | block 7   | block 2   |      |      positions 0..31, standalone

Every verb takes its references and gives them back before it returns, so between calls
the pool's integrity holds (no request table holds these blocks).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvserve.blend.rope import RopeTables
from kvserve.blend.segment import SegmentKV
from kvserve.kv.block_pool import Block, BlockPool, NoFreeBlocksError
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix import segment_block_keys
from kvserve.kv.storage import KVStorage
from kvserve.kv.tiering import Tiering
from kvserve.offload.tiered import EMPTY_RUN, TierRun


class SegmentLocation(NamedTuple):
    num_device_blocks: int
    tier_run: TierRun
    num_full_blocks: int        # the segment's full blocks: what could be stored

    @property
    def num_blocks(self) -> int:
        return self.num_device_blocks + self.tier_run.num_blocks


class SegmentStore:
    def __init__(self, kv: KVCacheManager, pool: BlockPool, storage: KVStorage, tiering: Tiering,
                 preamble: Sequence[int] = ()) -> None:
        """``preamble``: the tokens the segments here were computed after (part of their keys)."""
        self.preamble = tuple(preamble)
        self.kv = kv
        self.pool = pool           # the KV manager's: segments are cached and looked up in it as prefixes are
        self.tiering = tiering
        self.storage = storage
        self.block_size = storage.block_size

    def keys(self, token_ids: Sequence[int], salt: str = "", tenant: str = "") -> list[bytes]:
        """The segment's block keys in cache namespace (``tenant``, ``salt``) (the namespace of the
        requests that store and reuse it, as for prefix blocks)."""
        return segment_block_keys(token_ids, self.block_size, self.kv.extra_key_for(salt, tenant), self.preamble)

    def num_cached_blocks(self, token_ids: Sequence[int], salt: str = "", tenant: str = "") -> int:
        """The segment's leading full blocks on the device now (tiers not asked)."""
        return len(self._device_blocks(token_ids, self.keys(token_ids, salt, tenant)))

    def put(self, segment: SegmentKV, salt: str = "", tenant: str = "") -> int:
        """Store a standalone segment's full blocks that are not on the device yet; returns how
        many it wrote. Raises ValueError for a segment not at position 0, NoFreeBlocksError
        when the pool cannot hold it."""
        if segment.first_position != 0:
            raise ValueError(f"only standalone segments (from position 0) are stored; this one starts "
                             f"at {segment.first_position}")
        if segment.num_layers != self.storage.num_layers:
            raise ValueError(f"a segment of {segment.num_layers} layers for a model of {self.storage.num_layers}")
        keys = self.keys(segment.token_ids, salt, tenant)
        num_cached = len(self._device_blocks(segment.token_ids, keys))
        if num_cached == len(keys):
            return 0
        blocks = self.kv.allocate_unowned(len(keys) - num_cached)
        bs = self.block_size
        try:
            start, end = num_cached * bs, len(keys) * bs
            write_tokens(self.storage, [b.block_id for b in blocks], 0, [k[start:end] for k in segment.keys],
                         [v[start:end] for v in segment.values])
            for i, block in enumerate(blocks, start=num_cached):
                self.pool.cache(block, keys[i], tuple(segment.token_ids[i * bs:(i + 1) * bs]), tenant)
        finally:
            self.pool.free(reversed(blocks))
        return len(blocks)

    def locate(self, token_ids: Sequence[int], salt: str = "", tenant: str = "") -> SegmentLocation:
        """Where the segment's leading stored blocks are: on the device, then in the tiers (a
        run worth loading, by the tiers' cost model). Nothing is loaded or referenced."""
        keys = self.keys(token_ids, salt, tenant)
        num_device = len(self._device_blocks(token_ids, keys))
        run = self.tiering.lookup(keys[num_device:]) if num_device < len(keys) else EMPTY_RUN
        return SegmentLocation(num_device, run, len(keys))

    def get(self, token_ids: Sequence[int], first_position: int, rope: RopeTables,
            salt: str = "", tenant: str = "") -> SegmentKV | None:
        """The KV of the segment's leading stored blocks, moved to ``first_position``: from the
        device, then loaded from the offload tiers into fresh blocks (cached there again).
        None when not even its first block is stored anywhere."""
        blocks = self._acquire(token_ids, salt, tenant)
        if not blocks:
            return None
        try:
            standalone = read_tokens(self.storage, [b.block_id for b in blocks],
                                     token_ids[:len(blocks) * self.block_size])
        finally:
            self.pool.free(reversed(blocks))
        # gathered into fresh tensors: nothing to copy when they stay at position 0
        return standalone if first_position == 0 else standalone.moved_to(first_position, rope)

    # -- inside ----------------------------------------------------------------
    def _device_blocks(self, token_ids: Sequence[int], keys: list[bytes]) -> list[Block]:
        bs, out = self.block_size, []
        for i, key in enumerate(keys):
            block = self.pool.lookup(key, tuple(token_ids[i * bs:(i + 1) * bs]))
            if block is None:
                break
            out.append(block)
        return out

    def _acquire(self, token_ids: Sequence[int], salt: str, tenant: str) -> list[Block]:
        """The segment's leading stored blocks, a reference taken on each: device hits, then
        the run the tiers hold, loaded now (a load that stops early frees its other blocks;
        with no free block to load into, the device hits alone)."""
        keys = self.keys(token_ids, salt, tenant)
        blocks = self._device_blocks(token_ids, keys)
        self.pool.touch(blocks)
        if len(blocks) == len(keys):
            return blocks
        run = self.tiering.lookup(keys[len(blocks):])
        if not run.num_blocks:
            return blocks
        try:
            fresh = self.kv.allocate_unowned(run.num_blocks)
        except NoFreeBlocksError:
            return blocks       # no room to load into: the tail is computed instead
        promotion = self.tiering.load(run, [b.block_id for b in fresh])
        loaded, missed = fresh[:promotion.num_blocks], fresh[promotion.num_blocks:]
        bs, start = self.block_size, len(blocks)
        for i, block in enumerate(loaded, start=start):
            self.pool.cache(block, keys[i], tuple(token_ids[i * bs:(i + 1) * bs]), tenant)
        self.pool.free(reversed(missed))
        return blocks + loaded


def read_tokens(storage: KVStorage, block_ids: list[int], token_ids: Sequence[int]) -> SegmentKV:
    """The stored KV (decoded to the compute dtype) of ``token_ids``, the tokens of slots
    ``0, ...`` of the table ``block_ids``, at positions ``0, ...``."""
    n = len(token_ids)
    table = torch.tensor([block_ids[:-(-n // storage.block_size)]], dtype=torch.long, device=storage.device)
    halves = [storage.gather(layer, table) for layer in range(storage.num_layers)]
    return SegmentKV(tuple(token_ids), 0, tuple(k[0, :n] for k, _ in halves), tuple(v[0, :n] for _, v in halves))


def write_tokens(storage: KVStorage, block_ids: list[int], first_slot: int, keys: Sequence[torch.Tensor],
                 values: Sequence[torch.Tensor]) -> None:
    """Write tokens into slots ``first_slot, ...`` of the table ``block_ids`` (slot s in block
    ``block_ids[s // block_size]``), per layer ``keys[layer]`` [num_tokens, kv_heads, head_dim],
    outside a model step. A format that encodes whole blocks writes through a residual row
    per block touched, so the tokens go in as many passes as free rows allow; the last block
    stays open (in its row) when the tokens end inside it."""
    bs, rows = storage.block_size, storage.residual
    at, end = first_slot, first_slot + keys[0].shape[0]
    while at < end:
        max_blocks = rows.num_free_rows if rows.num_rows else len(block_ids)
        if not max_blocks:
            raise RuntimeError("no residual row is free to write through; write between steps")
        stop = min(end, (at // bs + max_blocks) * bs)
        planner = storage.planner()
        planner.add(block_ids, at, stop - at)
        writes = planner.build()
        lo, hi = at - first_slot, stop - first_slot
        for layer in range(storage.num_layers):
            storage.write(layer, keys[layer][lo:hi], values[layer][lo:hi], writes)
        storage.finish_step(writes)
        at = stop

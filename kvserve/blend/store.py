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

import torch

from kvserve.blend.rope import RopeTables
from kvserve.blend.segment import SegmentKV
from kvserve.kv.block_pool import Block
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix import segment_block_keys
from kvserve.kv.storage import KVStorage


class SegmentStore:
    def __init__(self, kv: KVCacheManager, storage: KVStorage) -> None:
        self.kv = kv
        self.pool = kv.pool
        self.storage = storage
        self.block_size = storage.block_size

    def keys(self, token_ids: Sequence[int]) -> list[bytes]:
        return segment_block_keys(token_ids, self.block_size, self.kv.extra_key)

    def num_cached_blocks(self, token_ids: Sequence[int]) -> int:
        """The segment's leading full blocks on the device now (tiers not asked)."""
        return len(self._device_blocks(token_ids, self.keys(token_ids)))

    def put(self, segment: SegmentKV) -> int:
        """Store a standalone segment's full blocks that are not on the device yet; returns how
        many it wrote. Raises ValueError for a segment not at position 0, NoFreeBlocksError
        when the pool cannot hold it."""
        if segment.first_position != 0:
            raise ValueError(f"only standalone segments (from position 0) are stored; this one starts "
                             f"at {segment.first_position}")
        if segment.num_layers != self.storage.num_layers:
            raise ValueError(f"a segment of {segment.num_layers} layers for a model of {self.storage.num_layers}")
        keys = self.keys(segment.token_ids)
        num_cached = len(self._device_blocks(segment.token_ids, keys))
        if num_cached == len(keys):
            return 0
        per_write = self._max_blocks_per_write()
        blocks = self.kv.allocate_unowned(len(keys) - num_cached)
        bs = self.block_size
        try:
            for first in range(0, len(blocks), per_write):
                chunk = blocks[first:first + per_write]
                start = (num_cached + first) * bs
                self._write(chunk, segment, start, start + len(chunk) * bs)
            for i, block in enumerate(blocks, start=num_cached):
                self.pool.cache(block, keys[i], tuple(segment.token_ids[i * bs:(i + 1) * bs]))
        finally:
            self.pool.free(reversed(blocks))
        return len(blocks)

    def get(self, token_ids: Sequence[int], first_position: int, rope: RopeTables) -> SegmentKV | None:
        """The KV of the segment's leading stored blocks, moved to ``first_position``: from the
        device, then loaded from the offload tiers into fresh blocks (cached there again).
        None when not even its first block is stored anywhere."""
        blocks = self._acquire(token_ids)
        if not blocks:
            return None
        try:
            table = torch.tensor([[b.block_id for b in blocks]], dtype=torch.long, device=self.storage.device)
            halves = [self.storage.gather(layer, table) for layer in range(self.storage.num_layers)]
        finally:
            self.pool.free(reversed(blocks))
        n = len(blocks) * self.block_size
        standalone = SegmentKV(tuple(token_ids[:n]), 0, tuple(k[0] for k, _ in halves), tuple(v[0] for _, v in halves))
        return standalone.moved_to(first_position, rope)

    # -- inside ----------------------------------------------------------------
    def _device_blocks(self, token_ids: Sequence[int], keys: list[bytes]) -> list[Block]:
        bs, out = self.block_size, []
        for i, key in enumerate(keys):
            block = self.pool.lookup(key, tuple(token_ids[i * bs:(i + 1) * bs]))
            if block is None:
                break
            out.append(block)
        return out

    def _acquire(self, token_ids: Sequence[int]) -> list[Block]:
        """The segment's leading stored blocks, a reference taken on each: device hits, then
        the run the tiers hold, loaded now (a load that stops early frees its other blocks)."""
        keys = self.keys(token_ids)
        blocks = self._device_blocks(token_ids, keys)
        self.pool.touch(blocks)
        if len(blocks) == len(keys):
            return blocks
        run = self.kv.tiering.lookup(keys[len(blocks):])
        if not run.num_blocks:
            return blocks
        fresh = self.kv.allocate_unowned(run.num_blocks)
        promotion = self.kv.tiering.load(run, [b.block_id for b in fresh])
        loaded, missed = fresh[:promotion.num_blocks], fresh[promotion.num_blocks:]
        bs, start = self.block_size, len(blocks)
        for i, block in enumerate(loaded, start=start):
            self.pool.cache(block, keys[i], tuple(token_ids[i * bs:(i + 1) * bs]))
        self.pool.free(reversed(missed))
        return blocks + loaded

    def _max_blocks_per_write(self) -> int:
        # a format whose halves encode whole blocks writes through residual rows, one per block
        rows = self.storage.residual
        if not rows.num_rows:
            return self.pool.num_blocks
        if not rows.num_free_rows:
            raise RuntimeError("no residual row is free to write a segment through; store segments between steps")
        return rows.num_free_rows

    def _write(self, blocks: list[Block], segment: SegmentKV, start: int, end: int) -> None:
        planner = self.storage.planner()
        planner.add([b.block_id for b in blocks], 0, end - start)
        writes = planner.build()
        for layer in range(self.storage.num_layers):
            self.storage.write(layer, segment.keys[layer][start:end], segment.values[layer][start:end], writes)
        self.storage.finish_step(writes)

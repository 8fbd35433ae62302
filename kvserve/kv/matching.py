"""Prefix matches: which cached blocks a request's leading tokens find, on the device and
through the offload tiers, in every layer group (kv/groups.py).

A hit of ``end`` blocks needs every full-attention group's blocks 0..end-1 and each sliding
group's blocks from its window's first (for a query at ``end * block_size``) to end-1:

    full     | 0 | 1 | 2 | 3 | 4 | 5 |       end = 6, window 32 tokens, blocks of 16:
    sliding  |   |   |   |   | 4 | 5 |       a query at 96 sees 65..96: blocks 4 and 5
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvserve.kv.block_pool import Block, BlockPool
from kvserve.kv.groups import KVGroup, group_key
from kvserve.kv.tiering import Promotion, Tiering
from kvserve.offload.tiered import EMPTY_RUN, TierRun


class PrefixMatch(NamedTuple):
    """A request's leading blocks: cached on the device (no references taken), then
    found in the offload tiers (not loaded yet). ``group_blocks``: per layer group, the
    hits of its table (a sliding group's entries before its window None)."""

    group_blocks: tuple[list[Block | None], ...]
    num_device_blocks: int = 0
    tier_run: TierRun = EMPTY_RUN
    # several layer groups: the positions the tier run extends the hit to, and where each of its
    # keys goes, (group, position), in run order (``extend_through_tiers``)
    tier_end: int = 0
    tier_slots: tuple[tuple[int, int], ...] = ()

    @property
    def blocks(self) -> list[Block]:
        """The first group's hits (the whole prefix: a full-attention group, or the only one)."""
        return [b for b in self.group_blocks[0] if b is not None] if self.group_blocks else []

    @property
    def num_blocks(self) -> int:
        """Device plus tier blocks: the prompt blocks that need no compute if all load."""
        if self.tier_slots:
            return self.tier_end if self.tier_run.num_blocks else self.num_device_blocks
        return self.num_device_blocks + self.tier_run.num_blocks


EMPTY_MATCH = PrefixMatch(())


class Promoted(NamedTuple):
    """A request's cached prefix once its tier blocks are in: device hits, then loaded blocks."""

    num_device_blocks: int
    promotion: Promotion

    @property
    def num_blocks(self) -> int:
        return self.num_device_blocks + self.promotion.num_blocks


class BlockLookup:
    """The device blocks of one request's leading full blocks, each group's, looked up once."""

    def __init__(self, pool: BlockPool, keys: Sequence[bytes], tokens: Sequence[int], block_size: int) -> None:
        self.pool, self.keys, self.tokens, self.block_size = pool, keys, tokens, block_size
        self._found: dict[tuple[int, int], Block | None] = {}

    def key(self, group: int, i: int) -> bytes:
        return group_key(self.keys[i], group)

    def __call__(self, group: int, i: int) -> Block | None:
        if (group, i) not in self._found:
            bs = self.block_size
            self._found[group, i] = self.pool.lookup(self.key(group, i), tuple(self.tokens[i * bs:(i + 1) * bs]))
        return self._found[group, i]


def longest_hit(groups: Sequence[KVGroup], start: int, limit: int, held: Callable[[int, int], bool],
                block_size: int) -> int:
    """The longest hit ``end`` in [start, limit] whose blocks from ``start`` on are ``held``
    (by group index and position): every full group's, each sliding group's window before it."""
    end = limit
    for g in groups:
        if g.window is None:
            end = next((i for i in range(start, end) if not held(g.index, i)), end)
    while end > start:
        misses = [i for g in groups if g.window is not None
                  for i in range(max(start, g.first_needed_block(end * block_size, block_size)), end)
                  if not held(g.index, i)]
        if not misses:
            break
        end = max(misses)
    return end


def match_device(groups: Sequence[KVGroup], lookup: BlockLookup, limit: int) -> PrefixMatch:
    """The longest hit on the device, of at most ``limit`` blocks."""
    bs = lookup.block_size
    end = longest_hit(groups, 0, limit, lambda g, i: lookup(g, i) is not None, bs)
    if end == 0:
        return EMPTY_MATCH
    return PrefixMatch(tuple([None if i < g.first_needed_block(end * bs, bs) else lookup(g.index, i)
                              for i in range(end)] for g in groups), end)


def extend_through_tiers(groups: Sequence[KVGroup], lookup: BlockLookup, tiering: Tiering, match: PrefixMatch,
                         limit: int, num_free_blocks: int) -> PrefixMatch:
    """``match`` over several groups, continued while every full group's blocks and each sliding
    group's window before the hit's end are on the device or in a tier. The run holds the keys to
    load, position by position (full groups from the device hit on, sliding groups the last
    window), loaded whole or not at all: a part would not hold every window. Device blocks past
    the device hit (a window's) are taken as hits. ``num_free_blocks``: the pool's now (the
    request's allocation gives every position between the device hit and the run's end a block in
    every group, to compute into should the load not complete: a run it cannot hold is not taken,
    else the request would wait for room a computed prefix does not need)."""
    bs, start = lookup.block_size, match.num_device_blocks
    wanted = [(g.index, i) for g in groups for i in range(start, limit) if lookup(g.index, i) is None]
    holders = dict(zip(wanted, tiering.holders([lookup.key(g, i) for g, i in wanted])))
    end = longest_hit(groups, start, limit,
                      lambda g, i: lookup(g, i) is not None or holders.get((g, i)) is not None, bs)
    needed = [(g.index, i) for i in range(start, end) for g in groups if i >= g.first_needed_block(end * bs, bs)]
    slots = tuple(s for s in needed if lookup(*s) is None)
    if not slots or len(groups) * (end - start) > num_free_blocks:
        return match
    run = tiering.choose(TierRun(tuple(lookup.key(g, i) for g, i in slots), tuple(holders[s] or 0 for s in slots)),
                         covers=end - start)
    if not run.num_blocks:
        return match
    tables = tuple(list(blocks) + [lookup(g.index, i) if (g.index, i) in needed else None for i in range(start, end)]
                   for g, blocks in zip(groups, match.group_blocks))
    return PrefixMatch(tables, start, run, end, slots)

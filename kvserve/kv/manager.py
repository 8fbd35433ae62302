"""The KV cache manager: the facade the scheduler talks to.

It owns each request's block table and block keys and speaks to the pool below
it. A request's blocks cover its computed tokens plus the tokens scheduled this
step:

    block table  | b0 | b1 | b2 | b3 |          (block_size = 4)
    tokens       |0123|4567|89ab|cd  |
                  ^^^^^^^^^ cached hit  (num_cached_tokens = 8)
                            ^^^^^^^ computed this step, b2 becomes cacheable

With offload tiers (kv/tiering.py) a match continues below the device:

    keys         | k0 | k1 | k2 | k3 | k4 |
    match        |device   |tiers    |        blocks for k2, k3 are allocated, loaded
                                              from the tiers, then cached like any other

and blocks about to be evicted by an allocation are demoted to the tiers first. The
manager holds the tiering for those two calls only (``lookup``, ``demote``); the
scheduler drives the loads with the tiering itself and hands the loaded blocks back
(``cache_loaded_blocks``).

Blocks are queued for eviction by class (kv/block_pool.py): a request's
``retention_class`` (its ``cache_priority``) goes to the blocks it holds, and keys that a
pin covers (kv/pins.py) wait after every other class. Pinned blocks that an allocation
must evict all the same are demoted through ``Tiering.demote_pinned``, which never drops
them for a full queue.

A model with sliding-window layers has several layer groups (kv/groups.py), each with its own
table per request, over one pool: a full-attention group's table covers the whole context, a
sliding group's only the blocks its window still reaches (older entries are released: None).

    full     | b0 | b1 | b2 | b3 | b4 | b5 |          window 32 tokens, block_size 16,
    sliding  |None|None| c2 | c3 | c4 | c5 |          next query at position 90: blocks 3.. needed

A prefix hit at block P needs every full group's blocks 0..P-1 and each sliding group's blocks
from its window's first (for a query at P * block_size) to P-1. A sliding block leaves a table as
soon as the request's next query no longer sees it; keyed (its key taken before), it stays in the
pool as any freed block, evictable in LRU order. So under pressure a cached prefix loses its
interior sliding blocks first (released earliest) and its tail last: the hit at a prefix's end,
where a conversation continues, is kept longest, and a hit anywhere needs only its own window.

A request under a KV budget (kv/budget/) holds *slots*: after a compaction its table
covers ``num_computed_tokens - num_evicted`` slots; the compaction writes the kept
entries to the head of the table (fresh blocks in place of shared or cached ones, which
are never altered) and frees the tail; from then on its blocks are never cached.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvserve.cache_control import PrefixPin
from kvserve.kv.block_pool import Block, BlockPool
from kvserve.kv.budget.budgets import Budgets, NoBudgets
from kvserve.kv.groups import KVGroup, LayerGroups, group_key
from kvserve.kv.matching import EMPTY_MATCH, BlockLookup, PrefixMatch, Promoted, extend_through_tiers, match_device
from kvserve.kv.pins import PinInfo, Pins
from kvserve.kv.prefix import extend_block_keys, salted_extra_key
from kvserve.kv.residual import NoResidual, ResidualRows
from kvserve.kv.stats import KVStats
from kvserve.kv.tiering import NO_PROMOTION, NoTiering, Promotion, Tiering
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


class KVCacheManager:
    def __init__(self, pool: BlockPool, extra_key: bytes, enable_prefix_caching: bool = True,
                 residual: ResidualRows | None = None, tiering: Tiering | None = None,
                 budgets: Budgets | None = None, pins: Pins | None = None, groups: LayerGroups | None = None,
                 max_chunk_tokens: int = 0) -> None:
        """``groups``: the model's layer groups (default: one group of full attention);
        ``max_chunk_tokens``: the most tokens a step computes for one request (a sliding group
        holds its window's blocks and a chunk's: what ``check_fits`` counts)."""
        self._pool = pool
        # pinned prefixes (none allowed unless the engine gives a limit)
        self._pins = pins if pins is not None else Pins(pool, max_pinned_blocks=0, max_ttl_s=1.0)
        # per-request KV budgets (null object when the engine cannot run them)
        self.budgets = budgets if budgets is not None else NoBudgets("no KV budgets configured")
        # the tiers below the device, for lookups and demotions (null object when none is configured)
        self._tiering = tiering if tiering is not None else NoTiering()
        # the storage's rows of open blocks (a quantized format's; kv/residual.py), freed with their blocks
        self.residual = residual if residual is not None else NoResidual()
        self.block_size = pool.block_size
        self.extra_key = extra_key
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = groups.groups if groups is not None else (KVGroup(0, (), None),)
        self.max_chunk_tokens = max_chunk_tokens
        # per request, per group: its table (a sliding group's entries before its window None)
        self._tables: dict[str, list[list[Block | None]]] = {}
        self._keys: dict[str, list[bytes]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        # per request whose KV no exact computation produced past its first tokens: how many are exact
        self._lossy: dict[str, int] = {}
        # per request admitted with a tier run over several groups: the run's end and slots
        self._tier_loads: dict[str, tuple[int, tuple[tuple[int, int], ...], tuple[int, ...]]] = {}
        # blocks the engine holds for good, no request's (``reserve_block``)
        self._reserved: list[Block] = []

    @property
    def has_windows(self) -> bool:
        """Some group attends over a sliding window (its tables release what the window left)."""
        return any(g.window is not None for g in self.groups)

    # -- what others ask of the pool, the tiers and the pins (kept here) ------
    @property
    def num_blocks(self) -> int:
        """Blocks requests can hold: the pool's, less those reserved (``reserve_block``)."""
        return self._pool.num_blocks - len(self._reserved)

    def reserve_block(self) -> int:
        """One block taken for good by the engine itself, never a request's and never cached:
        where writes that must land somewhere harmless go (the padded rows of a captured decode
        step, engine/graphs.py). ``check_integrity`` counts it; requests can hold one block less.
        Raises NoFreeBlocksError when the pool cannot supply it."""
        block = self._allocate(1, 0)[0]
        self._reserved.append(block)
        return block.block_id

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take: free ones and cached ones no request holds."""
        return self._pool.num_free_blocks

    def cached_keys(self) -> list[bytes]:
        """The content keys of the device's cached blocks (what a router learns a replica holds)."""
        return self._pool.cached_keys()

    def take_peak_used(self) -> int:
        """The most blocks requests held at once since the last call (or the start); starts again."""
        peak = self._pool.peak_num_used
        self._pool.reset_peak()
        return peak

    def stats(self) -> KVStats:
        pool = self._pool
        return KVStats(
            num_blocks=pool.num_blocks, num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_blocks, usage=pool.usage,
            used_blocks_by_kind=tuple(self.used_blocks_by_kind().items()),
            cached_blocks_by_tenant=tuple(sorted(pool.cached_blocks_by_tenant().items())),
            num_evicted_blocks=pool.num_evicted_blocks, tiers=self._tiering.metrics(),
            cost=self._tiering.cost_snapshot(), budgets=self.budgets.stats(), pins=self._pins.stats())

    def expire_pins(self) -> int:
        """Drop the pins past their time; returns how many."""
        return self._pins.expire()

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that mostly prefilled ``num_tokens`` took ``seconds``: the load-or-recompute cost model learns."""
        self._tiering.observe_prefill(num_tokens, seconds)

    def flush_tiers(self) -> None:
        """Wait for the demotions submitted to the tiers."""
        self._tiering.flush()

    def close(self) -> None:
        """Finish pending demotions and release the tiers."""
        self._tiering.close()

    # -- queries -----------------------------------------------------------
    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        """The request's table in ``group``; an entry its window released reads as block 0
        (a kernel never reads it: kvserve/attention/)."""
        tables = self._tables.get(request_id)
        if tables is None:
            return []
        return [0 if b is None else b.block_id for b in tables[group]]

    def num_slots(self, request: Request) -> int:
        """Cache slots the request's computed tokens occupy (fewer than its tokens once
        a KV budget has evicted some)."""
        return request.num_computed_tokens - self.budgets.num_evicted(request.request_id)

    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_held(self, num_tokens: int) -> int:
        """The most blocks a request of ``num_tokens`` tokens holds at once, over every group: a
        sliding group its window's blocks and one chunk's at most."""
        whole = self.num_blocks_needed(num_tokens)
        total = 0
        for g in self.groups:
            if g.window is None:
                total += whole
            else:
                total += min(whole, self.num_blocks_needed(g.window + max(self.max_chunk_tokens, 1)) + 1)
        return total

    def max_request_tokens(self, limit: int) -> int:
        """The most tokens, at most ``limit``, that one request can hold in the pool: the largest
        ``n`` whose ``max_blocks_held(n)`` the pool has (0 when not even one token's)."""
        low, high = 0, limit
        while low < high:       # max_blocks_held grows with n
            mid = (low + high + 1) // 2
            low, high = (mid, high) if self.max_blocks_held(mid) <= self.num_blocks else (low, mid - 1)
        return low

    def used_blocks_by_kind(self) -> dict[str, int]:
        """Blocks running requests hold, per attention kind of their group (full, sliding)."""
        out: dict[str, int] = {}
        for g in self.groups:
            out[g.kind] = out.get(g.kind, 0) + self._pool.num_used_by_tag(g.index)
        return out

    def check_fits(self, params: SamplingParams, num_prompt_tokens: int, max_tokens: int) -> None:
        """ValueError when a request could never run: the most blocks it holds at once (its
        budget's, or all its tokens') is more than the pool has."""
        num_blocks = self.max_blocks_held(num_prompt_tokens + max_tokens)
        budgeted = self.budgets.max_blocks(params, num_prompt_tokens)
        num_blocks = num_blocks if budgeted is None else min(num_blocks, budgeted)
        if num_blocks > self.num_blocks:
            raise ValueError(
                f"request needs up to {num_blocks} KV blocks ({num_prompt_tokens} prompt + {max_tokens} new tokens) "
                f"but the cache has {self.num_blocks}; lower max_tokens or give the KV cache more memory")

    def block_keys(self, request: Request) -> list[bytes]:
        """Keys of the request's full blocks, extended as its tokens grow (the first group's:
        another group's are ``group_key`` of these)."""
        keys = self._keys.setdefault(request.request_id, [])
        extend_block_keys(keys, request.all_token_ids, self.block_size,
                          self.extra_key_for(request.cache_salt, request.tenant))
        return keys

    def match_prefix(self, request: Request) -> PrefixMatch:
        """Longest run of cached blocks holding the request's leading tokens: in every
        full-attention group all its blocks, in a sliding group those its window needs.

        At least one token is always left to compute, since its logits are needed;
        so a prompt of exactly n full blocks matches at most n - 1 of them.
        """
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return EMPTY_MATCH
        return match_device(self.groups, self._lookup(request), (request.num_tokens - 1) // self.block_size)

    def match_tiers(self, request: Request, match: PrefixMatch) -> PrefixMatch:
        """``match`` extended by the run of following blocks the offload tiers hold.

        One lookup per tier (a round trip for Redis), so it is called only for a
        request about to be admitted, not to sort the waiting queue.
        """
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return match
        max_blocks = (request.num_tokens - 1) // self.block_size
        if match.num_device_blocks >= max_blocks:
            return match
        groups = match.group_blocks or tuple([] for _ in self.groups)
        if len(self.groups) > 1 or self.has_windows:
            return extend_through_tiers(self.groups, self._lookup(request), self._tiering,
                                        PrefixMatch(groups, match.num_device_blocks), max_blocks,
                                        self._pool.num_free_blocks)
        keys = self.block_keys(request)
        return PrefixMatch(groups, match.num_device_blocks,
                           self._tiering.lookup(keys[match.num_device_blocks:max_blocks]))

    def _lookup(self, request: Request) -> BlockLookup:
        return BlockLookup(self._pool, self.block_keys(request), request.all_token_ids, self.block_size)

    # -- verbs -------------------------------------------------------------
    def try_allocate(self, request: Request, num_new_tokens: int,
                     match: PrefixMatch = EMPTY_MATCH) -> bool:
        """Give the request blocks for ``num_new_tokens`` more tokens, in every group.

        ``match`` (from ``match_prefix``, for a request being admitted) is taken
        first; its tier blocks get fresh blocks, the first ones allocated
        (``load_targets``), which a tier load fills. Returns False, changing
        nothing, when the pool cannot supply the blocks; the caller must then
        preempt or wait. Cached blocks the allocation evicts are demoted to the
        offload tiers first.
        """
        rid = request.request_id
        tables = self._tables.get(rid)
        if tables is None:
            tables = [list(match.group_blocks[g.index]) if match.group_blocks else [] for g in self.groups]
        num_total = self.num_blocks_needed(self.num_slots(request) + match.num_blocks * self.block_size
                                           + num_new_tokens)
        # a tier run over several groups: its slots get blocks to load into, and so does every
        # position a window skips, to compute into should the load not complete (freed when it does)
        holes = [(g, i) for g, t in enumerate(tables) for i in range(match.num_device_blocks, len(t))
                 if t[i] is None] if match.tier_slots and rid not in self._tables else []
        num_needed = sum(max(0, num_total - len(t)) for t in tables) + len(holes)
        hits = [b for blocks in match.group_blocks for b in blocks if b is not None]
        # hits sitting in the free queue are counted as free but are about to be taken
        num_evictable_hits = sum(1 for b in hits if b.ref_count == 0)
        if num_needed > self._pool.num_free_blocks - num_evictable_hits:
            return False
        if hits:
            self._pool.touch(hits, request.retention_class)
            self._num_cached_blocks[rid] = match.num_device_blocks
        self._tables[rid] = tables
        for g, i in holes:
            tables[g][i] = self._allocate(1, request.retention_class, g)[0]
        if match.tier_slots:
            self._tier_loads[rid] = (match.tier_end, match.tier_slots, match.tier_run.tiers)
        for g, table in enumerate(tables):
            if num_total > len(table):
                table.extend(self._allocate(num_total - len(table), request.retention_class, g))
        self.budgets.start(request)
        return True

    def load_targets(self, request: Request, match: PrefixMatch) -> list[int]:
        """The blocks ``try_allocate`` gave ``match``'s tier blocks, in run order: where a load writes."""
        if match.tier_slots:
            tables = self._tables[request.request_id]
            return [self._held(tables[g][i]).block_id for g, i in match.tier_slots]
        d, t = match.num_device_blocks, match.tier_run.num_blocks
        return self.block_ids(request.request_id)[d:d + t]

    def cache_loaded_blocks(self, request: Request, promotion: Promotion) -> Promoted:
        """Cache the blocks a tier load wrote: the leading ``promotion.num_blocks`` after the
        request's device hits. Those after a load that stopped early stay allocated and are
        computed. Returns the request's cached prefix (device hits, then loaded blocks).
        Over several groups a load counts whole or not at all (``_match_group_tiers``)."""
        rid = request.request_id
        start = self._num_cached_blocks.get(rid, 0)
        if rid in self._tier_loads:
            return Promoted(start, self._cache_group_load(request, start, promotion))
        if promotion.num_blocks:
            self._cache_blocks(request, start, start + promotion.num_blocks)
        return Promoted(start, promotion)

    def _cache_group_load(self, request: Request, start: int, promotion: Promotion) -> Promotion:
        """A tier run over several groups is loaded: whole, the hit reaches the run's end (the
        blocks held in case for the positions a window skips are freed) and the promotion counts
        positions, by their first group's tiers; else nothing of it counts, its blocks computed."""
        end, slots, tiers = self._tier_loads.pop(request.request_id)
        if promotion.num_blocks < len(slots):
            return NO_PROMOTION
        bs = self.block_size
        skipped = []
        for group, table in zip(self.groups, self._tables[request.request_id]):
            for i in range(start, min(end, group.first_needed_block(end * bs, bs))):
                if (block := table[i]) is not None:
                    skipped.append(block)
                    table[i] = None
        self._free_blocks(skipped)
        self._cache_blocks(request, start, end)
        by_tier = [0] * len(promotion.num_blocks_by_tier)
        for (g, _), tier in zip(slots, tiers):
            if g == self.groups[0].index:
                by_tier[tier] += 1
        return Promotion(end - start, tuple(by_tier))

    @staticmethod
    def _held(block: Block | None) -> Block:
        assert block is not None, "a tier slot without its block"
        return block

    def swap_candidates(self, request: Request) -> list[Block]:
        """The request's computed, cached blocks that no other request holds: what a swap
        preemption would demote before the request's blocks are freed."""
        num_cached = self._num_cached_blocks.get(request.request_id, 0)
        return [b for table in self._tables.get(request.request_id, []) for b in table[:num_cached]
                if b is not None and b.ref_count == 1 and b.is_cached]

    def cache_computed_blocks(self, request: Request) -> None:
        """Register every full block whose tokens are all computed; then, in a sliding group,
        release the blocks the request's next query no longer sees (cached first, so they stay
        prefix-cache hits)."""
        rid = request.request_id
        if self.enable_prefix_caching and not self.budgets.is_compacted(rid):
            num_full = request.num_computed_tokens // self.block_size
            if rid in self._lossy:
                num_full = min(num_full, self._lossy[rid] // self.block_size)
            start = self._num_cached_blocks.get(rid, 0)
            if num_full > start:
                self._cache_blocks(request, start, num_full)
                self._tiering.write_through([b for t in self._tables[rid] for b in t[start:num_full] if b is not None])
        if self.has_windows and rid in self._tables:
            self._release_behind_windows(request)

    def _release_behind_windows(self, request: Request) -> None:
        position = self.num_slots(request)          # the next query's
        for g, table in zip(self.groups, self._tables[request.request_id]):
            behind = [i for i in range(min(g.first_needed_block(position, self.block_size), len(table)))
                      if table[i] is not None]
            if behind:
                released = [table[i] for i in behind]
                for i in behind:
                    table[i] = None
                self.residual.release(b.block_id for b in released if b is not None)
                self._free_blocks(b for b in released if b is not None)

    def _cache_blocks(self, request: Request, start: int, end: int) -> None:
        """Register the request's full blocks [start, end) under their content keys, each
        group's under its own, as blocks of its tenant (what a reset scoped to it drops)."""
        keys = self.block_keys(request)
        tokens = request.all_token_ids
        bs = self.block_size
        for g, table in zip(self.groups, self._tables[request.request_id]):
            for i in range(start, end):
                block = table[i]
                if block is not None:
                    self._pool.cache(block, group_key(keys[i], g.index), tuple(tokens[i * bs:(i + 1) * bs]),
                                    request.tenant)
        self._num_cached_blocks[request.request_id] = end

    def _free_blocks(self, blocks: Iterable[Block]) -> None:
        """``pool.free``; a block left with no reader and no content key can never be found
        again: what the storage keeps for its content goes now rather than when it is handed out
        again (``renew``: a zip storage's finer copy, whose side slot the next full block takes)."""
        blocks = list(blocks)
        self._pool.free(blocks)
        self.residual.renew(b.block_id for b in blocks if b.ref_count == 0 and not b.is_cached)

    def _allocate(self, num_blocks: int, retention: int, group: int = 0) -> list[Block]:
        """Take free blocks (for layer group ``group``), demoting to the tiers the cached ones
        this evicts first."""
        evicted = self._pool.peek_evictions(num_blocks)
        pinned = [b for b in evicted if self._pool.is_pinned(b)]
        self._tiering.demote([b for b in evicted if not self._pool.is_pinned(b)] if pinned else evicted)
        if pinned:
            self._tiering.demote_pinned(pinned)
        blocks = self._pool.allocate(num_blocks, retention, group)
        self.residual.renew(b.block_id for b in blocks)
        return blocks

    def allocate_unowned(self, num_blocks: int) -> list[Block]:
        """``num_blocks`` blocks (ref 1 each) that no request's table holds, taken as a request's
        are (evicted blocks demoted first): for KV written outside a request, such as a segment's
        (kvserve/blend/). The caller caches and frees them itself (``pool``) before the next
        ``check_integrity``, which counts only the references of tables. Raises
        NoFreeBlocksError when the pool cannot supply them."""
        return self._allocate(num_blocks, 0)

    def apply_budget(self, request: Request) -> bool:
        """Compact a budgeted request whose context outgrew its budget (kv/budget/budgets.py).

        Where the budgets keep whole blocks (``kept_blocks``: a ``zip:`` format) the table keeps
        those and frees the rest (``_keep_blocks``). Else its table keeps as many blocks as the
        kept slots need; a block there that another request holds or that has a content key is
        replaced by a fresh one (the kept entries were gathered first), so shared and cached
        blocks are never altered and stay prefix-cache hits; the blocks after them are freed,
        tail first. A rewritten block never gets a key (the request caches nothing once
        compacted). Returns False, changing nothing, when no compaction is due or the pool lacks
        the fresh blocks (it is tried again after the next step). Budgets run on models of one
        full-attention group only (engine/checks.py).
        """
        rid = request.request_id
        if self.budgets.get(rid) is None:
            return False
        self.budgets.settle(request, self._table(rid))
        target = self.budgets.target_slots(request)
        if target is None:
            return False
        table = self._table(rid)
        kept = self.budgets.kept_blocks(request, [b.block_id for b in table])
        if kept is not None:
            self._keep_blocks(request, kept)
            return True
        num_kept = self.num_blocks_needed(target)
        head, tail = table[:num_kept], table[num_kept:]
        fresh = frozenset(i for i, b in enumerate(head) if b.ref_count > 1 or b.is_cached)
        if len(fresh) > self._pool.num_free_blocks + sum(1 for b in tail if b.ref_count == 1):
            return False
        plan = self.budgets.plan(request, [b.block_id for b in table], fresh)
        self.residual.release(b.block_id for b in tail)       # (the open block is among them)
        self._free_blocks(reversed(tail))
        for i in sorted(fresh):     # the blocks the plan was told it rewrites, exactly
            head[i] = self._allocate(1, request.retention_class)[0]
            self._free_blocks([table[i]])
        self._tables[rid][0] = list(head)
        self._num_cached_blocks.pop(rid, None)
        self.budgets.apply(request, plan, [b.block_id for b in head])
        return True

    def _table(self, request_id: str) -> list[Block]:
        """The request's one table, whole (a model of one full-attention group: what budgets run on)."""
        tables = self._tables[request_id]
        assert len(tables) == 1 and all(b is not None for b in tables[0]), "budgets need one whole table"
        return [b for b in tables[0] if b is not None]

    def _keep_blocks(self, request: Request, kept: list[int]) -> None:
        """A compaction that keeps whole blocks (``Budgets.kept_blocks``): the table keeps the
        blocks at ``kept``, in that order, and frees the others, tail first; nothing is written,
        so a kept block another request holds or the prefix cache knows stays as it is."""
        rid = request.request_id
        table = self._table(rid)
        keep = set(kept)
        dropped = [b for i, b in enumerate(table) if i not in keep]
        assert all(self.residual.row_of(b.block_id) is None for b in dropped), "an open block dropped"
        self._tables[rid][0] = [table[i] for i in kept]
        self._free_blocks(reversed(dropped))
        self._num_cached_blocks.pop(rid, None)
        self.budgets.apply_blocks(request, kept, self.block_ids(rid))

    def mark_lossy(self, request: Request, num_exact_tokens: int = 0) -> None:
        """The request's KV from token ``num_exact_tokens`` on was not produced by an exact
        computation (a blended prompt, kvserve/blend/: from its first reused segment on): only
        its full blocks before that token are ever cached, until its blocks are freed (a
        preempted request is recomputed exactly)."""
        self._lossy[request.request_id] = num_exact_tokens

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first across its groups (see BlockPool.free)."""
        rid = request.request_id
        self._lossy.pop(rid, None)
        self._tier_loads.pop(rid, None)
        self.budgets.drop(rid)
        tables = self._tables.pop(rid, [])
        self._release_tails(tables, 0)
        self._num_cached_blocks.pop(rid, None)

    def _release_tails(self, tables: Sequence[list[Block | None]], keep: int) -> None:
        """Free every table's blocks past its first ``keep``, tail first across the tables (the
        last position of every group before the one before it), and truncate the tables."""
        tails = [b for i in range(max(map(len, tables), default=0) - 1, keep - 1, -1)
                 for t in tables if i < len(t) and (b := t[i]) is not None]
        for t in tables:
            del t[keep:]
        self.residual.release(b.block_id for b in tails)
        self._free_blocks(tails)

    def release_unused_blocks(self, request: Request, since: int = 0) -> None:
        """After a drafted chunk starting at position ``since`` was checked: give back the
        residual rows of its blocks now full of computed tokens (kept while their drafted tokens
        were unchecked: kv/storage/base.py), and free the request's blocks past its computed
        tokens' (allocated for drafted tokens that were rejected), tail first."""
        tables = self._tables.get(request.request_id, [])
        first, last = since // self.block_size, self.num_slots(request) // self.block_size
        self.residual.release(b.block_id for t in tables for b in t[first:last] if b is not None)
        self._release_tails(tables, self.num_blocks_needed(self.num_slots(request)))

    def forget(self, request: Request) -> None:
        """Drop per-request state of a finished request."""
        self.free(request)
        self._keys.pop(request.request_id, None)

    def reset_prefix_cache(self, tenant: str | None = None) -> int:
        """Drop the content keys of every unreferenced cached block, or of ``tenant``'s only
        (kv/block_pool.evict_cached); returns how many."""
        return self._pool.evict_cached(tenant)

    # -- pins --------------------------------------------------------------
    def extra_key_for(self, salt: str, tenant: str = "") -> bytes:
        """The extra key of requests in cache namespace (``tenant``, ``salt``) (kv/prefix.salted_extra_key)."""
        return salted_extra_key(self.extra_key, salt, tenant)

    def prefix_keys(self, token_ids: Sequence[int], num_tokens: int | None = None, salt: str = "",
                    tenant: str = "") -> list[bytes]:
        """Keys of the full blocks among the first ``num_tokens`` tokens (all by default): the
        first group's, then of every other group those a hit at the prefix's end needs (a
        sliding group's window before it), so a pin keeps the whole hit."""
        keys: list[bytes] = []
        extend_block_keys(keys, token_ids[:num_tokens], self.block_size, self.extra_key_for(salt, tenant))
        out = list(keys)
        for g in self.groups[1:]:
            first = g.first_needed_block(len(keys) * self.block_size, self.block_size)
            out += [group_key(k, g.index) for k in keys[first:]]
        return out

    def pin(self, token_ids: Sequence[int], prefixes: Sequence[tuple[int | None, float]],
            salt: str = "", tenant: str = "") -> list[PinInfo]:
        """Pin the full blocks of each ``(num_tokens, ttl_s)`` prefix of ``token_ids`` in cache
        namespace (``tenant``, ``salt``) (all or none; Pins.pin's errors)."""
        if not self.enable_prefix_caching:
            raise ValueError("pinning needs prefix caching, which is off on this engine")
        bs = self.block_size
        return self._pins.pin([(self.prefix_keys(token_ids, n, salt, tenant), ttl_s) for n, ttl_s in prefixes], salt,
                             [len(token_ids[:n]) // bs * bs for n, _ in prefixes], tenant)

    def pin_prefixes(self, token_ids: Sequence[int], pins: Sequence[PrefixPin], skip_short: bool,
                     salt: str = "", tenant: str = "") -> list[PinInfo]:
        """Pin each ``PrefixPin`` of a prompt (all or none). ValueError for a prefix longer than
        the prompt, and for one shorter than a block unless ``skip_short`` (a request's pins:
        such a prefix pins nothing, as a prompt too short to cache is not cached)."""
        prefixes: list[tuple[int | None, float]] = []
        for p in pins:
            n = len(token_ids) if p.num_tokens is None else p.num_tokens
            if n > len(token_ids):
                raise ValueError(f"a pin covers {n} tokens, but the prompt has {len(token_ids)}")
            if n >= self.block_size:
                prefixes.append((n, p.ttl_s))
            elif not skip_short:
                raise ValueError(f"nothing to pin: the prefix has {n} tokens, fewer than one block of "
                                 f"{self.block_size}")
        return self.pin(token_ids, prefixes, salt, tenant) if prefixes else []

    def unpin(self, token_ids: Sequence[int], salt: str = "", tenant: str = "") -> PinInfo:
        """Remove the pin over exactly the full blocks of ``token_ids`` in namespace (``tenant``,
        ``salt``) (PinNotFoundError)."""
        return self._pins.unpin(self.prefix_keys(token_ids, salt=salt, tenant=tenant))

    def unpin_all(self, tenant: str | None = None) -> list[PinInfo]:
        """Remove every pin of ``tenant`` (any salt; None: every pin)."""
        return self._pins.unpin_all(tenant)

    def list_pins(self, tenant: str | None = None) -> list[PinInfo]:
        """Every live pin of ``tenant`` (None: all; expired ones dropped first), soonest to expire first."""
        self._pins.expire()
        return self._pins.infos(tenant)

    def num_pinned_hits(self, request: Request, num_blocks: int) -> int:
        """How many of the request's first ``num_blocks`` blocks (its first group's) hold pinned keys."""
        tables = self._tables.get(request.request_id, [[]])
        return sum(b is not None and self._pool.is_pinned(b) for b in tables[0][:num_blocks])

    def check_integrity(self) -> None:
        self._pool.check_integrity()
        self._pins.check_integrity()
        self._tiering.check_integrity()
        self.residual.check_integrity()
        self.budgets.check_integrity()
        counted = {b.block_id: 1 for b in self._reserved}
        for tables in self._tables.values():
            assert len(tables) == len(self.groups), "a table per group"
            for g, table in zip(self.groups, tables):
                if g.window is None:
                    assert all(b is not None for b in table), f"a full-attention group's table has a hole: {table}"
                for block in table:
                    if block is not None:
                        counted[block.block_id] = counted.get(block.block_id, 0) + 1
        for block in self._pool.blocks:
            assert block.ref_count == counted.get(block.block_id, 0), (
                f"{block}: ref_count {block.ref_count} but in {counted.get(block.block_id, 0)} tables")

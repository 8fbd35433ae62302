"""The KV manager (and the scheduler) with offload tiers, on a fake tier: exact block ids, no model."""

from __future__ import annotations

from collections.abc import Sequence

from kvserve.config import SchedulerConfig
from kvserve.kv.block_pool import Block, BlockPool
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix import make_extra_key
from kvserve.kv.tiering import PendingLoad, Promotion, Tiering
from kvserve.offload.tiered import PendingFetch, TierRun
from kvserve.request import FinishReason, Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import Scheduler


class FakeTier(Tiering):
    """One tier holding keys; records demotions (block id, key) as the manager makes them."""

    tier_names = ("fake",)

    def __init__(self, pool: BlockPool, corrupt: frozenset[bytes] = frozenset(), prefetch: bool = False) -> None:
        super().__init__()
        self.pool = pool
        self.prefetch = prefetch
        self.held: set[bytes] = set()
        self.corrupt = corrupt
        self.demoted: list[tuple[int, bytes]] = []
        self.loaded: list[tuple[int, bytes]] = []

    def demote(self, blocks: Sequence[Block]) -> int:
        for b in blocks:
            assert b.key is not None and b.ref_count == 0    # still intact: not reused yet
            self.demoted.append((b.block_id, b.key))
            self.held.add(b.key)
        return len(blocks)

    def lookup(self, keys: Sequence[bytes]) -> TierRun:
        n = next((i for i, k in enumerate(keys) if k not in self.held), len(keys))
        return TierRun(tuple(keys[:n]), (0,) * n)

    def is_prefetch(self, run: TierRun) -> bool:
        return self.prefetch and run.num_blocks > 0

    def _submit(self, run: TierRun, block_ids: list[int]) -> PendingLoad:
        return PendingLoad(PendingFetch(run, {}), block_ids)

    def _write(self, pending: PendingLoad) -> Promotion:
        keys = pending.fetch.run.keys
        n = next((i for i, k in enumerate(keys) if k in self.corrupt), len(keys))
        self.loaded += list(zip(pending.block_ids[:n], keys[:n]))
        return Promotion(n, (n,))


def make(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(), arrival_seq=0)


def setup(num_blocks: int = 6, corrupt: frozenset[bytes] = frozenset()) -> tuple[KVCacheManager, FakeTier]:
    pool = BlockPool(num_blocks, 4)
    tier = FakeTier(pool, corrupt)
    return KVCacheManager(pool, make_extra_key("m", "native"), tiering=tier), tier


def admit(kv: KVCacheManager, req: Request) -> int:
    """What the scheduler does; returns the tokens served from cache (device + tier)."""
    match = kv.match_tiers(req, kv.match_prefix(req))
    assert kv.try_allocate(req, req.num_tokens - match.num_blocks * kv.block_size, match)
    promotion = kv._tiering.load(match.tier_run, kv.load_targets(req, match))
    hit = kv.cache_loaded_blocks(req, promotion).num_blocks * kv.block_size
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)
    return hit


def test_peek_evictions_lists_the_cached_blocks_allocate_would_take():
    pool = BlockPool(5, 4)
    a, b, c = pool.allocate(3)
    pool.cache(a, b"a" * 32, (0, 1, 2, 3))
    pool.cache(c, b"c" * 32, (4, 5, 6, 7))
    pool.free([c, b, a])                            # queue: b (no key: the head), 3, 4, c, a
    assert pool.peek_evictions(3) == []
    assert pool.peek_evictions(4) == [c]
    assert pool.peek_evictions(9) == [c, a]
    assert pool.free_queue.block_ids() == [1, 3, 4, 2, 0]   # unchanged
    pool.check_integrity()


def test_evicted_blocks_are_demoted_before_reuse_and_come_back_from_the_tier():
    kv, tier = setup()
    a = make("a", list(range(12)) + [99])           # 3 full blocks + 1 token
    admit(kv, a)
    kv.free(a)                                      # queue: 4, 5, 3, 2, 1, 0
    keys_a = list(kv.block_keys(a))
    b = make("b", [100 + i for i in range(20)])     # 5 blocks: takes 4, 5, 3, 2, 1
    admit(kv, b)
    assert tier.demoted == [(2, keys_a[2]), (1, keys_a[1])]
    kv.free(b)
    kv.forget(b)
    a2 = make("a2", list(range(12)) + [7])
    # block 0 is still on the device; blocks 1 and 2 come from the tier into fresh blocks
    assert admit(kv, a2) == 12
    loaded_ids = [bid for bid, _ in tier.loaded]
    assert [k for _, k in tier.loaded] == keys_a[1:3]
    assert kv.block_ids("a2")[:3] == [0, *loaded_ids]
    assert all(kv._pool.lookup(k, tuple(range(4 * i, 4 * i + 4))) is not None for i, k in enumerate(keys_a))
    kv.check_integrity()


def test_a_corrupt_block_ends_the_run_and_the_rest_is_computed():
    kv, tier = setup()
    a = make("a", list(range(12)) + [99])
    admit(kv, a)
    keys_a = list(kv.block_keys(a))
    kv.free(a)
    kv.forget(a)
    b = make("b", [100 + i for i in range(23)])
    admit(kv, b)                                           # 6 blocks: every cached block evicted
    assert [k for _, k in tier.demoted] == keys_a[::-1]
    kv.forget(b)
    tier.corrupt = frozenset({keys_a[1]})
    a2 = make("a2", list(range(12)) + [7])
    assert admit(kv, a2) == 4                              # block 0 loaded, block 1 corrupt: stop
    assert [k for _, k in tier.loaded] == keys_a[:1]
    assert kv._pool.lookup(keys_a[1], (4, 5, 6, 7)) is not None   # recomputed, then cached
    kv.check_integrity()


def test_a_prefetched_load_is_held_by_the_tiering_until_the_scheduler_finishes_or_drops_it():
    kv, tier = setup(num_blocks=8)
    tier.prefetch = True
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=4), kv, tier)
    a = make("a", list(range(12)) + [99])
    admit(kv, a)
    keys_a = list(kv.block_keys(a))
    kv.forget(a)
    kv.reset_prefix_cache()                      # off the device (free queue: 3 4 5 6 7 2 1 0) ...
    tier.held.update(keys_a)                     # ... and in the tier
    a2, doomed = make("a2", list(range(12)) + [7]), make("doomed", list(range(8)) + [5])
    sched.add(a2)
    sched.add(doomed)
    out = sched.schedule()
    assert out.is_empty and sched.loading == [a2, doomed]
    assert tier.loading_request_ids() == {"a2", "doomed"}
    assert kv.block_ids("a2") == [3, 4, 5] and kv.block_ids("doomed") == [6, 7]   # blocks for the hits only
    sched.check_integrity()
    sched.finish(doomed, FinishReason.ABORT)     # its load is dropped with its blocks
    assert tier.loading_request_ids() == {"a2"}
    sched.check_integrity()
    out = sched.schedule()                       # the fake's reads are done: a2 starts after its hits
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("a2", 1)]
    assert a2.status is RequestStatus.RUNNING and a2.num_cached_tokens == 12
    assert tier.loaded == list(zip([3, 4, 5], keys_a))
    assert tier.loading_request_ids() == frozenset() and sched.loading == []
    assert (sched.num_prefix_query_tokens, sched.num_prefix_hit_tokens) == (13, 0)
    sched.check_integrity()
    kv.check_integrity()

from __future__ import annotations

from kvserve.kv.block_pool import BlockPool
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix import make_extra_key
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


def make(rid: str, tokens: list[int], seq: int = 0, **params) -> Request:
    return Request(rid, tokens, SamplingParams(**params), arrival_seq=seq)


def manager(num_blocks: int = 11, block_size: int = 16) -> KVCacheManager:
    return KVCacheManager(BlockPool(num_blocks, block_size), make_extra_key("m", "native"))


def run_prefill(kv: KVCacheManager, req: Request) -> None:
    match = kv.match_prefix(req)
    hit = match.num_blocks * kv.block_size
    assert kv.try_allocate(req, req.num_tokens - hit, match)
    req.num_computed_tokens = req.num_tokens
    kv.cache_computed_blocks(req)


def test_prefix_hit_shares_blocks_and_leaves_one_token_to_compute():
    kv = manager()
    a = make("a", list(range(40)))           # 2 full blocks + 8 tokens
    run_prefill(kv, a)
    assert kv.block_ids("a") == [0, 1, 2]
    assert kv.stats().num_cached_blocks == 2
    b = make("b", list(range(32)) + [99] * 5)
    match = kv.match_prefix(b)
    assert [blk.block_id for blk in match.blocks] == [0, 1]
    run_prefill(kv, b)
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv._pool.blocks[i].ref_count for i in (0, 1, 2, 3)] == [2, 2, 1, 1]
    # exactly two full blocks: only the first can be a hit, the last token needs logits
    c = make("c", list(range(32)))
    assert kv.match_prefix(c).num_blocks == 1
    kv.check_integrity()


def test_free_is_tail_first_so_tail_is_evicted_before_head():
    kv = manager(num_blocks=6, block_size=4)
    a = make("a", list(range(12)))
    run_prefill(kv, a)          # blocks 0, 1, 2, all cached
    kv.free(a)
    assert kv._pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    b = make("b", [100 + i for i in range(16)])
    run_prefill(kv, b)          # needs 4 blocks: takes 3, 4, 5 and evicts block 2 (a's tail)
    assert kv.block_ids("b") == [3, 4, 5, 2]
    a2 = make("a2", list(range(12)) + [7])
    assert [blk.block_id for blk in kv.match_prefix(a2).blocks] == [0, 1]
    kv.check_integrity()


def test_allocation_failure_changes_nothing():
    kv = manager(num_blocks=3, block_size=4)
    a = make("a", list(range(8)))
    run_prefill(kv, a)
    b = make("b", list(range(8)) + list(range(50, 58)))
    match = kv.match_prefix(b)
    assert match.num_blocks == 2
    assert not kv.try_allocate(b, 8, match)      # needs 2 more, 1 free
    assert kv.block_ids("b") == []
    assert [kv._pool.blocks[i].ref_count for i in range(3)] == [1, 1, 0]
    kv.check_integrity()


def test_hits_in_free_queue_are_not_counted_as_free_for_the_rest():
    kv = manager(num_blocks=3, block_size=4)
    a = make("a", list(range(8)))
    run_prefill(kv, a)
    kv.free(a)                                   # blocks 0, 1 cached and free
    b = make("b", list(range(8)) + [9] * 6)      # hits 0, 1; needs 2 more, only 1 left
    match = kv.match_prefix(b)
    assert match.num_blocks == 2
    assert not kv.try_allocate(b, 6, match)
    assert kv._pool.lookup(match.blocks[0].key, tuple(range(4))) is not None
    kv.check_integrity()


def test_prefix_caching_off_and_prompt_logprobs_never_match():
    kv = KVCacheManager(BlockPool(8, 4), make_extra_key("m", "native"), enable_prefix_caching=False)
    a = make("a", list(range(9)))
    run_prefill(kv, a)
    assert kv.stats().num_cached_blocks == 0
    kv2 = manager(8, 4)
    run_prefill(kv2, make("a", list(range(9))))
    assert kv2.match_prefix(make("b", list(range(9)), prompt_logprobs=1)).num_blocks == 0
    assert kv2.match_prefix(make("c", list(range(9)))).num_blocks == 2


def test_generated_tokens_fill_and_cache_blocks():
    kv = manager(8, 4)
    a = make("a", [1, 2, 3])
    run_prefill(kv, a)
    for t in (4, 5, 6):
        a.append_token(t)
        assert kv.try_allocate(a, 1)
        a.num_computed_tokens += 1
        kv.cache_computed_blocks(a)
    # tokens 1..6 computed -> 1 full block cached
    assert kv.stats().num_cached_blocks == 1
    b = make("b", [1, 2, 3, 4, 5])
    assert [blk.block_id for blk in kv.match_prefix(b).blocks] == [0]

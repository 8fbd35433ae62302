from __future__ import annotations

import pytest

from kvserve.config import SchedulerConfig
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.prefix import make_extra_key
from kvserve.request import FinishReason, Request, RequestStatus
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.policies import POLICIES, LongestPrefixMatch, Priority
from kvserve.scheduler.scheduler import Scheduler


def make(rid: str, tokens: list[int], seq: int, priority: int = 0) -> Request:
    return Request(rid, tokens, SamplingParams(), arrival_seq=seq, priority=priority)


def scheduler(num_blocks: int = 32, block_size: int = 4, whole_blocks: bool = False, **cfg) -> Scheduler:
    kv = KVCacheManager(BlockPool(num_blocks, block_size), make_extra_key("m", "native"))
    return Scheduler(SchedulerConfig(**cfg), kv, whole_blocks=whole_blocks)


def step(s: Scheduler, sampled: int = 7) -> list[tuple[str, int]]:
    """Schedule, pretend the model ran, append a token to completed sequences."""
    out = s.schedule()
    done = [c.request for c in out.chunks if c.completes_sequence]
    s.update(out)
    for req in done:
        req.append_token(sampled)
    return [(c.request.request_id, c.num_new_tokens) for c in out.chunks]


def test_token_budget_chunks_prefills_and_decodes_go_first():
    s = scheduler(max_num_batched_tokens=10, policy="fcfs")
    s.add(make("a", list(range(13)), 0))
    s.add(make("b", list(range(100, 105)), 1))
    assert step(s) == [("a", 10)]
    assert step(s) == [("a", 3), ("b", 5)]
    assert step(s) == [("a", 1), ("b", 1)]    # both decode in one step


def test_under_a_whole_block_format_chunks_end_on_block_boundaries():
    """The budget of 10 as above, blocks of 4: a chunk short of its prompt's end stops at a block
    boundary; a request whose next boundary the budget left does not reach waits a step."""
    s = scheduler(max_num_batched_tokens=10, policy="fcfs", whole_blocks=True)
    s.add(make("a", list(range(13)), 0))
    s.add(make("b", list(range(100, 115)), 1))
    assert step(s) == [("a", 8)]                    # not 10: 8 is the last boundary within it
    assert step(s) == [("a", 5), ("b", 4)]          # a's end; b up to its first boundary (5 left)
    assert step(s) == [("a", 1), ("b", 8)]
    assert step(s) == [("a", 1), ("b", 3)]          # b's end needs no boundary
    # what is left of the budget reaches no boundary of b's: b is not admitted yet
    w = scheduler(max_num_batched_tokens=6, policy="fcfs", whole_blocks=True)
    w.add(make("a", list(range(7)), 0))
    w.add(make("b", list(range(100, 109)), 1))
    assert [step(w) for _ in range(4)] == [[("a", 4)], [("a", 3)], [("a", 1), ("b", 4)], [("a", 1), ("b", 5)]]
    # a budget below one block cannot align: chunks are cut as without the format
    tiny = scheduler(max_num_batched_tokens=3, policy="fcfs", whole_blocks=True)
    tiny.add(make("c", list(range(7)), 0))
    assert [step(tiny) for _ in range(3)] == [[("c", 3)], [("c", 3)], [("c", 1)]]


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = scheduler(max_num_batched_tokens=10, policy="fcfs", enable_chunked_prefill=False)
    s.add(make("a", list(range(8)), 0))
    s.add(make("b", list(range(100, 105)), 1))
    assert step(s) == [("a", 8)]
    assert step(s) == [("a", 1), ("b", 5)]


def test_lpm_admits_the_longest_cached_prefix_first():
    s = scheduler(max_num_batched_tokens=64, policy="lpm")
    s.add(make("warm", list(range(20)), 0))
    step(s)
    s.finish(s.running[0], FinishReason.STOP)
    s.add(make("cold", list(range(100, 120)), 1))
    s.add(make("hit", list(range(16)) + [99, 98], 2))
    assert step(s) == [("hit", 2), ("cold", 20)]
    assert s.running[0].num_cached_tokens == 16


def test_lpm_starved_request_goes_first():
    s = scheduler(max_num_batched_tokens=8, policy="lpm", max_wait_steps=2, max_num_seqs=1)
    s.add(make("warm", list(range(20)), 0))
    while s.running or s.waiting:
        if s.running and s.running[0].num_computed_tokens == 20:
            s.finish(s.running[0], FinishReason.STOP)
            break
        step(s)
    s.add(make("cold", list(range(100, 106)), 1))
    s.add(make("hit1", list(range(16)) + [1], 2))
    assert step(s) == [("hit1", 1)]          # cached prefix first; cold waits
    s.finish(s.running[0], FinishReason.STOP)
    s.add(make("hit2", list(range(16)) + [2], 3))
    assert s.waiting[0].waited_steps == 1
    step(s)                                   # hit2 admitted, cold waited 2 steps now
    s.finish(s.running[0], FinishReason.STOP)
    s.add(make("hit3", list(range(16)) + [3], 4))
    assert step(s) == [("cold", 6)]           # starvation guard beats the hit


def test_priority_order_and_victim():
    s = scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64, policy="priority")
    s.add(make("low", list(range(7)), 0, priority=5))
    s.add(make("high", list(range(10, 17)), 1, priority=0))
    assert step(s) == [("high", 7), ("low", 7)]
    assert step(s) == [("high", 1), ("low", 1)]   # 8 tokens each: still 2 blocks each
    # the next decode of each needs a third block; only one can have it
    out = s.schedule()
    assert [r.request_id for r in out.preempted] == ["low"]
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("high", 1)]
    low = s.waiting[0]
    assert low.status is RequestStatus.WAITING and low.num_computed_tokens == 0
    assert low.num_preemptions == 1
    s.kv.check_integrity()


def test_max_num_seqs_limits_running():
    s = scheduler(max_num_seqs=2, policy="fcfs")
    for i in range(3):
        s.add(make(str(i), [i] * 3, i))
    assert [rid for rid, _ in step(s)] == ["0", "1"]
    assert [r.request_id for r in s.waiting] == ["2"]


def test_policies_by_name_and_their_traits():
    assert list(POLICIES) == ["fcfs", "priority", "lpm"]
    assert isinstance(scheduler(policy="lpm").policy, LongestPrefixMatch)
    assert [p.uses_cache_lookup for p in POLICIES.values()] == [False, False, True]
    prio = Priority(SchedulerConfig(policy="priority"))
    assert prio.victim_key(make("a", [1], 3, priority=2)) > prio.victim_key(make("b", [1], 9, priority=1))
    with pytest.raises(ValueError, match="unknown scheduling policy 'random'; choose one of"):
        scheduler(policy="random")

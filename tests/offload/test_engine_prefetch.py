"""Prefetch from slow tiers, the load-or-recompute decision, swap preemption (engine level)."""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence

import pytest
from tiers_util import (
    GREEDY,
    MIB,
    POOL,
    PROMPT,
    PROMPT_HIT,
    TickTimer,
    cold_batch,
    cold_tokens,
    evict_everything,
    offload,
)
from tiny import tiny_model

from kvserve import LLM, SamplingParams
from kvserve.kv.block_io import block_nbytes
from kvserve.offload import HostConfig
from kvserve.offload.host import HostTransport

OTHER = [(7 * i) % 128 for i in range(20)]     # shares nothing with PROMPT


@pytest.fixture(scope="module")
def loaded():
    return tiny_model()


class GatedTier(HostTransport):
    """A memory tier whose reads wait for ``gate``, so it is prefetched (not loaded at admission)."""

    name = "gated"
    loads_synchronously = False

    def __init__(self) -> None:
        super().__init__(HostConfig(capacity_bytes=1 << 24))
        self.gate = threading.Event()
        self.gate.set()

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        assert self.gate.wait(30)
        return super().get_many(keys)


class SlowTier(HostTransport):
    """A memory tier whose every read ticks ``timer`` 20 times (20 ms on a TickTimer):
    prefetched, and unknown to the cost model until its first read is measured."""

    name = "slow"
    loads_synchronously = False
    prior_read_latency_s = 0.0
    prior_read_bytes_per_s = math.inf

    def __init__(self, timer: TickTimer) -> None:
        super().__init__(HostConfig(capacity_bytes=1 << 24))
        self.timer = timer

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        for _ in range(20):
            self.timer()
        return super().get_many(keys)


def test_a_request_waits_for_its_own_blocks_while_others_run(loaded):
    tier = GatedTier()
    with LLM(loaded=loaded, num_kv_blocks=POOL, tiers=[tier]) as llm:
        engine = llm.engine
        llm.generate(PROMPT, GREEDY)
        evict_everything(llm)
        tier.gate.clear()
        a = engine.add_request(PROMPT, GREEDY)
        doomed = engine.add_request(PROMPT[:40] + [1, 2, 3], GREEDY)     # loads, then is aborted
        b = engine.add_request(OTHER, GREEDY)
        done = {}
        for _ in range(100):                    # b runs to the end while a's reads are held
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
            if b in done:
                break
        assert b in done and a not in done
        assert engine.stats().num_loading == 2
        engine.abort(doomed)
        engine.check_integrity()
        tier.gate.set()
        while engine.has_unfinished:
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out
        assert done[a].num_cached_tokens == PROMPT_HIT
        assert [done[a].token_ids, done[b].token_ids] == cold_batch(loaded, [PROMPT, OTHER])
        assert engine.stats().num_loading == 0
        engine.check_integrity()


# Steps of at most 16 tokens, each timed one tick by a TickTimer: four blocks recompute in
# four ticks; a host read (no ticks inside) loads them in one, the slow tier in 21.
TIMED = {"num_kv_blocks": POOL, "max_num_batched_tokens": 16}


def test_a_slow_tier_is_measured_then_not_used(loaded):
    timer = TickTimer()
    with LLM(loaded=loaded, tiers=[SlowTier(timer)], timer=timer, **TIMED) as llm:
        llm.generate(PROMPT, GREEDY)
        evict_everything(llm, seed=1)
        first = llm.generate(PROMPT, GREEDY)[0]
        assert first.num_cached_tokens == PROMPT_HIT        # unmeasured: loaded, and so measured
        evict_everything(llm, seed=2)
        again = llm.generate(PROMPT, GREEDY)[0]
        assert again.num_cached_tokens == 0                   # 21 ticks to load vs 4 to compute
        assert again.token_ids == first.token_ids == cold_tokens(loaded)
        cost = llm.engine.stats().cost
        assert cost is not None and cost.prefill_tokens_per_s is not None
        (slow,) = cost.tiers
        assert slow.is_measured and slow.load_seconds(4, block_nbytes(llm.engine.runner.cache.block_tensors())) == (
            pytest.approx(0.021))
        assert (cost.runs_loaded, cost.runs_cut, cost.blocks_recomputed) == (1, 1, 4)


def test_a_fast_host_tier_stays_in_use(loaded):
    with LLM(loaded=loaded, host_cache_gb=MIB, timer=TickTimer(), **TIMED) as llm:
        for seed in range(3):
            llm.generate(PROMPT, GREEDY)
            evict_everything(llm, seed=seed)
        assert llm.generate(PROMPT, GREEDY)[0].num_cached_tokens == PROMPT_HIT
        cost = llm.engine.stats().cost
        assert cost is not None and (cost.runs_loaded, cost.runs_cut) == (3, 0) and cost.tiers[0].is_measured
        assert cost.prefill_tokens_per_s == pytest.approx(16_000)          # 16 tokens a tick


def test_swap_preemption_demotes_the_victim_and_it_comes_back(loaded):
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    prompts = [PROMPT[:40], OTHER + OTHER]                # each grows to 7 of the 8 blocks
    with LLM(loaded=loaded, num_kv_blocks=POOL, host_cache_gb=MIB, max_num_batched_tokens=32) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.num_swapped_blocks > 0
        assert sum(o.num_preemptions for o in outs) == stats.num_preemptions
        assert stats.recompute_tokens_avoided > 0            # the victim's blocks came back from host
        assert [o.token_ids for o in outs] == cold_batch(loaded, prompts, params=params)
        assert offload(llm).store.tiers[0].store.stats().blocks_written >= stats.num_swapped_blocks
        llm.engine.check_integrity()


def test_tier_figures_reach_the_server_metrics(loaded):
    from kvserve.server.metrics import ServerMetrics

    with LLM(loaded=loaded, num_kv_blocks=POOL, host_cache_gb=MIB) as llm:
        llm.generate(PROMPT, GREEDY)
        evict_everything(llm)
        llm.generate(PROMPT, GREEDY)
        metrics = ServerMetrics()
        metrics.on_step(llm.engine.stats(), [], 0.0)
        text = metrics.render().decode()
    assert f'kvserve_prefix_cache_hit_tokens_total{{tier="host"}} {PROMPT_HIT}.0' in text
    assert f'kvserve_offload_loaded_tokens_total{{tier="host"}} {PROMPT_HIT}.0' in text
    assert 'kvserve_offload_runs_total{decision="load"} 1.0' in text
    assert 'kvserve_offload_runs_total{decision="probe"} 0.0' in text
    assert 'kvserve_offload_tier_latency_seconds{measured="true",tier="host"}' in text
    assert "kvserve_offload_prefill_tokens_per_second " in text

"""The load-or-recompute decision on made-up numbers."""

from __future__ import annotations

import pytest

from kvserve.offload.cost import CostModel, TierCost
from kvserve.offload.store import TierStats

BLOCK = 1_000_000       # payload bytes per block
HOST, DISK, REDIS = 0, 1, 2
# the built-in tiers' priors (the transports' class attributes); the tests feed reads before deciding
PRIORS = (TierCost("host", 0.1e-3, 650e6, False), TierCost("disk", 0.4e-3, 200e6, False),
          TierCost("redis", 0.3e-3, 300e6, False))


def model(prefill_tokens_per_s: float | None = 16_000.0) -> CostModel:
    """16 tokens a block: at 16k tokens/s recomputing a block takes 1 ms."""
    m = CostModel(PRIORS, block_size=16, block_nbytes=BLOCK)
    if prefill_tokens_per_s is not None:
        m.observe_prefill(1600, 1600 / prefill_tokens_per_s)
    return m


def feed(m: CostModel, tier: int, latency_s: float, bytes_per_s: float) -> None:
    """Reads of 1, 4 and 16 blocks made at the given latency and bandwidth."""
    stats = [TierStats(tier=name) for name in m.tier_names]
    nbytes = 0
    seconds = 0.0
    for calls, blocks in enumerate((1, 4, 16, 1, 4, 16), start=1):
        nbytes += blocks * BLOCK
        seconds += latency_s + blocks * BLOCK / bytes_per_s
        stats[tier] = TierStats(tier=m.tier_names[tier], read_calls=calls, bytes_read=nbytes, read_seconds=seconds)
        m.observe_tiers(stats)


def test_the_fit_recovers_latency_and_bandwidth():
    m = model()
    feed(m, DISK, latency_s=0.004, bytes_per_s=250e6)
    cost = m.tier_cost(DISK)
    assert cost.is_measured
    assert cost.latency_s == pytest.approx(0.004, rel=1e-6)
    assert cost.bytes_per_s == pytest.approx(250e6, rel=1e-6)
    assert not m.tier_cost(REDIS).is_measured          # prior until read


def test_fast_tier_is_loaded_slow_tier_is_recomputed():
    m = model()
    feed(m, HOST, latency_s=0.0001, bytes_per_s=2e9)     # 10 blocks: 5.1 ms vs 10 ms recompute
    feed(m, DISK, latency_s=0.050, bytes_per_s=100e6)    # 10 blocks: 150 ms
    assert m.choose([HOST] * 10).num_load_blocks == 10
    d = m.choose([DISK] * 10)
    assert d.num_load_blocks == 0
    assert d.load_s == 0 and d.recompute_s == pytest.approx(0.010)


def test_a_run_is_cut_where_the_slow_tier_starts():
    m = model()
    feed(m, HOST, latency_s=0.0001, bytes_per_s=2e9)
    feed(m, DISK, latency_s=0.050, bytes_per_s=100e6)
    d = m.choose([HOST] * 4 + [DISK] * 6)
    assert (d.num_blocks, d.num_load_blocks) == (10, 4)
    s = m.snapshot()
    assert (s.runs_loaded, s.runs_cut, s.blocks_recomputed) == (0, 1, 6)


def test_latency_decides_short_runs_bandwidth_long_ones():
    m = model()
    feed(m, REDIS, latency_s=0.003, bytes_per_s=4e9)      # 3 ms per call, 0.25 ms per block
    assert m.choose([REDIS] * 2).num_load_blocks == 0       # 3.5 ms vs 2 ms
    assert m.choose([REDIS] * 8).num_load_blocks == 8       # 5 ms vs 8 ms


def test_unmeasured_prefill_loads_and_swap_follows_the_same_rule():
    m = model(prefill_tokens_per_s=None)
    assert m.choose([DISK] * 3).num_load_blocks == 3        # nothing to compare with yet
    assert m.should_swap(4)
    m = model()
    feed(m, HOST, latency_s=0.0001, bytes_per_s=2e9)
    assert m.should_swap(4)                                  # 2.1 ms vs 4 ms
    feed(m, HOST, latency_s=0.020, bytes_per_s=2e9)          # the host got slow
    assert not m.should_swap(4)


def test_prefill_speed_is_a_moving_average_of_prefill_steps():
    m = model(prefill_tokens_per_s=None)
    m.observe_prefill(1000, 0.1)                             # 10k tokens/s
    m.observe_prefill(8, 0.1)                                # too few tokens: ignored
    assert m.prefill_tokens_per_s == pytest.approx(10_000)
    m.observe_prefill(2000, 0.1)                             # 20k tokens/s, weight 0.2
    assert m.prefill_tokens_per_s == pytest.approx(12_000)


def test_an_unmeasured_tier_costs_its_transport_class_prior():
    from kvserve.offload import HostConfig
    from kvserve.offload.base import Transport
    from kvserve.offload.cost import prior_cost
    from kvserve.offload.host import HostTransport

    host = prior_cost(HostTransport(HostConfig(capacity_bytes=1)))
    assert host == TierCost("host", HostTransport.prior_read_latency_s, HostTransport.prior_read_bytes_per_s, False)
    m = CostModel([host], block_size=16, block_nbytes=BLOCK)
    assert m.tier_cost(0) == host
    assert (Transport.prior_read_latency_s, Transport.prior_read_bytes_per_s) == (0.0, float("inf"))  # unknown: free


def test_a_tier_ruled_out_is_loaded_again_after_reprobe_after_cut_runs():
    m = CostModel(PRIORS, block_size=16, block_nbytes=BLOCK, reprobe_after=3)
    m.observe_prefill(1600, 0.1)                              # 16k tokens/s: a block recomputes in 1 ms
    feed(m, HOST, latency_s=0.0001, bytes_per_s=2e9)
    feed(m, DISK, latency_s=0.050, bytes_per_s=100e6)         # one bad moment: disk looks slow
    run = [HOST] * 2 + [DISK] * 4
    assert [m.choose(run).num_load_blocks for _ in range(2)] == [2, 2]
    probe = m.choose(run)                                     # the third cut run from disk is a probe
    assert (probe.num_blocks, probe.num_load_blocks) == (6, 6)
    assert m.choose(run).num_load_blocks == 2                 # the count starts again at a probe
    assert m.choose([HOST] * 3).num_load_blocks == 3          # host runs never cut: no probe of host
    s = m.snapshot()
    assert (s.runs_loaded, s.runs_cut, s.runs_probed, s.blocks_recomputed) == (1, 3, 1, 12)
    stats = [TierStats(tier=name) for name in m.tier_names]
    stats[DISK] = TierStats(tier="disk", read_calls=7, bytes_read=46 * BLOCK, read_seconds=1.0)
    m.observe_tiers(stats)                                     # a read of disk: its count starts again
    assert [m.choose(run).num_load_blocks for _ in range(3)] == [2, 2, 6]


def test_reprobe_after_must_be_positive():
    with pytest.raises(ValueError, match="reprobe_after"):
        CostModel(PRIORS, block_size=16, block_nbytes=BLOCK, reprobe_after=0)

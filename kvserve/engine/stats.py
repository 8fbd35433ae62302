"""A snapshot of the engine's state and counters, taken once per step by observers."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kvserve.blend.blender import BlendStats
from kvserve.kv.budget.budgets import BudgetStats
from kvserve.kv.pins import NO_PIN_STATS, PinStats
from kvserve.kv.stats import KVStats
from kvserve.kv.tiering import TierMetrics
from kvserve.offload.cost import CostSnapshot
from kvserve.scheduler.scheduler import Scheduler
from kvserve.speculative.speculator import SpecStats

NO_BUDGET_STATS = BudgetStats(0, 0, 0, 0)


@dataclass(frozen=True)
class EngineStats:
    num_steps: int
    num_waiting: int
    num_running: int
    num_preemptions: int
    kv_num_blocks: int
    kv_num_free_blocks: int        # free plus evictable cached
    kv_num_cached_blocks: int      # blocks holding a content key (used or not)
    kv_usage: float                # fraction of blocks referenced by running requests
    kv_used_blocks_by_kind: tuple[tuple[str, int], ...]   # (full / sliding, blocks referenced), kv/groups.py
    prefix_query_tokens: int       # prompt tokens looked up at admission, cumulative
    prefix_hit_tokens: int         # of which served from the device prefix cache
    num_evicted_blocks: int        # cached blocks whose key was dropped to reuse them
    tiers: tuple[TierMetrics, ...] = ()   # offload tiers in lookup order (empty: none configured)
    cost: CostSnapshot | None = None      # load-or-recompute figures and decisions (None: no tiers)
    num_loading: int = 0                  # admitted requests waiting for their tier reads
    num_swapped_blocks: int = 0           # blocks of preempted requests demoted at once (swap)
    budgets: BudgetStats = NO_BUDGET_STATS   # KV budgets: compactions, ArkVale's host store
    pins: PinStats = NO_PIN_STATS            # pinned prefixes (kv/pins.py)
    pin_hit_tokens: int = 0                  # prompt tokens served from pinned device blocks, first admissions
    blend: BlendStats = field(default_factory=BlendStats)   # segments and blended prompts (kvserve/blend/)
    spec: SpecStats | None = None            # speculative decoding (kvserve/speculative/; None: off)
    kv_cached_blocks_by_tenant: tuple[tuple[str, int], ...] = ()   # (tenant, cached blocks), "" the engine's

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens else 0.0

    @property
    def tier_hit_tokens(self) -> int:
        """Prompt tokens served from the offload tiers at first admission."""
        return sum(t.hit_tokens for t in self.tiers)

    @property
    def recompute_tokens_avoided(self) -> int:
        """Tokens loaded from the offload tiers instead of computed, re-admissions included."""
        return sum(t.loaded_tokens for t in self.tiers)


def take_stats(num_steps: int, scheduler: Scheduler, kv: KVStats, blend: BlendStats,
               spec: SpecStats | None) -> EngineStats:
    """The snapshot, from each part's own report."""
    return EngineStats(
        num_steps=num_steps, num_waiting=len(scheduler.waiting), num_loading=len(scheduler.loading),
        num_running=len(scheduler.running), num_preemptions=scheduler.num_preemptions,
        kv_num_blocks=kv.num_blocks, kv_num_free_blocks=kv.num_free_blocks,
        kv_num_cached_blocks=kv.num_cached_blocks, kv_usage=kv.usage, kv_used_blocks_by_kind=kv.used_blocks_by_kind,
        prefix_query_tokens=scheduler.num_prefix_query_tokens, prefix_hit_tokens=scheduler.num_prefix_hit_tokens,
        num_evicted_blocks=kv.num_evicted_blocks, tiers=kv.tiers, cost=kv.cost,
        num_swapped_blocks=scheduler.num_swapped_blocks, budgets=kv.budgets, pins=kv.pins,
        pin_hit_tokens=scheduler.num_pin_hit_tokens, blend=dataclasses.replace(blend),
        spec=None if spec is None else dataclasses.replace(spec), kv_cached_blocks_by_tenant=kv.cached_blocks_by_tenant)

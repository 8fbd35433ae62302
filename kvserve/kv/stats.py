"""What the KV manager reports of its pool, tiers, budgets and pins: one snapshot, so that no
caller reads those parts itself (the engine's stats, /metrics, eval, the cluster)."""

from __future__ import annotations

from dataclasses import dataclass

from kvserve.kv.budget.budgets import BudgetStats
from kvserve.kv.pins import PinStats
from kvserve.kv.tiering import TierMetrics
from kvserve.offload.cost import CostSnapshot


@dataclass(frozen=True)
class KVStats:
    num_blocks: int
    num_free_blocks: int           # free plus evictable cached
    num_cached_blocks: int         # blocks holding a content key (used or not)
    usage: float                   # fraction of blocks referenced by running requests
    used_blocks_by_kind: tuple[tuple[str, int], ...]     # (full / sliding, blocks referenced), kv/groups.py
    cached_blocks_by_tenant: tuple[tuple[str, int], ...]  # (tenant, cached blocks), "" the engine's
    num_evicted_blocks: int        # cached blocks whose key was dropped to reuse them
    tiers: tuple[TierMetrics, ...]  # offload tiers in lookup order (empty: none configured)
    cost: CostSnapshot | None      # load-or-recompute figures and decisions (None: no tiers)
    budgets: BudgetStats
    pins: PinStats

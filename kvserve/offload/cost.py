"""Load or recompute: a measured decision per run of tier hits.

    recompute(n tokens)      = n / prefill_tokens_per_s
    load(blocks of tier t)   = latency_t + blocks * block_nbytes / bandwidth_t   (per tier read call)

Prefill speed is an exponential moving average over the engine's prefill steps. Each
tier's latency and bandwidth are fitted to its own counters (TierStats: calls, bytes and
seconds of reads), by least squares on ``seconds = calls * latency + bytes / bandwidth``
with exponentially decaying weights, so they follow the machine's load. Until a tier has
been read, a prior stands in: its transport class's ``prior_read_latency_s`` and
``prior_read_bytes_per_s`` (the figures measured in docs/offload.md for the built-in
tiers; "free" by default, so that an unknown tier gets measured by its first use).

A run is cut at the tier boundary that minimizes load time of the part kept plus
recompute time of the rest; the blocks cut are computed like misses.

A tier that is never read is never measured again: one slow read (a page fault, the
machine busy for a moment) would rule it out for good. So the ``reprobe_after``-th run
that would be cut from a tier since its last read is loaded whole instead (a probe), and
the tier's fit follows what its reads cost now.

    run      | host host host | disk disk | redis |
    cuts     0                3           5       6      cost(k) = load(run[:k]) + recompute(run[k:])
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from kvserve.offload.base import Transport
from kvserve.offload.store import TierStats

log = logging.getLogger(__name__)

MIN_PREFILL_TOKENS = 16


@dataclass(frozen=True)
class TierCost:
    tier: str
    latency_s: float
    bytes_per_s: float
    is_measured: bool

    def load_seconds(self, num_blocks: int, block_nbytes: int) -> float:
        return self.latency_s + num_blocks * block_nbytes / self.bytes_per_s if num_blocks else 0.0


def prior_cost(transport: Transport) -> TierCost:
    """What a tier's reads are assumed to cost until they are measured (its class's priors)."""
    return TierCost(transport.name, transport.prior_read_latency_s, transport.prior_read_bytes_per_s, False)


@dataclass(frozen=True)
class Decision:
    """One run's verdict and the figures behind it."""

    num_blocks: int            # blocks in the run
    num_load_blocks: int       # blocks kept for loading (a leading part of the run)
    load_s: float              # estimated load time of the part kept
    recompute_s: float         # estimated recompute time of the whole run


@dataclass(frozen=True)
class CostSnapshot:
    prefill_tokens_per_s: float | None
    tiers: tuple[TierCost, ...]
    runs_loaded: int           # runs kept whole
    runs_cut: int              # runs cut short (part or all recomputed)
    blocks_recomputed: int     # blocks of runs the model chose to recompute
    runs_probed: int = 0       # runs loaded whole to measure a tier again (not in runs_loaded)


class _Fit:
    """Decaying least squares of seconds ~ calls * latency + bytes * inv_bandwidth."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.scc = self.scb = self.sbb = self.sct = self.sbt = 0.0
        self.n = 0

    def add(self, calls: float, nbytes: float, seconds: float) -> None:
        d = self.decay
        self.scc = d * self.scc + calls * calls
        self.scb = d * self.scb + calls * nbytes
        self.sbb = d * self.sbb + nbytes * nbytes
        self.sct = d * self.sct + calls * seconds
        self.sbt = d * self.sbt + nbytes * seconds
        self.n += 1

    def solve(self) -> tuple[float, float] | None:
        """(latency s, bandwidth bytes/s), or None before any data."""
        if self.n == 0 or self.sbb <= 0:
            return None
        det = self.scc * self.sbb - self.scb ** 2
        if det > 1e-12 * self.scc * self.sbb:
            latency = (self.sct * self.sbb - self.scb * self.sbt) / det
            inv_bw = (self.scc * self.sbt - self.scb * self.sct) / det
            if latency >= 0 and inv_bw > 0:
                return latency, 1 / inv_bw
        # all calls alike (or a fit with a negative term): charge everything to bandwidth
        return 0.0, self.sbb / self.sbt if self.sbt > 0 else float("inf")


class CostModel:
    """Estimates and decisions; fed by the engine thread (steps) and by tier counters.

    ``priors``: one per tier in lookup order (``prior_cost(transport)``), the estimate
    used until the tier's reads are measured. ``reprobe_after``: the ``reprobe_after``-th run that
    would be cut from a tier since its last read is loaded whole, to measure the tier again.
    """

    def __init__(self, priors: Sequence[TierCost], block_size: int, block_nbytes: int,
                 decay: float = 0.9, prefill_alpha: float = 0.2, reprobe_after: int = 16) -> None:
        if reprobe_after < 1:
            raise ValueError(f"reprobe_after must be at least 1, not {reprobe_after}")
        self.priors = tuple(priors)
        self.tier_names = tuple(p.tier for p in self.priors)
        self.block_size = block_size
        self.block_nbytes = block_nbytes
        self.prefill_alpha = prefill_alpha
        self.prefill_tokens_per_s: float | None = None
        self._fits = [_Fit(decay) for _ in self.tier_names]
        self._seen = [TierStats(tier=name) for name in self.tier_names]
        self.reprobe_after = reprobe_after
        self._cut_unread = [0] * len(self.tier_names)     # runs cut from each tier since its last read
        self.runs_loaded = self.runs_cut = self.blocks_recomputed = self.runs_probed = 0

    # -- measurements ----------------------------------------------------------
    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """A step that computed ``num_tokens`` (mostly prefill) in ``seconds``."""
        if num_tokens < MIN_PREFILL_TOKENS or seconds <= 0:
            return
        speed = num_tokens / seconds
        old = self.prefill_tokens_per_s
        self.prefill_tokens_per_s = speed if old is None else old + self.prefill_alpha * (speed - old)

    def observe_tiers(self, stats: Sequence[TierStats]) -> None:
        """Fit each tier to the reads made since the last call (counters are cumulative)."""
        for i, s in enumerate(stats):
            seen = self._seen[i]
            calls, nbytes = s.read_calls - seen.read_calls, s.bytes_read - seen.bytes_read
            if calls > 0 and nbytes > 0:
                self._fits[i].add(calls, nbytes, s.read_seconds - seen.read_seconds)
                self._cut_unread[i] = 0
            self._seen[i] = s

    def tier_cost(self, t: int) -> TierCost:
        fitted = self._fits[t].solve()
        if fitted is not None:
            return TierCost(self.tier_names[t], fitted[0], fitted[1], True)
        return self.priors[t]

    # -- decisions -------------------------------------------------------------
    def recompute_seconds(self, num_blocks: int) -> float | None:
        tps = self.prefill_tokens_per_s
        return None if tps is None else num_blocks * self.block_size / tps

    def load_seconds(self, tiers: Sequence[int]) -> float:
        """Estimated time to load blocks held by ``tiers`` (one read call per tier)."""
        return sum(self.tier_cost(t).load_seconds(tiers.count(t), self.block_nbytes) for t in set(tiers))

    def choose(self, tiers: Sequence[int], covers: int | None = None) -> Decision:
        """How many leading blocks of a run (held by ``tiers``) to load; the rest is recomputed.
        ``covers``: the run is several layer groups' blocks (kv/groups.py) for this many block
        positions, loaded whole or not at all (a part would not hold every group's window)."""
        n = len(tiers)
        recompute = self.recompute_seconds(n if covers is None else covers)
        if recompute is None or n == 0:     # prefill speed not measured yet: load, and measure
            return self._count(Decision(n, n, self.load_seconds(tiers), recompute or 0.0))
        if covers is not None:
            load = self.load_seconds(tiers)
            return self._count(Decision(n, n if load <= recompute else 0, load, recompute))
        cuts = [k for k in range(n + 1) if k in (0, n) or tiers[k] != tiers[k - 1]]
        per_block = recompute / n
        costs = {k: self.load_seconds(tiers[:k]) + (n - k) * per_block for k in cuts}
        best = min(cuts, key=lambda k: (costs[k], -k))
        if best < n and self._probes(set(tiers[best:])):
            self.runs_probed += 1
            log.debug("tier run of %d blocks: loaded whole to measure its tiers again", n)
            return Decision(n, n, self.load_seconds(tiers), recompute)
        return self._count(Decision(n, best, self.load_seconds(tiers[:best]), recompute))

    def _probes(self, cut: set[int]) -> bool:
        """Count a run cut from tiers ``cut``; whether one of them is due to be measured again."""
        for t in cut:
            self._cut_unread[t] += 1
        if all(self._cut_unread[t] < self.reprobe_after for t in cut):
            return False
        for t in cut:                   # the probe reads them all: each count starts again
            self._cut_unread[t] = 0
        return True

    def should_swap(self, num_blocks: int, tier: int = 0) -> bool:
        """Whether writing ``num_blocks`` to tier ``tier`` and loading them back beats recomputing."""
        recompute = self.recompute_seconds(num_blocks)
        return recompute is None or self.tier_cost(tier).load_seconds(num_blocks, self.block_nbytes) < recompute

    def _count(self, d: Decision) -> Decision:
        if d.num_load_blocks == d.num_blocks:
            self.runs_loaded += 1
        else:
            self.runs_cut += 1
            self.blocks_recomputed += d.num_blocks - d.num_load_blocks
        log.debug("tier run of %d blocks: load %d (est. %.2f ms) vs recompute all (est. %.2f ms)",
                  d.num_blocks, d.num_load_blocks, d.load_s * 1e3, d.recompute_s * 1e3)
        return d

    def snapshot(self) -> CostSnapshot:
        return CostSnapshot(self.prefill_tokens_per_s, tuple(self.tier_cost(t) for t in range(len(self.tier_names))),
                            self.runs_loaded, self.runs_cut, self.blocks_recomputed, self.runs_probed)

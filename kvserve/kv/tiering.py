"""The KV side of the offload tiers: device blocks in and out of a store of keys and bytes.

    KV manager  --demote(blocks)-->      BlockMover.read (device -> bytes, synchronous: the
                                         blocks are about to be reused) -> TieredStore.demote
                --write_through(blocks)  newly computed full blocks -> the shared tiers at once
                                         (write-through: other engines find them; off by default)
                --lookup(keys)-->        TieredStore.lookup: the run of keys some tier holds,
                                         cut by the cost model where recomputing is faster
    scheduler   --load(run, blocks)-->   reads now, BlockMover.write (bytes -> device blocks)
                --start_load(rid, ...)   reads on the tiers' worker threads; is_load_done,
                  finish_load(rid)-->    wait_for_load, then the same write; drop_load (abort)
                --swap_out(blocks)-->    demote a preempted request's blocks at once, if worth it
    engine      --observe_prefill-->     CostModel (prefill speed); metrics, close

kvserve/offload/ below speaks keys and bytes only; this side owns block movement, the
loads in flight (keyed by request id) and the per-tier hit counters. The manager owns
the block tables: it gives each load its destination blocks and caches them after.
``NoTiering`` is the null object when no tier is configured.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvserve.kv.block_io import BlockMover
from kvserve.kv.block_pool import Block
from kvserve.offload.base import Transport
from kvserve.offload.cost import CostModel, CostSnapshot, prior_cost
from kvserve.offload.store import TierStats
from kvserve.offload.tiered import EMPTY_RUN, PendingFetch, TieredStore, TierRun, make_tiered_store

log = logging.getLogger(__name__)


class Promotion(NamedTuple):
    """What a load brought in: the leading ``num_blocks`` of its run, counted per tier."""

    num_blocks: int
    num_blocks_by_tier: tuple[int, ...]


NO_PROMOTION = Promotion(0, ())


class PendingLoad(NamedTuple):
    fetch: PendingFetch
    block_ids: list[int]        # destination of each block of the run, in order


@dataclass(frozen=True)
class TierMetrics:
    """One tier as seen by the engine. Tokens are prompt tokens; bytes are payload bytes."""

    tier: str
    hit_tokens: int          # served at first admission (comparable with prefix_query_tokens)
    loaded_tokens: int       # every load, re-admissions included: recompute avoided
    bytes_loaded: int
    load_seconds: float      # engine-thread time waiting for and writing loads, split by blocks
    store: TierStats         # the tier's own counters: writes (demotions), misses, corrupt, bandwidth
    dropped_calls: int       # submits refused because the tier's queue was full
    write_through_blocks: int = 0   # computed blocks submitted to this (shared) tier at once


class Tiering(ABC):
    """Contract: called from the engine thread only. ``demote`` must be called before the
    blocks are reused; a run's keys stay valid however long a load takes (content keys).

    Loads in flight are held here, one per request id, from ``start_load`` until
    ``finish_load`` or ``drop_load``; their destination blocks must stay allocated to the
    request meanwhile (the scheduler's integrity check holds the two together).
    Implementations give the reads (``_submit``) and the writes (``_write``).
    """

    tier_names: tuple[str, ...] = ()

    def __init__(self) -> None:
        self._loads: dict[str, PendingLoad] = {}

    # -- the manager's port: inside matching and allocation --------------------
    @abstractmethod
    def demote(self, blocks: Sequence[Block]) -> int:
        """Copy cached blocks off the device and submit them to the tiers; returns how many
        were copied (blocks without a key, or that a local first tier holds, are skipped)."""

    def demote_pinned(self, blocks: Sequence[Block]) -> int:
        """``demote`` for pinned blocks: their writes are queued even when a tier's queue is
        full (never dropped for that; a tier that is down or full still refuses them)."""
        return self.demote(blocks)

    def write_through(self, blocks: Sequence[Block]) -> int:
        """With write-through on, copy newly computed full blocks off the device and submit
        them to the shared tiers (in the background, skipping keys a tier already holds);
        returns how many were copied. Off (the default): nothing."""
        return 0

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> TierRun:
        """The leading run of ``keys`` that the tiers hold and that is worth loading rather
        than recomputing (a hint: a load may still miss)."""

    def holders(self, keys: Sequence[bytes]) -> list[int | None]:
        """Each key's tier (the first that holds it), or None (a hint, as ``lookup``'s)."""
        return [None] * len(keys)

    def choose(self, run: TierRun, covers: int | None = None) -> TierRun:
        """The leading part of ``run`` worth loading rather than recomputing (``lookup`` applies
        it); ``covers``: a run of several layer groups' blocks for this many block positions,
        taken whole or not at all (CostModel.choose)."""
        return run

    def load_seconds(self, run: TierRun) -> float:
        """Estimated time to load ``run`` (the cost model's measured figures; 0 without tiers)."""
        return 0.0

    @property
    def prefill_tokens_per_s(self) -> float | None:
        """Measured prefill speed (None before any prefill step was measured, or without tiers)."""
        return None

    # -- loads: the scheduler --------------------------------------------------
    def is_prefetch(self, run: TierRun) -> bool:
        """Whether ``run`` comes from a tier that does not load synchronously, so its request
        should wait for the reads while others run rather than have them loaded at once."""
        return False

    def load(self, run: TierRun, block_ids: list[int]) -> Promotion:
        """Read ``run`` and write the leading run of payloads into ``block_ids`` now."""
        if not run.num_blocks:
            return NO_PROMOTION
        return self._write(self._submit(run, block_ids))

    def start_load(self, request_id: str, run: TierRun, block_ids: list[int]) -> None:
        """Submit the reads of ``run`` for the request; its payloads will go into ``block_ids``."""
        if request_id in self._loads:
            raise ValueError(f"request {request_id!r} already has a load in flight")
        self._loads[request_id] = self._submit(run, block_ids)

    def is_load_done(self, request_id: str) -> bool:
        """Whether the request's reads are done (also when it has no load in flight)."""
        pending = self._loads.get(request_id)
        return pending is None or pending.fetch.done()

    def wait_for_load(self, request_id: str, timeout: float) -> None:
        """Block up to ``timeout`` seconds for the request's reads."""
        pending = self._loads.get(request_id)
        if pending is not None:
            pending.fetch.wait(timeout)

    def finish_load(self, request_id: str) -> Promotion:
        """Wait for the request's reads and write the leading run of payloads into its blocks.
        A miss or a corrupt block ends the run: the blocks after it are computed."""
        return self._write(self._loads.pop(request_id))

    def drop_load(self, request_id: str) -> None:
        """Forget the request's load (an abort: its blocks are being freed); its reads finish unread."""
        self._loads.pop(request_id, None)

    def loading_request_ids(self) -> frozenset[str]:
        return frozenset(self._loads)

    @abstractmethod
    def _submit(self, run: TierRun, block_ids: list[int]) -> PendingLoad:
        """Submit the reads of ``run``, whose payloads go into ``block_ids`` (one per block, in order)."""

    @abstractmethod
    def _write(self, pending: PendingLoad) -> Promotion:
        """Wait for the reads and write the leading run of payloads into their blocks."""

    def swap_out(self, blocks: Sequence[Block]) -> int:
        """Demote a preempted request's blocks now, if loading them back beats recomputing;
        returns how many were submitted."""
        return 0

    def record_hits(self, promotion: Promotion) -> None:
        """Count a first admission's loaded blocks as tier hits."""

    # -- the engine --------------------------------------------------------------
    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """An engine step that computed ``num_tokens``, mostly prefill, in ``seconds``."""

    def cost_snapshot(self) -> CostSnapshot | None:
        """The cost model's figures as of its last decision; reading them changes nothing."""
        return None

    def metrics(self) -> tuple[TierMetrics, ...]:
        return ()

    def flush(self) -> None:
        """Wait for submitted demotions."""

    def close(self) -> None:
        """Finish pending demotions and release the tiers."""

    def check_integrity(self) -> None:
        """Raise AssertionError if a tier's accounting or a load in flight is inconsistent."""
        for rid, pending in self._loads.items():
            assert len(pending.block_ids) == pending.fetch.run.num_blocks, (
                f"request {rid!r}: a load of {pending.fetch.run.num_blocks} blocks into {len(pending.block_ids)}")


class NoTiering(Tiering):
    """No tier configured: nothing is demoted, nothing is found, so nothing is loaded."""

    def demote(self, blocks: Sequence[Block]) -> int:
        return 0

    def lookup(self, keys: Sequence[bytes]) -> TierRun:
        return EMPTY_RUN

    def _submit(self, run: TierRun, block_ids: list[int]) -> PendingLoad:
        return PendingLoad(PendingFetch(EMPTY_RUN, {}), [])

    def _write(self, pending: PendingLoad) -> Promotion:
        return NO_PROMOTION


class OffloadTiering(Tiering):
    """Blocks between the device (through ``mover``) and the tiers of ``store``."""

    def __init__(self, store: TieredStore, mover: BlockMover, block_size: int, write_through: bool = False,
                 timer: Callable[[], float] = time.perf_counter) -> None:
        super().__init__()
        self._timer = timer
        self.store = store
        self.mover = mover
        self.block_size = block_size
        self.tier_names = store.names
        self.cost = CostModel([prior_cost(t) for t in store.transports], block_size, mover.nbytes_per_block)
        n = store.num_tiers
        self._hit_blocks = [0] * n
        self._loaded_blocks = [0] * n
        self._load_seconds = [0.0] * n
        first = store.transports[0]
        # a block a local first tier holds was demoted before (or loaded from there): skip
        # its copy. Asking a remote tier would cost a round trip on the engine thread.
        self._first_is_local = first.is_local
        self._first_is_swap_target = first.is_swap_target
        self._loads_synchronously = tuple(t.loads_synchronously for t in store.transports)
        self._shared = tuple(i for i, t in enumerate(store.transports) if t.is_shared) if write_through else ()
        if write_through and not self._shared:
            raise ValueError(f"write_through needs a shared tier (such as Redis, --redis-url); the tiers are "
                             f"{', '.join(self.tier_names)}")
        self._write_through_blocks = [0] * n

    def demote(self, blocks: Sequence[Block]) -> int:
        return self._demote(blocks, required=False)

    def demote_pinned(self, blocks: Sequence[Block]) -> int:
        return self._demote(blocks, required=True)

    def _demote(self, blocks: Sequence[Block], required: bool) -> int:
        todo = [(b.key, b.block_id) for b in blocks if b.key is not None]
        if self._first_is_local and todo:
            held = self.store.tiers[0].contains([key for key, _ in todo])
            todo = [t for t, h in zip(todo, held) if not h]
        if not todo:
            return 0
        payloads = self.mover.read([block_id for _, block_id in todo])
        self.store.demote([(key, p) for (key, _), p in zip(todo, payloads)], required=required)
        return len(todo)

    def write_through(self, blocks: Sequence[Block]) -> int:
        if not self._shared:
            return 0
        todo = [(b.key, b.block_id) for b in blocks if b.key is not None]
        if not todo:
            return 0
        payloads = self.mover.read([block_id for _, block_id in todo])
        self.store.write_through([(key, p) for (key, _), p in zip(todo, payloads)], self._shared)
        for t in self._shared:
            self._write_through_blocks[t] += len(todo)
        return len(todo)

    def swap_out(self, blocks: Sequence[Block]) -> int:
        if not blocks or not self._first_is_swap_target:
            return 0
        if not self.cost.should_swap(len(blocks)):
            log.debug("preemption: %d blocks left to recompute (cheaper than a %s round trip)", len(blocks),
                      self.tier_names[0])
            return 0
        swapped = self.demote(blocks)
        log.debug("preemption: %d of %d blocks swapped to %s", swapped, len(blocks), self.tier_names[0])
        return swapped

    def lookup(self, keys: Sequence[bytes]) -> TierRun:
        return self.choose(self.store.lookup(keys))

    def holders(self, keys: Sequence[bytes]) -> list[int | None]:
        return self.store.holders(keys)

    def choose(self, run: TierRun, covers: int | None = None) -> TierRun:
        if not run.num_blocks:
            return run
        self.cost.observe_tiers(self.store.stats())
        n = self.cost.choose(run.tiers, covers).num_load_blocks
        return TierRun(run.keys[:n], run.tiers[:n])

    def is_prefetch(self, run: TierRun) -> bool:
        return not all(self._loads_synchronously[t] for t in run.tiers)

    def load_seconds(self, run: TierRun) -> float:
        return self.cost.load_seconds(run.tiers)

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self.cost.prefill_tokens_per_s

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        self.cost.observe_prefill(num_tokens, seconds)

    def cost_snapshot(self) -> CostSnapshot:
        # the fit is fed at lookups and finished loads only: a metrics reader polling this
        # must not change how the reads are split into samples (and so how fast they decay)
        return self.cost.snapshot()

    def _submit(self, run: TierRun, block_ids: list[int]) -> PendingLoad:
        if len(block_ids) != run.num_blocks:
            raise ValueError(f"{len(block_ids)} blocks for a run of {run.num_blocks}")
        return PendingLoad(self.store.submit_fetch(run), block_ids)

    def _write(self, pending: PendingLoad) -> Promotion:
        start = self._timer()
        payloads = pending.fetch.result()
        self.cost.observe_tiers(self.store.stats())      # the reads just made
        # a payload of the wrong size cannot come from a block with this key and format
        n = next((i for i, p in enumerate(payloads) if len(p) != self.mover.nbytes_per_block), len(payloads))
        if n:
            self.mover.write(pending.block_ids[:n], payloads[:n])
        by_tier = pending.fetch.run.blocks_by_tier(self.store.num_tiers, n)
        seconds = self._timer() - start
        for t, count in enumerate(by_tier):
            self._loaded_blocks[t] += count
            if n:
                self._load_seconds[t] += seconds * count / n
        return Promotion(n, by_tier)

    def record_hits(self, promotion: Promotion) -> None:
        for t, count in enumerate(promotion.num_blocks_by_tier):
            self._hit_blocks[t] += count

    def metrics(self) -> tuple[TierMetrics, ...]:
        bs, nb = self.block_size, self.mover.nbytes_per_block
        return tuple(
            TierMetrics(tier=name, hit_tokens=self._hit_blocks[t] * bs, loaded_tokens=self._loaded_blocks[t] * bs,
                        bytes_loaded=self._loaded_blocks[t] * nb, load_seconds=self._load_seconds[t],
                        store=stats, dropped_calls=astats.dropped, write_through_blocks=self._write_through_blocks[t])
            for t, (name, stats, astats) in enumerate(zip(self.tier_names, self.store.stats(),
                                                          self.store.async_stats())))

    def flush(self) -> None:
        self.store.flush()

    def close(self) -> None:
        self.store.close()

    def check_integrity(self) -> None:
        super().check_integrity()
        self.store.check_integrity()


def make_tiering(transports: Sequence[Transport], mover: BlockMover, extra_key: bytes, block_size: int,
                 write_through: bool = False, timer: Callable[[], float] = time.perf_counter) -> Tiering:
    """Tiering over ``transports`` in lookup order (``NoTiering`` when there are none).

    Blocks are tagged with the extra key (model, format, dtype, salt) as the store's format
    tag, so engines that cannot use each other's blocks never read them. ``write_through``:
    computed full blocks also go to the shared tiers at once (ValueError without one).
    ``timer`` times the reads and loads (the cost model's measurements).
    """
    if not transports:
        if write_through:
            raise ValueError("write_through needs a shared offload tier (such as Redis, --redis-url)")
        return NoTiering()
    return OffloadTiering(make_tiered_store(transports, extra_key.hex(), write_through, timer), mover, block_size,
                          write_through, timer)

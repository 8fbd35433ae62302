"""Between the KV manager and the tiers: demote evicted blocks, find and load tier hits.

    KV manager --demote(blocks)-->  BlockMover.read (device -> bytes, synchronous: the
                                    blocks are about to be reused) -> TieredStore.demote
               --lookup(keys)-->    TieredStore.lookup: the run of keys some tier holds,
                                    cut by the cost model where recomputing is faster
               --start_load-->      TieredStore.submit_fetch (tier reads on worker threads)
               --finish_load-->     wait, BlockMover.write (bytes -> device blocks)
    engine     --observe_prefill--> CostModel (prefill speed)

``NoOffload`` is the null object the manager holds when no tier is configured.
"""

from __future__ import annotations

import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from kvserve.config import OffloadConfig
from kvserve.kv.block_io import block_nbytes, read_blocks, write_blocks
from kvserve.kv.block_pool import Block
from kvserve.offload.base import Transport
from kvserve.offload.cost import CostModel, CostSnapshot, prior_cost
from kvserve.offload.store import TierStats
from kvserve.offload.tiered import EMPTY_RUN, PendingFetch, TieredStore, TierRun, make_tiered_store, open_transports

log = logging.getLogger(__name__)


class BlockMover:
    """Copies whole blocks of the device cache to bytes and back (kv/block_io.py payloads).

    Holds the cache's per-block tensors (views of the live storage), not the cache.
    """

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.tensors = tensors
        self.nbytes_per_block = block_nbytes(tensors)

    def read(self, block_ids: list[int]) -> list[bytes]:
        rows = read_blocks(self.tensors, block_ids).numpy()
        return [row.tobytes() for row in rows]

    def write(self, block_ids: list[int], payloads: Sequence[bytes]) -> None:
        shape = (len(payloads), self.nbytes_per_block)
        on_cuda = self.tensors[0].device.type == "cuda"
        # page-locked staging on CUDA, so the host-to-device copies are DMA and asynchronous
        staged = torch.empty(shape, dtype=torch.uint8, pin_memory=on_cuda)
        rows = staged.numpy()
        for i, payload in enumerate(payloads):
            rows[i] = np.frombuffer(payload, dtype=np.uint8)
        write_blocks(self.tensors, block_ids, staged)


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


class Offload(ABC):
    """Contract: called from the engine thread only. ``demote`` must be called before the
    blocks are reused; a run's keys stay valid however long a load takes (content keys)."""

    tier_names: tuple[str, ...] = ()

    @abstractmethod
    def demote(self, blocks: Sequence[Block]) -> int:
        """Copy cached blocks off the device and submit them to the tiers; returns how many
        were copied (blocks without a key, or that a local first tier holds, are skipped)."""

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> TierRun:
        """The leading run of ``keys`` that the tiers hold and that is worth loading rather
        than recomputing (a hint: a load may still miss)."""

    def is_synchronous(self, run: TierRun) -> bool:
        """Whether to load ``run`` at once (host memory: a copy) rather than prefetch it."""
        return True

    def swap_out(self, blocks: Sequence[Block]) -> int:
        """Demote a preempted request's blocks now, if loading them back beats recomputing;
        returns how many were submitted."""
        return 0

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        """An engine step that computed ``num_tokens``, mostly prefill, in ``seconds``."""

    def cost_snapshot(self) -> CostSnapshot | None:
        """The cost model's figures as of its last decision; reading them changes nothing."""
        return None

    @abstractmethod
    def start_load(self, run: TierRun, block_ids: list[int]) -> PendingLoad:
        """Submit the reads of ``run``; its payloads will go into ``block_ids``."""

    @abstractmethod
    def finish_load(self, pending: PendingLoad) -> Promotion:
        """Wait for the reads and write the leading run of payloads into their blocks."""

    def record_hits(self, promotion: Promotion) -> None:
        """Count a first admission's loaded blocks as tier hits."""

    def metrics(self) -> tuple[TierMetrics, ...]:
        return ()

    def flush(self) -> None:
        """Wait for submitted demotions."""

    def close(self) -> None:
        """Finish pending demotions and release the tiers."""

    def check_integrity(self) -> None:
        """Raise AssertionError if a tier's accounting is inconsistent."""


class NoOffload(Offload):
    """No tier configured: nothing is demoted, nothing is found."""

    def demote(self, blocks: Sequence[Block]) -> int:
        return 0

    def lookup(self, keys: Sequence[bytes]) -> TierRun:
        return EMPTY_RUN

    def start_load(self, run: TierRun, block_ids: list[int]) -> PendingLoad:
        return PendingLoad(PendingFetch(EMPTY_RUN, {}), [])

    def finish_load(self, pending: PendingLoad) -> Promotion:
        return NO_PROMOTION


class TierOffload(Offload):
    def __init__(self, store: TieredStore, mover: BlockMover, block_size: int) -> None:
        self.store = store
        self.mover = mover
        self.block_size = block_size
        self.tier_names = store.names
        self.cost = CostModel([prior_cost(t) for t in store.transports], block_size, mover.nbytes_per_block)
        n = store.num_tiers
        self._hit_blocks = [0] * n
        self._loaded_blocks = [0] * n
        self._load_seconds = [0.0] * n
        # a block a local first tier holds was demoted before (or loaded from there): skip
        # its copy. Asking a remote tier would cost a round trip on the engine thread.
        self._first_is_local = store.transports[0].is_local

    def demote(self, blocks: Sequence[Block]) -> int:
        todo = [(b.key, b.block_id) for b in blocks if b.key is not None]
        if self._first_is_local and todo:
            held = self.store.tiers[0].contains([key for key, _ in todo])
            todo = [t for t, h in zip(todo, held) if not h]
        if not todo:
            return 0
        payloads = self.mover.read([block_id for _, block_id in todo])
        self.store.demote([(key, p) for (key, _), p in zip(todo, payloads)])
        return len(todo)

    def swap_out(self, blocks: Sequence[Block]) -> int:
        if not blocks or not self.store.transports[0].is_swap_target:
            return 0
        if not self.cost.should_swap(len(blocks)):
            log.debug("preemption: %d blocks left to recompute (cheaper than a host round trip)", len(blocks))
            return 0
        swapped = self.demote(blocks)
        log.debug("preemption: %d of %d blocks swapped to %s", swapped, len(blocks), self.tier_names[0])
        return swapped

    def lookup(self, keys: Sequence[bytes]) -> TierRun:
        run = self.store.lookup(keys)
        if not run.num_blocks:
            return run
        self.cost.observe_tiers(self.store.stats())
        n = self.cost.choose(run.tiers).num_load_blocks
        return TierRun(run.keys[:n], run.tiers[:n])

    def is_synchronous(self, run: TierRun) -> bool:
        return all(self.store.transports[t].loads_synchronously for t in run.tiers)

    def observe_prefill(self, num_tokens: int, seconds: float) -> None:
        self.cost.observe_prefill(num_tokens, seconds)

    def cost_snapshot(self) -> CostSnapshot:
        # the fit is fed at lookups and finished loads only: a metrics reader polling this
        # must not change how the reads are split into samples (and so how fast they decay)
        return self.cost.snapshot()

    def start_load(self, run: TierRun, block_ids: list[int]) -> PendingLoad:
        if len(block_ids) != run.num_blocks:
            raise ValueError(f"{len(block_ids)} blocks for a run of {run.num_blocks}")
        return PendingLoad(self.store.submit_fetch(run), block_ids)

    def finish_load(self, pending: PendingLoad) -> Promotion:
        start = time.perf_counter()
        payloads = pending.fetch.result()
        self.cost.observe_tiers(self.store.stats())      # the reads just made
        # a payload of the wrong size cannot come from a block with this key and format
        n = next((i for i, p in enumerate(payloads) if len(p) != self.mover.nbytes_per_block), len(payloads))
        if n:
            self.mover.write(pending.block_ids[:n], payloads[:n])
        by_tier = pending.fetch.run.blocks_by_tier(self.store.num_tiers, n)
        seconds = time.perf_counter() - start
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
                        store=stats, dropped_calls=astats.dropped)
            for t, (name, stats, astats) in enumerate(zip(self.tier_names, self.store.stats(),
                                                          self.store.async_stats())))

    def flush(self) -> None:
        self.store.flush()

    def close(self) -> None:
        self.store.close()

    def check_integrity(self) -> None:
        self.store.check_integrity()


def make_offload(config: OffloadConfig, mover: BlockMover, extra_key: bytes, block_size: int,
                 transports: Sequence[Transport] | None = None) -> Offload:
    """The tiers of ``config``, or ``transports`` when given (NoOffload when there are none).

    Blocks are tagged with the extra key (model, format, dtype, salt), so engines that
    cannot use each other's blocks never read them; Redis keys are namespaced by it too.
    """
    opened = list(transports) if transports is not None else open_transports(config, extra_key.hex()[:32])
    if not opened:
        return NoOffload()
    return TierOffload(make_tiered_store(opened, extra_key.hex()), mover, block_size)

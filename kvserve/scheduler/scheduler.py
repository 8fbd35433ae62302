"""Continuous batching with a token budget, chunked prefill and preemption.

Each step: running requests first (decodes take one token, unfinished prefills
their next chunk), then waiting requests in policy order while budget, sequence
slots and blocks last. A running request that cannot get a block preempts the
lowest-ranked running request, whose blocks are freed and whose tokens (prompt
plus output so far) are recomputed when it is admitted again (its freed blocks
usually stay cached, so the recompute is mostly prefix hits).

A request whose cached prefix continues in a slow offload tier (disk, Redis) is
admitted into ``loading``: it holds its blocks while their reads run in the
background and is skipped until they are done; at the start of a later step its
blocks are written and it joins ``running``. Others keep running meanwhile.

    waiting --admit--> running                        (device and host hits: at once)
    waiting --admit--> loading --reads done--> running  (disk, Redis hits: prefetch)

The KV manager gives a load its blocks and caches them after; the tiering
(kv/tiering.py) holds the load in between, keyed by request id.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from kvserve.config import SchedulerConfig
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.tiering import NoTiering, Promotion, Tiering
from kvserve.request import FinishReason, Request, RequestStatus
from kvserve.scheduler.policies import make_policy


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_new_tokens: int                 # the drafted tokens included
    draft: tuple[int, ...] = ()         # tokens drafted after the request's last (kvserve/speculative/)
    num_rows: int | None = None         # rows the model computes, where not every new token is one
                                        # (a blend's chunk: kvserve.request.BlendRows)

    @property
    def num_computed_rows(self) -> int:
        """The chunk's rows in the step's batch."""
        return self.num_new_tokens if self.num_rows is None else self.num_rows

    @property
    def completes_sequence(self) -> bool:
        """After this chunk every known token is computed, so a token is sampled (one per row
        from the last known token on, with a draft)."""
        return self.request.num_computed_tokens + self.num_new_tokens - len(self.draft) == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        """The rows the step computes (a blend's chunk counts its computed rows only)."""
        return sum(c.num_computed_rows for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager, tiering: Tiering | None = None,
                 whole_blocks: bool = False) -> None:
        """``tiering``: the one ``kv`` looks up and demotes through (none: no tiers).
        ``whole_blocks``: the KV format encodes some half a whole block at a time (KIVI's keys,
        ``+outN``): a prefill chunk that stops short of the prompt's end then ends on a block
        boundary (``_chunk``)."""
        self.config = config
        # a query before its block's last slot reads the block encoded when its step fills the
        # block, else the block's full-precision residual row: chunks cut at block boundaries fill
        # every prompt block in the step of its queries, however the budget cuts the prompt
        self.align = kv.block_size if whole_blocks and config.max_num_batched_tokens >= kv.block_size else 1
        self.kv = kv
        self.tiering = tiering if tiering is not None else NoTiering()
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.loading: list[Request] = []     # admitted, waiting for their tier reads
        self.num_reserved_seats = 0          # held for requests computed outside the steps (a blend under way)
        self.policy = make_policy(config)
        # counters read by the metrics observer
        self.num_preemptions = 0
        self.num_swapped_blocks = 0
        self.num_prefix_query_tokens = 0     # prompt tokens looked up at first admission
        self.num_prefix_hit_tokens = 0       # of which served from the device prefix cache
        self.num_pin_hit_tokens = 0          # of those, served from pinned blocks

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def wait_for_loads(self, timeout: float) -> None:
        """Block up to ``timeout`` seconds for the oldest load (a step found nothing to run)."""
        if self.loading:
            self.tiering.wait_for_load(self.loading[0].request_id, timeout)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_free_seat(self) -> bool:
        return len(self.running) + len(self.loading) + self.num_reserved_seats < self.config.max_num_seqs

    def reserve_seat(self) -> None:
        """Hold a seat (``has_free_seat``) for a request the caller computes over several steps
        (a blend, kvserve/blend/); ``add_computed(..., reserved=True)`` or ``release_seat`` ends it."""
        self.num_reserved_seats += 1

    def release_seat(self) -> None:
        if self.num_reserved_seats <= 0:
            raise RuntimeError("no seat is reserved")
        self.num_reserved_seats -= 1

    def add_computed(self, request: Request, num_cached_tokens: int, reserved: bool = False) -> None:
        """Run a request whose whole prompt the caller computed outside a step (a blended
        prompt, kvserve/blend/) into the blocks the KV manager gave it. A first admission,
        counted with ``num_cached_tokens`` of prefix hits; ``reserved``: in the seat it held."""
        if reserved:
            self.release_seat()
        request.num_cached_tokens = num_cached_tokens
        self.num_prefix_query_tokens += request.num_tokens
        self.num_prefix_hit_tokens += num_cached_tokens
        request.num_computed_tokens = request.num_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def add_blending(self, request: Request, num_cached_tokens: int, reserved: bool = False) -> None:
        """Run a request whose blend chose its rows (``request.blend_rows``) in the blocks the KV
        manager gave it: its next chunks compute those rows from position ``num_cached_tokens``
        (the exact prefix hit) on. A first admission, as ``add_computed``."""
        if request.blend_rows is None or request.blend_rows.first != num_cached_tokens:
            raise ValueError(f"request {request.request_id} has no blend rows from token {num_cached_tokens}")
        self.add_computed(request, num_cached_tokens, reserved)
        request.num_computed_tokens = num_cached_tokens

    def schedule(self, drafts: Mapping[str, Sequence[int]] = MappingProxyType({})) -> SchedulerOutput:
        """The step's chunks. ``drafts``: tokens drafted after a decoding request's last one,
        scheduled with it when budget and blocks allow (else dropped: it decodes one token)."""
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        self._finish_loads()

        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_rows = cost = None
            if req.blend_rows is not None:      # its budget counts the rows' attention (BlendRows.chunk)
                # without chunked prefill its rows are not cut by the budget (the step's writes still are)
                rows_budget = budget if self.config.enable_chunked_prefill else sys.maxsize
                num_new, num_rows, cost = req.blend_rows.chunk(req.num_computed_tokens, rows_budget,
                                                               self.config.max_num_batched_tokens)
            else:
                num_new = self._chunk(req.num_computed_tokens, req.num_tokens, budget)
                if num_new == 0:
                    continue        # the budget left ends before its next block boundary
            draft = tuple(drafts.get(req.request_id, ()))[:budget - 1] if num_new == 1 and num_rows is None else ()
            if draft and self.kv.try_allocate(req, 1 + len(draft)):
                out.chunks.append(ScheduledChunk(req, 1 + len(draft), draft))
                scheduled.add(req.request_id)
                budget -= 1 + len(draft)
                continue
            while not self.kv.try_allocate(req, num_new):
                victim = max((r for r in self.running if r.request_id not in scheduled),
                             key=self.policy.victim_key)
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.chunks.append(ScheduledChunk(req, num_new, num_rows=num_rows))
                scheduled.add(req.request_id)
                budget = max(0, budget - (num_new if cost is None else cost))

        if not out.preempted:
            self._admit(out, budget)
        for req in self.waiting:
            req.waited_steps += 1
        return out

    def _chunk(self, start: int, end: int, budget: int) -> int:
        """Tokens to compute from ``start`` toward ``end`` within ``budget``; short of ``end``, the
        chunk ends on a multiple of ``align`` (0 when the budget does not reach one)."""
        if end - start <= budget:
            return end - start
        return max(0, (start + budget) // self.align * self.align - start)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        policy = self.policy
        if policy.uses_cache_lookup:
            matches = {r.request_id: self.kv.match_prefix(r) for r in self.waiting}
            self.waiting.sort(key=lambda r: policy.sort_key(r, matches[r.request_id].num_blocks * self.kv.block_size))
        else:
            matches = {}
            self.waiting.sort(key=lambda r: policy.sort_key(r, 0))
        admitted = 0
        for req in self.waiting:
            if budget == 0 or not self.has_free_seat:
                break
            match = matches.get(req.request_id) or self.kv.match_prefix(req)
            match = self.kv.match_tiers(req, match)
            if self.tiering.is_prefetch(match.tier_run):
                # blocks for the hits only; the rest is allocated when it is scheduled
                if not self.kv.try_allocate(req, 0, match):
                    break
                self.tiering.start_load(req.request_id, match.tier_run, self.kv.load_targets(req, match))
                req.status = RequestStatus.RUNNING
                self.loading.append(req)
                admitted += 1
                continue
            # tier hits cost no compute budget: they are loaded, not computed
            start = match.num_blocks * self.kv.block_size
            num_left = req.num_tokens - start
            if not self.config.enable_chunked_prefill and num_left > budget:
                break
            num_new = self._chunk(start, req.num_tokens, budget)
            if num_new == 0 or not self.kv.try_allocate(req, num_new, match):
                break
            # a load that stops early leaves its blocks to compute: the chunk starts earlier
            self._start(req, self.tiering.load(match.tier_run, self.kv.load_targets(req, match)))
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, num_new))
            budget -= num_new
            admitted += 1
        del self.waiting[:admitted]

    def _start(self, req: Request, promotion: Promotion) -> None:
        """The request's tier blocks are loaded (``promotion``): cache them; the request runs
        from the first block after its cached prefix. A first admission is counted."""
        promoted = self.kv.cache_loaded_blocks(req, promotion)
        num_hit = promoted.num_blocks * self.kv.block_size
        if req.num_cached_tokens is None:
            req.num_cached_tokens = num_hit
            self.num_prefix_query_tokens += req.num_tokens
            self.num_prefix_hit_tokens += promoted.num_device_blocks * self.kv.block_size
            self.num_pin_hit_tokens += self.kv.num_pinned_hits(req, promoted.num_device_blocks) * self.kv.block_size
            self.tiering.record_hits(promoted.promotion)    # (over several layer groups: positions)
        req.num_computed_tokens = num_hit
        req.status = RequestStatus.RUNNING

    def _finish_loads(self) -> None:
        """Loading requests whose reads are done join the running batch (in admission order)."""
        for req in [r for r in self.loading if self.tiering.is_load_done(r.request_id)]:
            self._start(req, self.tiering.finish_load(req.request_id))
            self.loading.remove(req)
            self.running.append(req)

    def _preempt(self, req: Request) -> None:
        self.num_swapped_blocks += self.tiering.swap_out(self.kv.swap_candidates(req))
        self.kv.free(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.blend_rows = None           # a blend cut short is recomputed exactly
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)

    def update(self, out: SchedulerOutput) -> None:
        """Advance progress after the model ran ``out``; cache newly full blocks (a
        request over its KV budget compacts after, into fresh blocks)."""
        for chunk in out.chunks:
            req = chunk.request
            req.num_computed_tokens += chunk.num_new_tokens - len(chunk.draft)   # drafts: accept_draft
            if req.blend_rows is not None and req.num_computed_tokens >= req.blend_rows.end:
                req.blend_rows = None   # blended: it decodes like any other
            self.kv.cache_computed_blocks(req)
            self.kv.apply_budget(req)

    def accept_draft(self, req: Request, num_accepted: int) -> None:
        """The first ``num_accepted`` drafted tokens of ``req``'s last chunk were accepted (and
        appended): their KV is exact, so they count as computed; the slots of the rejected
        ones are written again by later steps, and blocks that hold none of the accepted
        tokens go back to the pool."""
        first = req.num_computed_tokens - 1        # the chunk's first position: the last known token's
        req.num_computed_tokens += num_accepted
        self.kv.cache_computed_blocks(req)
        self.kv.release_unused_blocks(req, since=first)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Retire a request (stopped, out of length, or aborted) and free its blocks."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            if req in self.loading:
                self.loading.remove(req)
                self.tiering.drop_load(req.request_id)   # its reads finish unread: its blocks are freed below
            else:
                self.running.remove(req)
        elif req in self.waiting:       # else never queued here (a blended request not admitted yet)
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.blend_rows = None           # an unfinished blend's supplied keys and values, if any
        self.kv.forget(req)

    def check_integrity(self) -> None:
        """Every loading request, and only those, has a load in flight, into blocks it holds."""
        loading = {r.request_id for r in self.loading}
        assert loading == self.tiering.loading_request_ids(), (
            f"loading requests {sorted(loading)} but loads in flight for {sorted(self.tiering.loading_request_ids())}")
        for rid in loading:
            assert self.kv.block_ids(rid), f"a load in flight for request {rid!r}, which holds no blocks"

"""Continuous batching with a token budget, chunked prefill and preemption.

Each step: running requests first (decodes take one token, unfinished prefills
their next chunk), then waiting requests in policy order while budget, sequence
slots and blocks last. A running request that cannot get a block preempts the
lowest-ranked running request, whose blocks are freed and whose tokens (prompt
plus output so far) are recomputed when it is admitted again (its freed blocks
usually stay cached, so the recompute is mostly prefix hits).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvserve.config import SchedulerConfig
from kvserve.kv.manager import KVCacheManager
from kvserve.request import FinishReason, Request, RequestStatus
from kvserve.scheduler.policies import POLICIES, uses_cache_lookup, victim_key


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    num_new_tokens: int

    @property
    def completes_sequence(self) -> bool:
        """After this chunk every known token is computed, so a token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self._sort_key = POLICIES[config.policy]
        self.num_preemptions = 0

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()

        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = self._chunk(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.try_allocate(req, num_new):
                victim = max((r for r in self.running if r.request_id not in scheduled),
                             key=lambda r: victim_key(self.config.policy, r))
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.chunks.append(ScheduledChunk(req, num_new))
                scheduled.add(req.request_id)
                budget -= num_new

        if not out.preempted:
            self._admit(out, budget)
        for req in self.waiting:
            req.waited_steps += 1
        return out

    def _chunk(self, num_tokens: int, budget: int) -> int:
        return min(num_tokens, budget)

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        policy = self.config.policy
        if uses_cache_lookup(policy):
            matches = {r.request_id: self.kv.match_prefix(r) for r in self.waiting}
            self.waiting.sort(key=lambda r: self._sort_key(
                r, matches[r.request_id].num_blocks * self.kv.block_size, self.config.max_wait_steps))
        else:
            matches = {}
            self.waiting.sort(key=lambda r: self._sort_key(r, 0, self.config.max_wait_steps))
        admitted = 0
        for req in self.waiting:
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            match = matches.get(req.request_id) or self.kv.match_prefix(req)
            match = self.kv.match_tiers(req, match)
            # tier hits cost no compute budget: they are loaded, not computed
            num_left = req.num_tokens - match.num_blocks * self.kv.block_size
            if not self.config.enable_chunked_prefill and num_left > budget:
                break
            num_new = self._chunk(num_left, budget)
            if not self.kv.try_allocate(req, num_new, match):
                break
            # a load that stops early leaves its blocks to compute, from num_hit on
            promotion = self.kv.promote(req, match)
            num_hit = (match.num_device_blocks + promotion.num_blocks) * self.kv.block_size
            if req.num_cached_tokens is None:
                req.num_cached_tokens = num_hit
                self.kv.record_lookup(req.num_tokens, match.num_device_blocks * self.kv.block_size, promotion)
            req.num_computed_tokens = num_hit
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, num_new))
            budget -= num_new
            admitted += 1
        del self.waiting[:admitted]

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        self.running.remove(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, req)

    def update(self, out: SchedulerOutput) -> None:
        """Advance progress after the model ran ``out``; cache newly full blocks."""
        for chunk in out.chunks:
            req = chunk.request
            req.num_computed_tokens += chunk.num_new_tokens
            self.kv.cache_computed_blocks(req)

    def finish(self, req: Request, reason: FinishReason) -> None:
        """Retire a request (stopped, out of length, or aborted) and free its blocks."""
        if req.status is RequestStatus.FINISHED:
            return
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.kv.forget(req)

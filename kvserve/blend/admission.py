"""Admission of requests whose prompt has segments: their own waiting queue, ahead of a step.

A segmented request waits here, not in the scheduler, until its first admission:

    wait(req)          queued in arrival order
    admit()            (before each step) while the scheduler has a seat and the pool has
                       blocks, the oldest: prefix match, blocks allocated, ``Blender.choose``
                       decides
                         -> blended outside the batch, a seat reserved meanwhile; with
                            ``step_tokens``, at most that much work (prefill-token
                            equivalents: ``BlendJob``'s token-layers / layers) per step, so the requests
                            decoding keep stepping while a long prompt blends; whole
                            without it. In the batch (``Blender.in_batch``, the default) only
                            the choice of rows runs here; then, from the next step, the
                            scheduler's steps compute them (``Scheduler.add_blending``).
                            Else, once complete, handed to the scheduler as computed
                            (``Scheduler.add_computed``): its next token is the caller's to draw
                         -> or sent to the scheduler for a full prefill (blending does not pay)
                         -> or failed (the blend raised): the caller retires it

One blend is under way at a time (in the batch: until its rows are computed). Once admitted a
request is the scheduler's like any; a preempted blended request is recomputed in full.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import NamedTuple

import torch

from kvserve.blend.blender import Blender, BlendStats, BlendTask
from kvserve.kv.manager import KVCacheManager
from kvserve.request import Request
from kvserve.scheduler.scheduler import Scheduler

log = logging.getLogger("kvserve")


class Blended(NamedTuple):
    request: Request
    logits: torch.Tensor        # [1, vocab] float32 on CPU: the prompt's next token, to draw


class BlendFailed(NamedTuple):
    request: Request            # still holding whatever blocks it got: retire it to free them
    error: str


class BlendAdmission:
    def __init__(self, blender: Blender, kv: KVCacheManager, scheduler: Scheduler,
                 step_tokens: int | None = None) -> None:
        """``step_tokens``: the blend work one step may do, in prefill-token equivalents
        (the step's token budget, as a chunked prefill gets); None: each blend whole. With
        ``blender.in_batch`` a blend here only chooses the rows to recompute; the scheduler's
        steps compute them (``Scheduler.add_blending``, kvserve.request.BlendRows)."""
        if step_tokens is not None and step_tokens < 1:
            raise ValueError(f"step_tokens must be >= 1, got {step_tokens}")
        self.blender = blender
        self.kv = kv
        self.scheduler = scheduler
        self.step_tokens = step_tokens
        self._waiting: list[Request] = []
        self._task: BlendTask | None = None      # the blend under way (its request holds blocks and a seat)
        self._chosen: list[tuple[Request, int]] = []   # rows chosen in the last step, and their exact hit
        # requests whose chosen rows the steps are computing: one at a time, as one blend runs at a
        # time outside the batch (their supplied keys and values are held outside the KV pool)
        self._in_batch: list[Request] = []

    @property
    def has_work(self) -> bool:
        """Requests waiting here or being blended."""
        return bool(self._waiting) or self._task is not None or bool(self._chosen)

    @property
    def blending(self) -> Request | None:
        """The request whose blend is under way."""
        return None if self._task is None else self._task.request

    @property
    def stats(self) -> BlendStats:
        return self.blender.stats

    def store(self, segments: Sequence[list[int]], salt: str = "") -> int:
        """Store each segment's standalone KV unless stored already; the tokens newly stored."""
        return sum(self.blender.store(ids, salt) for ids in segments)

    def wait(self, req: Request) -> None:
        self._waiting.append(req)

    def remove(self, req: Request) -> None:
        """Forget a request waiting or being blended (aborted: the caller frees its blocks);
        no-op for any other."""
        if self._task is not None and self._task.request is req:
            self._task = None
            self.scheduler.release_seat()
        elif any(r is req for r, _ in self._chosen):
            self._chosen = [(r, n) for r, n in self._chosen if r is not req]
            self.scheduler.release_seat()
        elif req in self._waiting:
            self._waiting.remove(req)

    def admit(self) -> list[Blended | BlendFailed]:
        """One step's blending (module docstring): the requests whose blend completed (or failed)."""
        results: list[Blended | BlendFailed] = []
        budget = math.inf if self.step_tokens is None else self.step_tokens * self.blender.num_layers
        # rows chosen in the last step join the batch now: a step holds a blend's choice or its
        # rows' first chunk, not both
        for req, num_known in self._chosen:
            self.scheduler.add_blending(req, num_known, reserved=True)
            self._in_batch.append(req)
        self._chosen = []
        while True:
            task = self._task if self._task is not None else self._start(results)
            if task is None:
                break
            self._task = task
            req = task.request
            try:
                if not task.advance(budget):
                    break           # more next step
                if self.blender.in_batch:
                    rows = self.blender.rows(task)
                else:
                    outcome = self.blender.finish(task)
            except Exception as e:
                log.exception("blending request %s failed", req.request_id)
                self.remove(req)
                results.append(BlendFailed(req, f"blending failed: {type(e).__name__}: {e}"))
                continue
            self._task = None
            if self.blender.in_batch:
                req.num_reused_tokens, req.num_recomputed_tokens = rows.num_reused_tokens, rows.num_recomputed_tokens
                req.blend_rows = rows
                if self.step_tokens is None:
                    self.scheduler.add_blending(req, task.num_known, reserved=True)
                    self._in_batch.append(req)
                else:
                    self._chosen.append((req, task.num_known))
            else:
                req.num_reused_tokens = outcome.num_reused_tokens
                req.num_recomputed_tokens = outcome.num_recomputed_tokens
                self.scheduler.add_computed(req, task.num_known, reserved=True)
                results.append(Blended(req, outcome.logits))
            if self.step_tokens is not None:
                break               # one blend's work per step
        return results

    def _start(self, results: list[Blended | BlendFailed]) -> BlendTask | None:
        """The next blend, its request's blocks allocated and a seat reserved; the requests
        ``choose`` sends to a full prefill go to the scheduler on the way, those that fail
        to ``results``. None when no seat, no blocks or no request is left, or while another
        blend's rows are chosen or being computed by the steps."""
        self._in_batch = [r for r in self._in_batch if r.blend_rows is not None]
        if self._chosen or self._in_batch:
            return None
        while self._waiting and self.scheduler.has_free_seat:
            req = self._waiting[0]
            try:
                match = self.kv.match_prefix(req)
                num_known = match.num_device_blocks * self.kv.block_size
                if not self.kv.try_allocate(req, req.num_tokens - num_known, match):
                    return None     # blocks free up as running requests finish
                self._waiting.pop(0)
                plan = self.blender.choose(req, num_known)
                if plan is None:
                    self.kv.free(req)
                    self.scheduler.add(req)
                    continue
                self.kv.mark_lossy(req, plan.num_exact)
                task = self.blender.start(req, plan, self.kv.block_ids(req.request_id))
            except Exception as e:
                log.exception("blending request %s failed", req.request_id)
                self.remove(req)
                results.append(BlendFailed(req, f"blending failed: {type(e).__name__}: {e}"))
                continue
            self.scheduler.reserve_seat()
            return task
        return None

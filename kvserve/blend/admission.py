"""Admission of requests whose prompt has segments: their own waiting queue, ahead of a step.

A segmented request waits here, not in the scheduler, until its first admission:

    wait(req)          queued in arrival order
    admit()            while the scheduler has a seat and the pool has blocks, the oldest:
                         prefix match, blocks allocated, ``Blender.choose`` decides
                         -> blended outside the batch, handed to the scheduler as computed
                            (``Scheduler.add_computed``): its next token is the caller's to draw
                         -> or sent to the scheduler for a full prefill (blending does not pay)
                         -> or failed (the blend raised): the caller retires it

Once admitted it is the scheduler's like any request; a preempted blended request is
recomputed in full.
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from kvserve.blend.blender import Blender
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
    def __init__(self, blender: Blender, kv: KVCacheManager, scheduler: Scheduler) -> None:
        self.blender = blender
        self.kv = kv
        self.scheduler = scheduler
        self._waiting: list[Request] = []

    @property
    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def wait(self, req: Request) -> None:
        self._waiting.append(req)

    def remove(self, req: Request) -> None:
        """Forget a waiting request (aborted); no-op when it is not waiting."""
        if req in self._waiting:
            self._waiting.remove(req)

    def admit(self) -> list[Blended | BlendFailed]:
        """First admissions in arrival order while seats and blocks last (module docstring)."""
        results: list[Blended | BlendFailed] = []
        while self._waiting and self.scheduler.has_free_seat:
            req = self._waiting[0]
            try:
                match = self.kv.match_prefix(req)
                num_known = match.num_device_blocks * self.kv.block_size
                if not self.kv.try_allocate(req, req.num_tokens - num_known, match):
                    break       # blocks free up as running requests finish
                self._waiting.pop(0)
                plan = self.blender.choose(req, num_known)
                if plan is None:
                    self.kv.free(req)
                    self.scheduler.add(req)
                    continue
                self.kv.mark_lossy(req)
                outcome = self.blender.run(req, plan, self.kv.block_ids(req.request_id))
            except Exception as e:
                log.exception("blending request %s failed", req.request_id)
                self.remove(req)
                results.append(BlendFailed(req, f"blending failed: {type(e).__name__}: {e}"))
                continue
            req.num_reused_tokens = outcome.num_reused_tokens
            req.num_recomputed_tokens = outcome.num_recomputed_tokens
            self.scheduler.add_computed(req, num_known)
            results.append(Blended(req, outcome.logits))
        return results

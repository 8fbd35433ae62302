"""Admission order of waiting requests: one sort key per policy, smallest first.

The same key, largest first, picks the victim of a preemption among running
requests, so the request admitted last under a policy is preempted first.
"""

from __future__ import annotations

from collections.abc import Callable

from kvserve.config import SCHEDULING_POLICIES
from kvserve.request import Request

# key(request, num_cached_tokens, max_wait_steps) -> sortable tuple
SortKey = Callable[[Request, int, int], tuple]


def fcfs(req: Request, num_cached_tokens: int, max_wait_steps: int) -> tuple:
    return (req.arrival_seq,)


def priority(req: Request, num_cached_tokens: int, max_wait_steps: int) -> tuple:
    return (req.priority, req.arrival_seq)


def longest_prefix_match(req: Request, num_cached_tokens: int, max_wait_steps: int) -> tuple:
    # Requests that waited too long go first, in arrival order: no starvation.
    starved = req.waited_steps >= max_wait_steps
    return (not starved, -num_cached_tokens if not starved else 0, req.arrival_seq)


POLICIES: dict[str, SortKey] = {"fcfs": fcfs, "priority": priority, "lpm": longest_prefix_match}
assert tuple(POLICIES) == SCHEDULING_POLICIES


def uses_cache_lookup(name: str) -> bool:
    """Whether the policy's key depends on the cached-prefix length."""
    return name == "lpm"


def victim_key(name: str, req: Request) -> tuple:
    """Largest key is preempted first: the lowest priority, then the newest."""
    if name == "priority":
        return (req.priority, req.arrival_seq)
    return (req.arrival_seq,)

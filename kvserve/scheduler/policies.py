"""Scheduling policies: the order of admission, and of preemption among running requests.

A policy is looked up by the name the user types (``--scheduling-policy``):

    name      admits first                                   preempts first
    fcfs      the earliest arrival                           the newest arrival
    priority  the lowest priority value, then arrival        the highest value, then the newest
    lpm       the longest cached prefix; a request that      the newest arrival
              waited max_wait_steps steps goes first (in
              arrival order), so none starves
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, ClassVar

from kvserve.config import SchedulerConfig
from kvserve.request import Request


class SchedulingPolicy(ABC):
    """Sort keys for the scheduler, which admits waiting requests in ascending
    ``sort_key`` order and preempts the running request with the largest ``victim_key``.

    Keys are tuples compared with ``<``; computing one changes nothing. When
    ``uses_cache_lookup`` is set, the scheduler matches every waiting request's prefix
    against the cache once per step and passes the cached length; otherwise it passes 0.
    """

    name: ClassVar[str]
    uses_cache_lookup: ClassVar[bool] = False

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config

    @abstractmethod
    def sort_key(self, request: Request, num_cached_tokens: int) -> tuple[Any, ...]:
        """Admission order: smallest first."""

    def victim_key(self, request: Request) -> tuple[Any, ...]:
        """Preemption order: largest first (by default the newest arrival)."""
        return (request.arrival_seq,)


class FirstComeFirstServed(SchedulingPolicy):
    name = "fcfs"

    def sort_key(self, request: Request, num_cached_tokens: int) -> tuple[Any, ...]:
        return (request.arrival_seq,)


class Priority(SchedulingPolicy):
    name = "priority"

    def sort_key(self, request: Request, num_cached_tokens: int) -> tuple[Any, ...]:
        return (request.priority, request.arrival_seq)

    def victim_key(self, request: Request) -> tuple[Any, ...]:
        return (request.priority, request.arrival_seq)


class LongestPrefixMatch(SchedulingPolicy):
    name = "lpm"
    uses_cache_lookup = True

    def sort_key(self, request: Request, num_cached_tokens: int) -> tuple[Any, ...]:
        starved = request.waited_steps >= self.config.max_wait_steps
        return (not starved, -num_cached_tokens if not starved else 0, request.arrival_seq)


POLICIES: Mapping[str, type[SchedulingPolicy]] = MappingProxyType(
    {cls.name: cls for cls in (FirstComeFirstServed, Priority, LongestPrefixMatch)})


def policy_class(name: str) -> type[SchedulingPolicy]:
    """The policy registered as ``name``; ValueError naming the known ones otherwise."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown scheduling policy {name!r}; choose one of {tuple(POLICIES)}")
    return cls


def make_policy(config: SchedulerConfig) -> SchedulingPolicy:
    return policy_class(config.policy)(config)

"""A clock for tests: seconds that move only when a test says so (pin expiry, Redis
backoff), so timing never decides a test."""

from __future__ import annotations


class FakeClock:
    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

"""Fixtures of the cluster tests: a throwaway Redis (the shared tier)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from offload.redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A redis-server on a free loopback port (skips when none is installed)."""
    srv = RedisServer(tmp_path)
    srv.start()
    yield srv
    srv.stop()

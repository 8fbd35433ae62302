"""Fixtures of the offload tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from redis_server import RedisServer


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A throwaway redis-server on a free loopback port (skips when none is installed)."""
    srv = RedisServer(tmp_path)
    srv.start()
    yield srv
    srv.stop()

"""Fixtures of the cluster tests: a throwaway Redis (the shared tier)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from offload.redis_server import RedisServer

# the single server's test helpers and bad-input cases, to compare the ingress with it
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "server"))


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A redis-server on a free loopback port (skips when none is installed)."""
    srv = RedisServer(tmp_path)
    srv.start()
    yield srv
    srv.stop()

import time

import pytest
from fake_clock import FakeClock
from redis_server import RedisServer

from kvserve.offload import BlockStore, RedisConfig, make_store

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install 'redis>=5' hiredis)")
from kvserve.offload.redis_transport import RedisTransport  # after the skip: it needs redis-py

FMT = "model=test/format=int8"
KEYS = [bytes([i]) * 32 for i in range(8)]


def payload(i: int) -> bytes:
    return bytes([i]) * 5000


@pytest.fixture
def server(redis_server: RedisServer) -> RedisServer:
    return redis_server


def open_store(url: str, namespace: str = "m1", clock: FakeClock | None = None, **options) -> BlockStore:
    options.setdefault("backoff_s", 0.2)
    options.setdefault("max_backoff_s", 0.4)
    config = RedisConfig(url=url, namespace=namespace, **options)
    return BlockStore(RedisTransport(config) if clock is None else RedisTransport(config, clock), FMT)


def redis_key(key: bytes, namespace: str = "m1") -> str:
    return f"kvserve:{namespace}:{key.hex()}"


def test_round_trip_exists_remove_and_memory(server):
    store = make_store("redis", FMT, url=server.url, namespace="m1")
    assert store.put([(KEYS[i], payload(i)) for i in range(3)]) == 3
    assert store.get([KEYS[0], KEYS[5], KEYS[2]]) == [payload(0), None, payload(2)]
    assert store.contains([KEYS[1], KEYS[5]]) == [True, False]
    store.remove([KEYS[1], KEYS[5]])
    assert store.contains([KEYS[1]]) == [False]
    assert store.get([]) == [] and store.contains([]) == []
    assert store.transport.nbytes_used > 10_000
    assert store.transport.capacity_bytes == 100 * 1024 * 1024  # the fixture's --maxmemory
    s = store.stats()
    assert (s.hits, s.misses, s.bytes_read, s.bytes_written, s.unavailable_periods) == (2, 1, 10_000, 15_000, 0)
    store.close()


def test_namespaces_do_not_see_each_other(server):
    a, b = open_store(server.url, "model-a"), open_store(server.url, "model-b")
    a.put([(KEYS[0], payload(0))])
    assert b.get([KEYS[0]]) == [None] and b.contains([KEYS[0]]) == [False]
    assert a.get([KEYS[0]]) == [payload(0)]
    raw = redis.Redis.from_url(server.url)
    assert raw.exists(f"kvserve:model-a:{KEYS[0].hex()}") == 1
    assert raw.keys("kvserve:model-b:*") == []
    raw.close()


def test_ttl_expires_blocks(server):
    raw = redis.Redis.from_url(server.url)
    # a TTL long enough that no pause of this machine expires it before the checks
    store = open_store(server.url, ttl_s=60)
    store.put([(KEYS[0], payload(0))])
    assert 0 < raw.pttl(redis_key(KEYS[0])) <= 60_000      # SET ... PX: the TTL counts from the write
    assert store.get([KEYS[0]]) == [payload(0)]
    assert 0 < raw.pttl(redis_key(KEYS[0])) <= 60_000      # a hit does not remove it
    # Redis expires keys in real time: a short TTL, then poll (the deadline only bounds a failure)
    short = open_store(server.url, ttl_s=0.3)
    short.put([(KEYS[1], payload(1))])
    assert raw.pttl(redis_key(KEYS[1])) <= 300             # set (or already expired: -2), never without one (-1)
    assert raw.pttl(redis_key(KEYS[1])) != -1
    deadline = time.monotonic() + 30
    while short.get([KEYS[1]]) != [None]:
        assert time.monotonic() < deadline, "a block outlived its TTL"
        time.sleep(0.02)
    raw.close()


def test_password_from_the_url(tmp_path):
    srv = RedisServer(tmp_path, password="s3cret")
    srv.start()
    try:
        store = open_store(srv.url)
        assert store.put([(KEYS[0], payload(0))]) == 1
        assert store.get([KEYS[0]]) == [payload(0)]
        wrong = open_store(srv.url.replace("s3cret", "nope"))
        assert wrong.get([KEYS[0]]) == [None] and wrong.put([(KEYS[1], payload(1))]) == 0
        assert not wrong.transport.is_available and wrong.stats().unavailable_periods == 1
    finally:
        srv.stop()


def test_a_dead_server_answers_misses_fast_and_the_tier_recovers(server):
    clock = FakeClock(1000.0)
    store = open_store(server.url, clock=clock)      # backoff 0.2 s, doubling up to 0.4 s
    store.put([(KEYS[0], payload(0))])
    raw = redis.Redis.from_url(server.url)
    server.stop()
    assert store.get([KEYS[0], KEYS[1]]) == [None, None]      # connection refused: down
    assert not store.transport.is_available and store.stats().unavailable_periods == 1
    server.start()  # same port, empty (no persistence); up, but inside the backoff nobody asks it
    raw.set(redis_key(KEYS[0]), b"anything")
    clock.advance(0.19)
    assert store.put([(KEYS[2], payload(2))]) == 0 and store.contains([KEYS[0]]) == [False]
    assert not store.transport.is_available and raw.exists(redis_key(KEYS[2])) == 0
    server.stop()
    clock.advance(0.02)  # backoff over: the next call tries, fails, and backs off further (0.4 s)
    assert store.get([KEYS[0]]) == [None] and store.stats().unavailable_periods == 1
    assert not store.transport.is_available
    server.start()
    raw.set(redis_key(KEYS[0]), b"anything")
    clock.advance(0.39)  # still inside the doubled backoff: not tried
    assert store.contains([KEYS[0]]) == [False] and not store.transport.is_available
    clock.advance(0.02)  # past it: the next call reaches the server, and the tier is back
    assert store.put([(KEYS[3], payload(3))]) == 1
    assert store.transport.is_available
    assert store.get([KEYS[3]]) == [payload(3)]
    s = store.stats()
    assert (s.unavailable_periods, s.puts_dropped, s.hits) == (1, 1, 1)
    raw.close()


def test_a_stalled_server_times_out_instead_of_hanging(server):
    clock = FakeClock(1000.0)
    store = open_store(server.url, clock=clock, timeout_s=0.3)
    store.put([(KEYS[0], payload(0))])
    server.pause()
    try:
        start = time.monotonic()
        assert store.get([KEYS[0]]) == [None]
        assert time.monotonic() - start < 2.0    # the socket timeout (0.3 s) is real time: a hang guard
        assert not store.transport.is_available and store.stats().unavailable_periods == 1
    finally:
        server.resume()
    assert store.get([KEYS[0]]) == [None]        # inside the backoff: not asked yet
    clock.advance(0.25)                          # past the backoff (0.2 s)
    assert store.get([KEYS[0]]) == [payload(0)]  # the data survived the stall
    assert store.transport.is_available


def test_two_engines_share_blocks_through_one_server(server):
    engine_a, engine_b = open_store(server.url), open_store(server.url)
    engine_a.put([(KEYS[i], payload(i)) for i in range(4)])
    assert engine_b.get(KEYS[:5]) == [payload(i) for i in range(4)] + [None]
    engine_b.put([(KEYS[7], payload(7))])
    assert engine_a.get([KEYS[7]]) == [payload(7)]
    other_format = BlockStore(engine_a.transport, "model=test/format=fp16")
    assert other_format.get([KEYS[1]]) == [None] and other_format.stats().corrupt == 1


def test_a_refused_command_drops_the_put_without_marking_the_server_down(server):
    raw = redis.Redis.from_url(server.url)
    raw.config_set("maxmemory-policy", "noeviction")
    raw.config_set("maxmemory", "1mb")
    store = open_store(server.url)
    assert store.put([(KEYS[0], bytes(2 << 20))]) == 0  # OOM: the server refuses the SET
    assert store.transport.is_available and store.stats().puts_dropped == 1
    raw.config_set("maxmemory", "100mb")
    assert store.put([(KEYS[0], payload(0))]) == 1
    raw.close()


def test_throwaway_redis_answers_as_soon_as_it_is_yielded():
    from kvserve.offload.measure import throwaway_redis

    with throwaway_redis() as url:
        if url is None:
            pytest.skip("redis-server is not installed")
        store = make_store("redis", FMT, url=url, namespace="m1")
        assert store.put([(KEYS[0], payload(0))]) == 1 and store.transport.is_available
        store.close()

import time

import pytest
from redis_server import RedisServer

from kvserve.offload import BlockStore, make_store, make_transport

redis = pytest.importorskip("redis", reason="redis-py is not installed (pip install 'redis>=5' hiredis)")

FMT = "model=test/format=int8"
KEYS = [bytes([i]) * 32 for i in range(8)]


def payload(i: int) -> bytes:
    return bytes([i]) * 5000


@pytest.fixture
def server(redis_server: RedisServer) -> RedisServer:
    return redis_server


def open_store(url: str, namespace: str = "m1", **options) -> BlockStore:
    options.setdefault("backoff_s", 0.2)
    options.setdefault("max_backoff_s", 0.4)
    return BlockStore(make_transport("redis", url=url, namespace=namespace, **options), FMT)


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
    store = open_store(server.url, ttl_s=0.3)
    store.put([(KEYS[0], payload(0))])
    raw = redis.Redis.from_url(server.url)
    assert 0 < raw.pttl(f"kvserve:m1:{KEYS[0].hex()}") <= 300
    raw.close()
    assert store.get([KEYS[0]]) == [payload(0)]
    time.sleep(0.4)
    assert store.get([KEYS[0]]) == [None]


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
    store = open_store(server.url)
    store.put([(KEYS[0], payload(0))])
    server.stop()
    start = time.monotonic()
    assert store.get([KEYS[0], KEYS[1]]) == [None, None]
    assert time.monotonic() - start < 2.0
    assert not store.transport.is_available and store.stats().unavailable_periods == 1
    start = time.monotonic()  # within the backoff: answered without touching the network
    assert store.put([(KEYS[2], payload(2))]) == 0 and store.contains([KEYS[0]]) == [False]
    assert time.monotonic() - start < 0.05
    time.sleep(0.25)  # backoff over: the next call tries, fails, and backs off further
    assert store.get([KEYS[0]]) == [None] and store.stats().unavailable_periods == 1
    server.start()  # same port, empty (no persistence)
    time.sleep(0.45)  # longer than the doubled backoff (0.4 s cap)
    assert store.put([(KEYS[3], payload(3))]) == 1
    assert store.transport.is_available
    assert store.get([KEYS[3]]) == [payload(3)]
    s = store.stats()
    assert (s.unavailable_periods, s.puts_dropped, s.hits) == (1, 1, 1)


def test_a_stalled_server_times_out_instead_of_hanging(server):
    store = open_store(server.url, timeout_s=0.3)
    store.put([(KEYS[0], payload(0))])
    server.pause()
    try:
        start = time.monotonic()
        assert store.get([KEYS[0]]) == [None]
        assert time.monotonic() - start < 2.0
        assert not store.transport.is_available
    finally:
        server.resume()
    time.sleep(0.25)
    assert store.get([KEYS[0]]) == [payload(0)]  # the data survived the stall


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

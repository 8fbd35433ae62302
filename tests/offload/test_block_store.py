import pytest

from kvserve.offload import TIERS, BlockStore, HostConfig, make_store, make_transport
from kvserve.offload.host import HostTransport

K1, K2, K3 = (bytes([i]) * 32 for i in range(1, 4))


def test_every_read_is_verified_and_a_corrupt_entry_is_removed_and_counted():
    store = BlockStore(HostTransport(HostConfig(capacity_bytes=1 << 20)), b"fmt")
    assert store.put([(K1, b"one"), (K2, bytearray(b"two"))]) == 2
    good = store.transport.get_many([K2])[0]
    assert good is not None
    store.transport.put_many([(K1, good)])  # a valid block of K2 filed under K1
    assert store.get([K1, K2, K3]) == [None, b"two", None]
    assert store.contains([K1, K2]) == [False, True]
    s = store.stats()
    assert (s.hits, s.misses, s.corrupt, s.bytes_read, s.bytes_written, s.read_calls, s.write_calls) == \
        (1, 2, 1, 3, 6, 1, 1)
    assert s.read_seconds > 0 and s.read_bytes_per_s is not None and s.hit_rate == pytest.approx(1 / 3)


def test_a_block_written_under_one_format_is_a_miss_under_another():
    transport = HostTransport(HostConfig(capacity_bytes=1 << 20))
    BlockStore(transport, "int8").put([(K1, b"payload")])
    other = BlockStore(transport, "fp16")
    assert other.get([K1]) == [None] and other.stats().corrupt == 1


def test_registry_names_and_option_errors(tmp_path):
    assert list(TIERS) == ["host", "disk", "redis"]
    store = make_store("host", "fmt", capacity_bytes=100)
    assert store.tier == "host" and store.transport.capacity_bytes == 100
    disk = make_transport("disk", path=str(tmp_path), capacity_bytes=1000, fsync=False)
    assert disk.name == "disk"
    disk.close()
    with pytest.raises(ValueError, match="unknown offload tier 'ssd'; known tiers: host, disk, redis"):
        make_transport("ssd")
    with pytest.raises(ValueError, match="offload tier 'host'.*capcity"):
        make_transport("host", capcity=1)
    with pytest.raises(ValueError, match="capacity_bytes must be positive"):
        make_transport("host", capacity_bytes=0)
    with pytest.raises(ValueError, match="namespace must be non-empty"):
        make_transport("redis", url="redis://127.0.0.1:1/0", namespace="")
    with pytest.raises(ValueError, match="url must start with redis://"):
        make_transport("redis", url="127.0.0.1:6379", namespace="m")


def test_transports_from_tier_configs(tmp_path):
    from kvserve.config import DiskConfig, RedisConfig
    from kvserve.offload.tiered import open_transports, with_namespace

    assert make_transport(HostConfig(capacity_bytes=100)).capacity_bytes == 100
    with pytest.raises(ValueError, match="redis tier needs a namespace"):
        make_transport(RedisConfig("redis://127.0.0.1:1/0"))
    named = RedisConfig("redis://127.0.0.1:1/0", namespace="mine")
    assert [c.namespace for c in with_namespace([RedisConfig("redis://127.0.0.1:1/0"), named], "derived")] == [
        "derived", "mine"]
    opened = open_transports((HostConfig(100), DiskConfig(str(tmp_path), capacity_bytes=1000)), "ns")
    assert [t.name for t in opened] == ["host", "disk"]
    for t in opened:
        t.close()

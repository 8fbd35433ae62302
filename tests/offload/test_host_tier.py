import threading

from hypothesis import given, settings
from hypothesis import strategies as st

from kvserve.offload import HostConfig
from kvserve.offload.host import HostTransport

CAPACITY = 100


def key(i: int) -> bytes:
    return bytes([i]) * 32


class ModelLRU:
    """A plain list, least recently used first: the reference the transport must match."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.items: list[tuple[bytes, bytes]] = []

    def get(self, k: bytes) -> bytes | None:
        for i, (kk, v) in enumerate(self.items):
            if kk == k:
                self.items.append(self.items.pop(i))
                return v
        return None

    def put(self, k: bytes, v: bytes) -> int:
        if len(v) > self.capacity:
            return 0
        self.items = [(kk, vv) for kk, vv in self.items if kk != k]
        while sum(len(vv) for _, vv in self.items) + len(v) > self.capacity:
            self.items.pop(0)
        self.items.append((k, v))
        return 1

    def remove(self, k: bytes) -> None:
        self.items = [(kk, vv) for kk, vv in self.items if kk != k]


ops = st.lists(st.tuples(st.sampled_from(["put", "get", "remove", "exists"]), st.integers(0, 7),
                         st.integers(0, CAPACITY + 20)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_capacity_is_never_exceeded_and_lru_order_matches_a_reference(operations):
    tier = HostTransport(HostConfig(capacity_bytes=CAPACITY))
    model = ModelLRU(CAPACITY)
    for op, i, size in operations:
        value = bytes([size % 256]) * size
        if op == "put":
            assert tier.put_many([(key(i), value)]) == model.put(key(i), value)
        elif op == "get":
            assert tier.get_many([key(i)]) == [model.get(key(i))]
        elif op == "remove":
            tier.remove([key(i)])
            model.remove(key(i))
        else:
            assert tier.exists([key(i)]) == [any(k == key(i) for k, _ in model.items)]
        tier.check_integrity()
        assert tier.nbytes_used <= CAPACITY
        assert tier.keys_lru_first() == [k for k, _ in model.items]


def test_lru_order_on_a_tiny_capacity():
    tier = HostTransport(HostConfig(capacity_bytes=30))
    a, b, c, d, e = (key(i) for i in range(5))
    assert tier.put_many([(a, b"a" * 10), (b, b"b" * 10), (c, b"c" * 10)]) == 3
    assert tier.get_many([a]) == [b"a" * 10]  # a becomes most recent
    assert tier.put_many([(d, b"d" * 10)]) == 1  # evicts b, the least recent
    assert tier.keys_lru_first() == [c, a, d]
    assert tier.exists([a, b, c, d]) == [True, False, True, True]
    assert tier.keys_lru_first() == [c, a, d]  # exists is not an access
    assert tier.put_many([(e, b"e" * 20)]) == 1  # needs two slots: evicts c then a
    assert tier.keys_lru_first() == [d, e]
    assert tier.nbytes_used == 30
    tier.put_many([(d, b"D" * 5)])  # replacing a value frees its old bytes, and makes it recent
    assert tier.keys_lru_first() == [e, d] and tier.nbytes_used == 25
    tier.check_integrity()


def test_a_value_larger_than_the_capacity_is_refused_without_evicting():
    tier = HostTransport(HostConfig(capacity_bytes=30))
    tier.put_many([(key(0), b"x" * 30)])
    assert tier.put_many([(key(1), b"y" * 31)]) == 0
    assert tier.keys_lru_first() == [key(0)] and tier.nbytes_used == 30
    assert tier.get_many([key(1), key(0)]) == [None, b"x" * 30]


def test_concurrent_puts_and_gets_keep_the_accounting_exact():
    tier = HostTransport(HostConfig(capacity_bytes=1000))

    def work(seed: int) -> None:
        for n in range(300):
            i = (seed * 7 + n * 13) % 50
            tier.put_many([(key(i), bytes(i * 3))])
            tier.get_many([key((i + 1) % 50)])
            if n % 17 == 0:
                tier.remove([key(i)])

    threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    tier.check_integrity()
    assert tier.nbytes_used <= 1000

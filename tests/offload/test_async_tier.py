import threading
from collections.abc import Sequence

import pytest

from kvserve.offload import AsyncTier, BlockStore, HostConfig
from kvserve.offload.host import HostTransport

K = [bytes([i]) * 32 for i in range(16)]


class GatedTransport(HostTransport):
    """A host tier whose puts wait for ``gate`` and are recorded; optionally failing."""

    def __init__(self, fail: bool = False) -> None:
        super().__init__(HostConfig(capacity_bytes=1 << 20))
        self.gate = threading.Event()
        self.put_calls: list[list[bytes]] = []
        self.fail = fail

    def put_many(self, items: Sequence[tuple[bytes, bytes]]) -> int:
        self.put_calls.append([k for k, _ in items])
        assert self.gate.wait(10)
        if self.fail:
            raise RuntimeError("disk on fire")
        return super().put_many(items)

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if self.fail:
            raise RuntimeError("disk on fire")
        return super().get_many(keys)


def make(transport=None, **options) -> AsyncTier:
    transport = transport or HostTransport(HostConfig(capacity_bytes=1 << 20))
    return AsyncTier(BlockStore(transport, "fmt"), **options)


def test_puts_complete_and_flush_waits_for_them():
    tier = make()
    futures = [tier.submit_put([(K[2 * i], b"a" * 100), (K[2 * i + 1], b"b" * 100)]) for i in range(8)]
    tier.flush()
    assert all(f.done() and f.result() == 2 for f in futures)
    assert tier.store.contains(K) == [True] * 16
    got = tier.submit_get([K[0], K[1]]).result(timeout=5)
    assert got == [b"a" * 100, b"b" * 100]
    s = tier.stats()
    assert (s.puts_submitted, s.gets_submitted, s.coalesced, s.errors, s.dropped) == (16, 2, 0, 0, 0)
    tier.close()


def test_a_put_of_a_key_in_flight_is_coalesced_and_gets_read_it_from_flight():
    transport = GatedTransport()
    tier = make(transport, num_workers=3)
    source = bytearray(b"x" * 64)
    first = tier.submit_put([(K[0], source)])
    source[:] = b"y" * 64  # the caller reuses its buffer at once: the put copied it
    second = tier.submit_put([(K[0], b"x" * 64), (K[1], b"z" * 64), (K[1], b"z" * 64)])
    only_dupes = tier.submit_put([(K[0], b"x" * 64)])
    assert only_dupes.done() and only_dupes.result() == 0
    assert tier.submit_get([K[0], K[2]]).result(timeout=5) == [b"x" * 64, None]  # before any put finished
    assert tier.contains([K[0], K[2]]) == [True, False]   # in flight counts as held
    transport.gate.set()
    tier.flush()
    assert tier.contains([K[1], K[2]]) == [True, False]   # now held by the store
    assert (first.result(), second.result()) == (1, 1)
    assert sorted(transport.put_calls) == [[K[0]], [K[1]]]
    assert tier.store.get([K[0], K[1]]) == [b"x" * 64, b"z" * 64]
    s = tier.stats()
    assert (s.puts_submitted, s.coalesced, s.inflight_hits) == (5, 3, 1)
    tier.close()


def test_errors_are_counted_never_raised():
    transport = GatedTransport(fail=True)
    transport.gate.set()
    tier = make(transport)
    assert tier.submit_put([(K[0], b"x")]).result(timeout=5) == 0
    assert tier.submit_get([K[0], K[1]]).result(timeout=5) == [None, None]
    tier.flush()
    assert tier.stats().errors == 2
    assert tier.submit_put([(K[0], b"x")]).result(timeout=5) == 0  # not stuck in flight after a failure
    tier.close()


def test_a_full_queue_drops_puts_not_gets_and_close_finishes_pending_work():
    """Puts past ``max_pending`` are dropped; a get is not, nor does it wait behind the puts: it
    runs on the read workers while the one put worker is stuck (the gate closed)."""
    transport = GatedTransport()
    tier = make(transport, num_workers=1, max_pending=1)
    transport.gate.set()
    tier.store.put([(K[3], b"w")])          # held by the store before the gate closes
    transport.gate.clear()
    held = tier.submit_put([(K[0], b"x")])
    dropped_put = tier.submit_put([(K[1], b"y")])
    assert dropped_put.result(timeout=0) == 0
    assert tier.submit_get([K[0], K[3], K[1]]).result(timeout=10) == [b"x", b"w", None]   # K[0]: the put in flight
    assert not held.done()
    assert tier.stats().dropped == 1
    transport.gate.set()
    tier.close()
    assert held.result(timeout=0) == 1
    with pytest.raises(RuntimeError, match="closed"):
        tier.submit_put([(K[2], b"z")])
    with pytest.raises(ValueError, match="max_pending"):
        make(max_pending=0)


def test_a_required_put_is_queued_past_a_full_queue():
    """A pinned block being evicted has no other copy: its put is never dropped for a full queue."""
    transport = GatedTransport()
    tier = make(transport, num_workers=1, max_pending=1)
    held = tier.submit_put([(K[0], b"x")])
    required = tier.submit_put([(K[1], b"y")], required=True)
    assert tier.stats().dropped == 0
    transport.gate.set()
    assert held.result(timeout=10) == 1 and required.result(timeout=10) == 1
    assert tier.store.get([K[1]]) == [b"y"]
    tier.close()

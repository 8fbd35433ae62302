"""A tier's behaviour comes from its transport class's traits, never from its name."""

from __future__ import annotations

import pytest

from kvserve.offload import HostConfig
from kvserve.offload.base import Transport
from kvserve.offload.disk import DiskTransport
from kvserve.offload.host import HostTransport
from kvserve.offload.tiered import make_tiered_store

K = [bytes([i]) * 32 for i in range(4)]
TRAITS = ("is_local", "loads_synchronously", "is_write_once", "is_swap_target")


def traits(cls: type[Transport]) -> tuple[bool, ...]:
    return tuple(getattr(cls, t) for t in TRAITS)


def test_the_built_in_tiers_traits():
    redis_transport = pytest.importorskip("kvserve.offload.redis_transport")
    #                                  local  sync   write-once  swap target
    assert traits(HostTransport) == (True, True, False, True)
    assert traits(DiskTransport) == (True, False, True, False)
    assert traits(redis_transport.RedisTransport) == (False, False, False, False)
    assert traits(Transport) == (False, False, False, False)    # the cautious defaults a new tier starts from


class CountingHost(HostTransport):
    """A host-like tier that counts the values it is given."""

    name = "disk"        # a label only: it does not make the tier write-once

    def __init__(self) -> None:
        super().__init__(HostConfig(capacity_bytes=1 << 20))
        self.num_put = 0

    def put_many(self, items):
        self.num_put += len(items)
        return super().put_many(items)


class WriteOnceHost(CountingHost):
    name = "tape"
    is_write_once = True


@pytest.mark.parametrize("cls, num_put", [(CountingHost, 4), (WriteOnceHost, 3)])
def test_write_once_is_a_trait(cls, num_put):
    transport = cls()
    store = make_tiered_store([transport], "fmt")
    store.demote([(K[0], b"a" * 10), (K[1], b"b" * 10)])
    store.flush()
    store.demote([(K[1], b"b" * 10), (K[2], b"c" * 10)])    # K[1] is held already
    store.flush()
    assert transport.num_put == num_put
    assert store.lookup(K).num_blocks == 3
    store.close()

"""The tiers users can name: ``host``, ``disk``, ``redis``.

Each name maps to its frozen config class and a factory; ``make_transport`` validates
the options through the config before anything is opened. Factories import their
module lazily, so naming ``host`` never imports the Redis client.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, NamedTuple

from kvserve.offload.base import Transport
from kvserve.offload.config import DiskConfig, HostConfig, RedisConfig
from kvserve.offload.store import BlockStore


def _host(config: Any) -> Transport:
    from kvserve.offload.host import HostTransport
    return HostTransport(config)


def _disk(config: Any) -> Transport:
    from kvserve.offload.disk import DiskTransport
    return DiskTransport(config)


def _redis(config: Any) -> Transport:
    from kvserve.offload.redis_transport import RedisTransport
    return RedisTransport(config)


class TierKind(NamedTuple):
    config_class: type
    factory: Callable[[Any], Transport]


TIERS: Mapping[str, TierKind] = MappingProxyType({
    "host": TierKind(HostConfig, _host),
    "disk": TierKind(DiskConfig, _disk),
    "redis": TierKind(RedisConfig, _redis),
})


def make_transport(name: str, **options: Any) -> Transport:
    """The transport registered as ``name``, configured by ``options`` (its config's fields)."""
    kind = TIERS.get(name)
    if kind is None:
        raise ValueError(f"unknown offload tier {name!r}; known tiers: {', '.join(TIERS)}")
    try:
        config = kind.config_class(**options)
    except TypeError as e:
        raise ValueError(f"offload tier {name!r}: {e}") from None
    return kind.factory(config)


def make_store(name: str, fmt_tag: bytes | str, **options: Any) -> BlockStore:
    """A BlockStore of format ``fmt_tag`` over the transport registered as ``name``."""
    return BlockStore(make_transport(name, **options), fmt_tag)

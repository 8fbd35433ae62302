"""The tiers: each config class (kvserve/config.py) maps to the factory of its transport.

``make_transport(config)`` opens the tier a config describes; ``make_transport(name,
**options)`` does the same by the name users type (``host``, ``disk``, ``redis``),
validating the options through the config before anything is opened. Factories import
their module lazily, so a host tier never imports the Redis client.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any

from kvserve.config import DiskConfig, HostConfig, RedisConfig, TierConfig
from kvserve.offload.base import Transport
from kvserve.offload.store import BlockStore


def _host(config: HostConfig) -> Transport:
    from kvserve.offload.host import HostTransport
    return HostTransport(config)


def _disk(config: DiskConfig) -> Transport:
    from kvserve.offload.disk import DiskTransport
    return DiskTransport(config)


def _redis(config: RedisConfig) -> Transport:
    if config.namespace is None:
        raise ValueError("redis tier needs a namespace (the engine derives one from the model and KV format)")
    from kvserve.offload.redis_transport import RedisTransport
    return RedisTransport(config)


TIERS: Mapping[str, type[TierConfig]] = MappingProxyType({"host": HostConfig, "disk": DiskConfig,
                                                          "redis": RedisConfig})
FACTORIES: Mapping[type, Callable[[Any], Transport]] = MappingProxyType({HostConfig: _host, DiskConfig: _disk,
                                                                         RedisConfig: _redis})


def make_transport(tier: TierConfig | str, **options: Any) -> Transport:
    """The transport of the tier config ``tier``, or of the tier registered as ``tier``
    configured by ``options`` (its config's fields)."""
    if isinstance(tier, str):
        config_class = TIERS.get(tier)
        if config_class is None:
            raise ValueError(f"unknown offload tier {tier!r}; known tiers: {', '.join(TIERS)}")
        try:
            config = config_class(**options)
        except TypeError as e:
            raise ValueError(f"offload tier {tier!r}: {e}") from None
        return FACTORIES[config_class](config)
    if options:
        raise TypeError("make_transport(config) takes no options: they are the config's fields")
    factory = FACTORIES.get(type(tier))
    if factory is None:
        raise ValueError(f"no offload tier is configured by {type(tier).__name__}")
    return factory(tier)


def make_store(name: str, fmt_tag: bytes | str, **options: Any) -> BlockStore:
    """A BlockStore of format ``fmt_tag`` over the transport registered as ``name``."""
    return BlockStore(make_transport(name, **options), fmt_tag)

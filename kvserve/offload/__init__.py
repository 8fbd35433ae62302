"""Offload tiers: host memory, local disk and Redis, behind one small interface.

    TieredStore    the tiers in lookup order (tiered.py)
      AsyncTier    puts and prefetch gets of a BlockStore on a thread pool
        BlockStore payloads of one KV format; serializes, verifies every read, counts
          Transport  bytes under 32-byte keys: HostTransport, DiskTransport, RedisTransport;
                     its class's traits decide how the engine uses the tier
    CostModel      load or recompute (cost.py)

Keys and bytes only: nothing here imports ``kvserve.kv``, whose tiering (kv/tiering.py)
moves device blocks to and from these bytes. ``make_store("disk", fmt_tag, path=...,
capacity_bytes=...)`` builds one by the name users type; ``make_transport(DiskConfig(...))``
one from a tier config (kvserve/config.py). See docs/offload.md.
"""

from kvserve.config import DiskConfig, HostConfig, RedisConfig
from kvserve.offload.async_tier import AsyncStats, AsyncTier
from kvserve.offload.base import Transport
from kvserve.offload.registry import TIERS, make_store, make_transport
from kvserve.offload.serialization import HEADER_NBYTES, CorruptBlockError, decode_block, encode_block
from kvserve.offload.store import BlockStore, TierStats

__all__ = [
    "HEADER_NBYTES",
    "TIERS",
    "AsyncStats",
    "AsyncTier",
    "BlockStore",
    "CorruptBlockError",
    "DiskConfig",
    "HostConfig",
    "RedisConfig",
    "TierStats",
    "Transport",
    "decode_block",
    "encode_block",
    "make_store",
    "make_transport",
]

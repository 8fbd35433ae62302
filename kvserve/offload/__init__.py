"""Offload tiers: host memory, local disk and Redis, behind one small interface.

    BlockStore   payloads of one KV format; serializes, verifies every read, counts
      Transport  bytes under 32-byte keys: HostTransport, DiskTransport, RedisTransport
    AsyncTier    puts and prefetch gets of a BlockStore on a thread pool

``make_store("disk", fmt_tag, path=..., capacity_bytes=...)`` builds one by the name
users type; ``make_transport(DiskConfig(...))`` from a tier config (kvserve/config.py).
See docs/offload.md.
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

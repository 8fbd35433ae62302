"""What travels between the ingress, the router and the engine replicas.

Block keys travel as *digests*: their first 8 bytes. A router only needs to tell which
replica holds a prefix; two keys sharing a digest (odds 2^-64 per pair) would cost a
misrouted request, a cache miss, never a wrong answer: the engine matches full keys and
compares the block's tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

DIGEST_NBYTES = 8


def digests(keys: Iterable[bytes]) -> tuple[bytes, ...]:
    return tuple(k[:DIGEST_NBYTES] for k in keys)


def pack(keys: Iterable[bytes]) -> bytes:
    """Digests of ``keys`` as one bytes value (what a replica publishes)."""
    return b"".join(k[:DIGEST_NBYTES] for k in keys)


def unpack(blob: bytes) -> frozenset[bytes]:
    return frozenset(blob[i:i + DIGEST_NBYTES] for i in range(0, len(blob), DIGEST_NBYTES))


def key_tag(extra_key: bytes) -> bytes:
    """Names the extra key (model, KV format and dtype, salt) block keys were computed with:
    a replica whose engine uses another one can hold none of a request's blocks."""
    return extra_key[:DIGEST_NBYTES]


@dataclass
class RouteHint:
    """The first argument of ``EngineReplica.generate``: what the router reads.

    ``digests``: the prompt's full-block keys (of the call's first prompt), in order.
    ``exclude``: replicas this request already failed on (the ingress retries elsewhere).
    The router writes ``holder`` (the replica it found holding the longest prefix, if any)
    and ``routed_to``; the ingress reads them for its metrics. They are set in the
    ingress's process (the handle's router runs there) and mean nothing to a replica.
    """

    digests: tuple[bytes, ...]
    key_tag: bytes
    exclude: frozenset[str] = frozenset()
    holder: str | None = None
    holder_blocks: int = 0
    routed_to: str | None = None


@dataclass(frozen=True)
class Accepted:
    """The first item of a replica's stream: its engine took the requests."""

    replica: str


@dataclass(frozen=True)
class Rejected:
    """The only item of a replica's stream when its engine refused the input (a 400)."""

    message: str


@dataclass(frozen=True)
class Published:
    """What a replica publishes through ``record_routing_stats`` (as a dict of these fields)."""

    version: int
    key_tag: bytes
    digests: frozenset[bytes]


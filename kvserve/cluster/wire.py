"""What travels between the ingress, the router and the engine replicas.

Block keys travel as *digests*: their first 8 bytes. A router only needs to tell which
replica holds a prefix; two keys sharing a digest (odds 2^-64 per pair) would cost a
misrouted request, a cache miss, never a wrong answer: the engine matches full keys and
compares the block's tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from kvserve.engine.model_card import ModelCard
    from kvserve.server.async_engine import RequestSpec

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


class SegmentDigests(NamedTuple):
    """One segment of a blended prompt, as the router matches it: where it starts in the
    prompt (tokens) and the digests of its full blocks' segment keys (``segment_block_keys``:
    the same whatever precedes the segment), in order."""

    start: int
    digests: tuple[bytes, ...]


@dataclass
class RouteHint:
    """The first argument of ``EngineReplica.generate``: what the router reads.

    ``digests``: the prompt's full-block keys (of the call's first prompt), in order.
    ``segments``: its segments (a prompt given with segments: kvserve/blend/), whose stored
    KV a replica reuses wherever they sit; ``blend_fraction`` the share of their tokens
    recomputed, so a held segment block saves ``1 - blend_fraction`` of a block's prefill.
    ``exclude``: replicas this request already failed on (the ingress retries elsewhere).
    The router writes ``holder`` (the replica it found holding the most of the prompt's KV,
    if any: ``PrefixIndex.score``, in blocks of prefill saved) and ``routed_to``; the ingress reads them for its metrics. They are set in the
    ingress's process (the handle's router runs there) and mean nothing to a replica.
    """

    digests: tuple[bytes, ...]
    key_tag: bytes
    block_size: int = 16
    segments: tuple[SegmentDigests, ...] = ()
    blend_fraction: float = 0.0
    exclude: frozenset[str] = frozenset()
    holder: str | None = None
    holder_blocks: float = 0.0
    routed_to: str | None = None

    def all_digests(self) -> tuple[bytes, ...]:
        """The prompt's block digests and its segments'."""
        return self.digests + tuple(d for s in self.segments for d in s.digests)


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


def route_hint(card: ModelCard, tag: bytes, spec: RequestSpec) -> RouteHint:
    """What the router matches for ``spec``: its prompt's block digests and, for a prompt
    given with segments, each segment's (kvserve/cluster/index.py)."""
    salt, tenant = (spec.cache.salt, spec.cache.tenant) if spec.cache is not None else ("", "")
    ids = spec.prompt_token_ids
    hint = RouteHint(digests(card.block_keys(ids, salt, tenant)), tag, card.block_size)
    if spec.blend is not None:
        hint.segments = tuple(SegmentDigests(start, digests(card.segment_keys(ids[start:start + n], salt, tenant)))
                              for start, n in spec.blend.spans)
        hint.blend_fraction = spec.blend.fraction
    return hint

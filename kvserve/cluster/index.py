"""Which block keys each engine replica holds, and the routing rule that reads it.

```
 replica --record_routing_stats--> Serve controller --broadcast--> every handle's router
   (digests of its device blocks,     (every stats period)           PrefixIndex.publish
    every stats period)
 router --on_request_routed--> PrefixIndex.note_routed   (this router's own recent sends)
 router.choose_replicas ----> PrefixIndex.score per replica -> choose()
```

A replica's device blocks include the segments it stored for blending (kvserve/blend/
store.py: pool blocks under segment keys), so the same published digests say which
documents of a RAG prompt it can reuse wherever they sit in the prompt (``score``).

The published part is the same for every ingress replica: one controller broadcasts one
version per replica to all handles. What a replica computed after its last publication
is missing from it (at most a stats period plus a controller round, about a second by
default), and what it evicted since is still listed. Each router covers the first gap
with the requests it sent itself (``note_routed``, kept ``overlay_ttl_s``). A stale entry
costs a routing choice, never an answer: a request sent to a replica that no longer holds
its prefix is matched there by full keys and tokens, loads what the shared tier holds and
computes the rest; one sent elsewhere does the same on that replica.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from kvserve.cluster.wire import Published, RouteHint


class PrefixIndex:
    """Published digests per replica plus this router's overlay; one owner (the router)."""

    def __init__(self, overlay_ttl_s: float = 10.0) -> None:
        self.overlay_ttl_s = overlay_ttl_s
        self._published: dict[str, Published] = {}
        self._routed: dict[str, OrderedDict[bytes, float]] = {}    # replica -> digest -> when sent

    def version(self, replica: str) -> int | None:
        p = self._published.get(replica)
        return None if p is None else p.version

    def publish(self, replica: str, published: Published) -> None:
        self._published[replica] = published

    def note_routed(self, replica: str, digests: Sequence[bytes], now: float) -> None:
        routed = self._routed.setdefault(replica, OrderedDict())
        for d in digests:
            routed[d] = now
            routed.move_to_end(d)
        self._expire(routed, now)

    def match(self, replica: str, digests: Sequence[bytes], key_tag: bytes, now: float) -> int:
        """How many leading ``digests`` the replica holds (published or recently sent there).
        A replica that published another key tag holds none (its engine keys blocks otherwise)."""
        holds = self._holds(replica, key_tag, now)
        return 0 if holds is None else _leading(holds, digests)

    def score(self, replica: str, hint: RouteHint, now: float, with_segments: bool = True) -> float:
        """Blocks of the prompt's prefill the replica would save: its leading prefix blocks,
        plus each segment's leading stored blocks past that prefix, worth ``1 - blend_fraction``
        of a block each (blending recomputes the rest); the prefix alone without ``with_segments``.

        ```
        prompt    |b0 |b1 |b2 |b3 |b4 |b5 |
        prefix    |===|===|===|                 3 leading blocks held: 3
        segment           |s0 |s1 |s2 |         at token 2 * bs; s0 and s1 held, s2 not
        counted               |s1 |             past the prefix's end: + (1 - f) * 1
        ```
        """
        holds = self._holds(replica, hint.key_tag, now)
        if holds is None:
            return 0.0
        num_prefix = _leading(holds, hint.digests)
        prefix_end, bs = num_prefix * hint.block_size, hint.block_size
        reused = sum(max(0, s.start + _leading(holds, s.digests) * bs - max(s.start, prefix_end))
                     for s in (hint.segments if with_segments else ()))
        return num_prefix + (1.0 - hint.blend_fraction) * reused / bs

    def retain(self, replicas: set[str]) -> None:
        """Forget replicas no longer running (dead, or scaled down)."""
        for table in (self._published, self._routed):
            for replica in [r for r in table if r not in replicas]:
                del table[replica]

    def num_overlay_entries(self) -> int:
        return sum(len(r) for r in self._routed.values())

    def _holds(self, replica: str, key_tag: bytes, now: float) -> Callable[[bytes], bool] | None:
        """Whether the replica holds a digest (published, or sent there within the overlay's
        life); None when it published another key tag."""
        published = self._published.get(replica)
        if published is not None and published.key_tag != key_tag:
            return None
        held = published.digests if published is not None else frozenset()
        routed = self._routed.get(replica)
        if routed is None:
            return held.__contains__
        self._expire(routed, now)
        return lambda d: d in held or d in routed

    def _expire(self, routed: OrderedDict[bytes, float], now: float) -> None:
        while routed:
            d, when = next(iter(routed.items()))
            if now - when <= self.overlay_ttl_s:
                return
            del routed[d]


def _leading(holds: Callable[[bytes], bool], digests: Sequence[bytes]) -> int:
    n = 0
    for d in digests:
        if not holds(d):
            break
        n += 1
    return n


class Choice(NamedTuple):
    """Replica ranks for Serve (first rank first; Serve takes the least loaded of a rank that
    has room), the holder of the most of the prompt's KV (None: no replica holds any) and
    its score (``PrefixIndex.score``: blocks of prefill saved)."""

    ranks: list[list[str]]
    holder: str | None
    holder_blocks: float


ROUTINGS = ("kv", "kv-prefix", "pow2")   # KVAwareRouter (kv-prefix: prefix blocks only); pow2: Serve's default
DEFAULT_MIN_CACHED_SHARE = 0.2   # of a prompt's blocks the best replica must hold to be its holder (choose)
LOAD_SLACK_RATIO = 0.25   # the bound grows with load: a quarter of the least loaded replica's requests


def load_bound(max_imbalance: int, min_load: int) -> float:
    """How many more ongoing requests than the least loaded replica the holder may have:
    ``max_imbalance``, or a quarter of the least loaded replica's load when that is more
    (a fixed count would turn a busy fleet's routing into plain load balancing)."""
    return max(max_imbalance, LOAD_SLACK_RATIO * min_load)


def choose(matches: Mapping[str, float], loads: Mapping[str, int], max_imbalance: int,
           rng: random.Random, min_score: float = 0.0) -> Choice:
    """The replica holding the most of the prompt's KV (``matches``: a score per replica, as
    ``PrefixIndex.score``), unless its load exceeds the least loaded
    replica's by more than ``load_bound``; else (and after it) two random replicas, of
    which Serve takes the less loaded (power of two choices). A best score under
    ``min_score`` makes no holder: the request goes to the random pair.

    The bound is what keeps a prefix every request shares (a system prompt) from piling
    every conversation onto the first replica that computed it: past the bound a new
    conversation goes elsewhere, that replica computes the prefix once, and from then on
    both hold it and the tie goes to the less loaded. ``min_score`` does it at low load,
    where the bound is never reached: a request of which a replica holds only a small
    share (the chat template's first block, say) is new work, and new work spread at
    random is what keeps each replica's cache to its share of the fleet's documents."""
    replicas = list(matches)
    if not replicas:
        return Choice([], None, 0.0)
    pair = rng.sample(replicas, min(2, len(replicas)))
    best = max(matches.values())
    if best == 0 or best < min_score:
        return Choice([pair], None, 0.0)
    holder = min((r for r in replicas if matches[r] == best), key=lambda r: loads.get(r, 0))
    min_load = min(loads.get(r, 0) for r in replicas)
    if loads.get(holder, 0) - min_load > load_bound(max_imbalance, min_load):
        return Choice([pair], holder, best)
    return Choice([[holder], pair], holder, best)

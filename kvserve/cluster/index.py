"""Which block keys each engine replica holds, and the routing rule that reads it.

```
 replica --record_routing_stats--> Serve controller --broadcast--> every handle's router
   (digests of its device blocks,     (every stats period)           PrefixIndex.publish
    every stats period)
 router --on_request_routed--> PrefixIndex.note_routed   (this router's own recent sends)
 router.choose_replicas ----> PrefixIndex.match per replica -> choose()
```

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
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from kvserve.cluster.wire import Published


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
        published = self._published.get(replica)
        if published is not None and published.key_tag != key_tag:
            return 0
        held = published.digests if published is not None else frozenset()
        routed = self._routed.get(replica)
        if routed is not None:
            self._expire(routed, now)
        n = 0
        for d in digests:
            if d not in held and (routed is None or d not in routed):
                break
            n += 1
        return n

    def retain(self, replicas: set[str]) -> None:
        """Forget replicas no longer running (dead, or scaled down)."""
        for table in (self._published, self._routed):
            for replica in [r for r in table if r not in replicas]:
                del table[replica]

    def num_overlay_entries(self) -> int:
        return sum(len(r) for r in self._routed.values())

    def _expire(self, routed: OrderedDict[bytes, float], now: float) -> None:
        while routed:
            d, when = next(iter(routed.items()))
            if now - when <= self.overlay_ttl_s:
                return
            del routed[d]


class Choice(NamedTuple):
    """Replica ranks for Serve (first rank first; Serve takes the least loaded of a rank that
    has room), the holder of the longest prefix (None: no replica holds any) and its length."""

    ranks: list[list[str]]
    holder: str | None
    holder_blocks: int


LOAD_SLACK_RATIO = 0.25   # the bound grows with load: a quarter of the least loaded replica's requests


def load_bound(max_imbalance: int, min_load: int) -> float:
    """How many more ongoing requests than the least loaded replica the holder may have:
    ``max_imbalance``, or a quarter of the least loaded replica's load when that is more
    (a fixed count would turn a busy fleet's routing into plain load balancing)."""
    return max(max_imbalance, LOAD_SLACK_RATIO * min_load)


def choose(matches: Mapping[str, int], loads: Mapping[str, int], max_imbalance: int,
           rng: random.Random) -> Choice:
    """The replica holding the longest prefix, unless its load exceeds the least loaded
    replica's by more than ``load_bound``; else (and after it) two random replicas, of
    which Serve takes the less loaded (power of two choices).

    The bound is what keeps a prefix every request shares (a system prompt) from piling
    every conversation onto the first replica that computed it: past the bound a new
    conversation goes elsewhere, that replica computes the prefix once, and from then on
    both hold it and the tie goes to the less loaded."""
    replicas = list(matches)
    if not replicas:
        return Choice([], None, 0)
    pair = rng.sample(replicas, min(2, len(replicas)))
    best = max(matches.values())
    if best == 0:
        return Choice([pair], None, 0)
    holder = min((r for r in replicas if matches[r] == best), key=lambda r: loads.get(r, 0))
    min_load = min(loads.get(r, 0) for r in replicas)
    if loads.get(holder, 0) - min_load > load_bound(max_imbalance, min_load):
        return Choice([pair], holder, best)
    return Choice([[holder], pair], holder, best)

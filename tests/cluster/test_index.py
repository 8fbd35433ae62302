"""The router's index and rule, without Ray: what a replica holds, and where a request goes."""

from __future__ import annotations

import random

from kvserve.cluster.index import PrefixIndex, choose, load_bound
from kvserve.cluster.wire import Published, digests, key_tag, pack, unpack

D = [bytes([i]) * 8 for i in range(6)]
TAG, OTHER = b"t" * 8, b"o" * 8


def test_digests_pack_and_tags():
    keys = [bytes([i]) * 32 for i in range(3)]
    assert digests(keys) == tuple(k[:8] for k in keys)
    assert unpack(pack(keys)) == frozenset(k[:8] for k in keys)
    assert key_tag(b"x" * 32) == b"x" * 8


def test_match_counts_the_leading_run_published_or_routed():
    index = PrefixIndex(overlay_ttl_s=5.0)
    index.publish("a", Published(1, TAG, frozenset(D[:3] + [D[4]])))
    assert index.match("a", D, TAG, now=0.0) == 3              # D[4] is useless past the gap at D[3]
    assert index.match("a", D, OTHER, now=0.0) == 0            # its engine keys blocks otherwise
    assert index.match("b", D, TAG, now=0.0) == 0
    index.note_routed("b", D[:2], now=10.0)                     # sent there, not published yet
    assert index.match("b", D, TAG, now=12.0) == 2
    assert index.match("b", D, TAG, now=15.5) == 0              # the overlay expired
    assert index.num_overlay_entries() == 0
    index.note_routed("a", D[3:4], now=20.0)
    assert index.match("a", D, TAG, now=20.0) == 5              # published + routed
    assert index.version("a") == 1
    index.retain({"b"})
    assert index.version("a") is None and index.match("a", D, TAG, now=20.0) == 0


def test_a_shared_prefix_does_not_pile_every_request_onto_one_replica():
    """New conversations sharing a system prompt: the first replica to hold it takes them
    until it is ``max_imbalance`` ahead; then the other computes it once and they share."""
    rng = random.Random(1)
    index = PrefixIndex()
    loads = {"a": 0, "b": 0}
    system, placed = D[:3], []
    for i in range(8):
        prompt = (*system, bytes([100 + i]) * 8)
        c = choose({r: index.match(r, prompt, TAG, 0.0) for r in loads}, loads, 2, rng)
        target = min(c.ranks[0], key=lambda r: loads[r])     # Serve: the less loaded of the rank
        index.note_routed(target, prompt, 0.0)
        loads[target] += 1
        placed.append(target)
    assert abs(loads["a"] - loads["b"]) <= 3 and load_bound(2, 0) == 2


def test_the_holder_first_unless_too_loaded_else_two_random():
    rng = random.Random(0)
    c = choose({"a": 3, "b": 1, "c": 0}, {"a": 2, "b": 0, "c": 0}, max_imbalance=4, rng=rng)
    assert c.holder == "a" and c.holder_blocks == 3 and c.ranks[0] == ["a"] and len(c.ranks[1]) == 2
    c = choose({"a": 3, "b": 1, "c": 0}, {"a": 9, "b": 0, "c": 4}, max_imbalance=4, rng=rng)
    assert c.holder == "a" and len(c.ranks) == 1 and len(c.ranks[0]) == 2   # 9 - 0 > 4: away
    c = choose({"a": 2, "b": 2}, {"a": 3, "b": 1}, max_imbalance=4, rng=rng)
    assert c.ranks[0] == ["b"]                                   # equal prefixes: the less loaded
    c = choose({"a": 3, "b": 0}, {"a": 45, "b": 40}, max_imbalance=2, rng=rng)
    assert c.ranks[0] == ["a"]                                   # 5 over: within a quarter of 40
    c = choose({"a": 3, "b": 0}, {"a": 51, "b": 40}, max_imbalance=2, rng=rng)
    assert len(c.ranks) == 1                                     # 11 over: more than a quarter
    c = choose({"a": 0, "b": 0}, {}, max_imbalance=4, rng=rng)
    assert c.holder is None and sorted(c.ranks[0]) == ["a", "b"]
    assert choose({}, {}, 4, rng).ranks == []

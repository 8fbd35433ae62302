"""The router's index and rule, without Ray: what a replica holds, and where a request goes
(segments included: the last test against a tiny engine's real pool)."""

from __future__ import annotations

import random

from tiny import random_tokens, tiny_model

from kvserve import LLM, CacheControl, SamplingParams, Segment, SegmentedPrompt
from kvserve.cluster.index import PrefixIndex, choose, load_bound
from kvserve.cluster.wire import Published, RouteHint, SegmentDigests, digests, key_tag, pack, route_hint, unpack
from kvserve.server.async_engine import RequestSpec

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
    c = choose({"a": 1.5, "b": 0}, {"a": 0, "b": 0}, max_imbalance=2, rng=rng, min_score=2.0)
    assert c.holder is None and len(c.ranks) == 1               # too small a share held: new work
    c = choose({"a": 2.0, "b": 0}, {"a": 0, "b": 0}, max_imbalance=2, rng=rng, min_score=2.0)
    assert c.holder == "a" and c.ranks[0] == ["a"]
    c = choose({"a": 0, "b": 0}, {}, max_imbalance=4, rng=rng)
    assert c.holder is None and sorted(c.ranks[0]) == ["a", "b"]
    assert choose({}, {}, 4, rng).ranks == []


S = [bytes([50 + i]) * 8 for i in range(6)]     # digests of a segment's blocks


def test_a_segment_counts_its_leading_held_blocks_past_the_prefix_at_one_minus_the_fraction():
    """Block size 4: the prompt is 4 prefix-key blocks; the segment starts at token 6 with 3
    blocks (tokens 6..17). ``score`` = leading prefix blocks + (1 - f) x segment blocks past them."""
    index = PrefixIndex()
    hint = RouteHint(tuple(D[:4]), TAG, block_size=4, segments=(SegmentDigests(6, tuple(S[:3])),),
                     blend_fraction=0.25)
    index.publish("a", Published(1, TAG, frozenset(S[:2])))           # segment blocks 0, 1; no prefix
    assert index.score("a", hint, 0.0) == 0.75 * 2                      # tokens 6..13: 2 blocks
    index.publish("b", Published(1, TAG, frozenset(D[:2] + S[:2])))   # prefix to token 8, then the segment
    assert index.score("b", hint, 0.0) == 2 + 0.75 * (14 - 8) / 4       # only tokens 8..13 count
    assert index.score("b", hint, 0.0, with_segments=False) == 2       # --routing kv-prefix
    index.publish("c", Published(1, TAG, frozenset(D[:4] + S[:3])))   # the prefix covers the segment's start
    assert index.score("c", hint, 0.0) == 4 + 0.75 * (18 - 16) / 4
    index.publish("d", Published(1, TAG, frozenset(S[1:3])))          # no first block: nothing reusable
    assert index.score("d", hint, 0.0) == 0.0
    index.publish("e", Published(1, OTHER, frozenset(D + S)))          # another key tag holds nothing
    assert index.score("e", hint, 0.0) == 0.0
    index.note_routed("d", hint.all_digests(), now=1.0)                # sent there: it will store it
    assert index.score("d", hint, 2.0) == 4 + 0.75 * 2 / 4
    plain = RouteHint(tuple(D[:4]), TAG, block_size=4)
    assert index.score("b", plain, 0.0) == index.match("b", D[:4], TAG, 0.0) == 2


def test_the_replica_holding_a_requests_documents_wins_over_one_holding_only_its_system_prompt():
    """Two replicas hold the same 1-block system prompt; only "b" stored the 3 documents."""
    index = PrefixIndex()
    index.publish("a", Published(1, TAG, frozenset(D[:1])))
    index.publish("b", Published(1, TAG, frozenset(D[:1] + S[:6])))
    docs = (SegmentDigests(16, tuple(S[:2])), SegmentDigests(48, tuple(S[2:4])), SegmentDigests(80, tuple(S[4:6])))
    hint = RouteHint(tuple(D[:6]), TAG, block_size=16, segments=docs, blend_fraction=0.15)
    scores = {r: index.score(r, hint, 0.0) for r in ("a", "b")}
    assert scores == {"a": 1.0, "b": 1 + 0.85 * 6}
    c = choose(scores, {"a": 0, "b": 1}, 2, random.Random(0))
    assert c.holder == "b" and c.ranks[0] == ["b"]


def test_a_replica_publishes_the_segments_it_stored_and_the_hint_finds_them():
    """The ingress's hint (model card keys) against what an engine really holds after
    blending a prompt: its segment's 2 full blocks, not the prompt's (lossy, never cached)."""
    llm = LLM(loaded=tiny_model(), num_kv_blocks=64, blend_cost_model=False)
    doc = random_tokens(40, 3)
    prompt = SegmentedPrompt([[5, 6], Segment(doc), [7, 8]], blend_fraction=0.25)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    llm.generate([prompt], params, cache=CacheControl(salt="a"))
    card = llm.engine.model_card
    tag = key_tag(card.extra_key)
    index = PrefixIndex()
    index.publish("r", Published(1, tag, unpack(pack(llm.engine.kv.cached_keys()))))
    ids, blend = prompt.encode(None)
    hint = route_hint(card, tag, RequestSpec(ids, params, CacheControl(salt="a"), blend))
    assert hint.segments == (SegmentDigests(2, digests(card.segment_keys(doc, "a"))),)
    assert len(hint.segments[0].digests) == 2 and hint.blend_fraction == 0.25 and hint.block_size == 16
    assert index.score("r", hint, 0.0) == 0.75 * 2                     # tokens 2..33 of the prompt
    other = route_hint(card, tag, RequestSpec(ids, params, CacheControl(salt="b"), blend))
    assert index.score("r", other, 0.0) == 0.0                          # another salt's keys
    plain = route_hint(card, tag, RequestSpec(ids, params))
    assert plain.segments == () and index.score("r", plain, 0.0) == 0.0

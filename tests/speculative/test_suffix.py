"""Suffix decoding: the most frequent continuation of the longest matched suffix, from the
request's own tokens and from finished requests' outputs."""

from __future__ import annotations

import pytest

from kvserve.config import SpeculativeConfig
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.speculative.build import make_proposer
from kvserve.speculative.suffix import SuffixProposer
from kvserve.speculative.suffix_trie import SuffixTrie


def request(ids: list[int], rid: str = "r", output: list[int] | None = None) -> Request:
    req = Request(rid, ids, SamplingParams(), arrival_seq=0)
    for t in output or []:
        req.append_token(t)
    return req


def proposer(min_prob: float = 0.1, max_global_tokens: int = 1000, max_depth: int = 16) -> SuffixProposer:
    return SuffixProposer(max_depth=max_depth, min_match=2, min_prob=min_prob, max_global_tokens=max_global_tokens)


def finish(p: SuffixProposer, prompt: list[int], output: list[int], rid: str) -> None:
    """A request seen to the end of ``output``, then finished."""
    assert isinstance(p.propose(request(prompt, rid, output), 1), list)
    p.forget(rid)
    p.check_integrity()


def test_a_repeated_phrase_is_proposed_exactly():
    p = proposer()
    assert p.propose(request([1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3]), 4) == [4, 5, 6, 7]
    assert p.propose(request([1, 2, 3, 4, 5, 9, 1, 2, 3], "b"), 8) == [4, 5, 9, 1, 2, 3]   # up to the end
    assert p.propose(request([1, 2, 3, 4, 1], "c"), 3) == []          # one token is below min_match
    p.check_integrity()


def test_the_most_frequent_continuation_wins_and_ties_go_to_the_most_recent():
    p = proposer()
    assert p.propose(request([5, 6, 1, 5, 6, 1, 5, 6, 2, 9, 5, 6]), 1) == [1]     # 1 twice, 2 once
    assert p.propose(request([5, 6, 1, 5, 6, 2, 9, 5, 6], "b"), 1) == [2]         # once each: the later
    # after "5 6 1": "5" both times
    assert p.propose(request([5, 6, 1, 5, 6, 1, 5, 6, 2, 9, 5, 6], "c"), 2) == [1, 5]


def test_the_longest_match_decides():
    # "3 4" is followed by 8 twice, "2 3 4" (the longer match) by 9 once
    p = proposer()
    assert p.propose(request([3, 4, 8, 3, 4, 8, 2, 3, 4, 9, 0, 2, 3, 4]), 1) == [9]


def test_a_draft_stops_where_no_continuation_is_likely_enough():
    ids = [7, 8, 1, 2, 7, 8, 1, 3, 7, 8, 1, 4, 0, 7, 8]     # after "7 8 1": 2, 3 or 4, a third each
    assert proposer(min_prob=0.5).propose(request(ids), 4) == [1]
    assert proposer(min_prob=0.3).propose(request(ids), 4) == [1, 4, 0, 7]


def test_a_finished_requests_output_drafts_for_a_new_request():
    p = proposer()
    finish(p, [100, 101], [1, 2, 3, 4, 5, 6], "a")
    assert p.num_global_tokens == 6
    assert p.propose(request([50, 2, 3]), 3) == [4, 5, 6]
    assert p.propose(request([7, 100, 101], "b"), 2) == []          # prompts are not kept
    # both indexes are asked: the draft with more expected accepted tokens wins, a tie the request's own
    assert p.propose(request([2, 3, 2, 3], "c"), 3) == [4, 5, 6]         # its own: "2 3" (2 tokens)
    assert p.propose(request([2, 3, 7, 7, 7, 2, 3], "d"), 3) == [7, 7, 7]


def test_the_outputs_index_drops_the_oldest_past_its_cap():
    p = proposer(max_global_tokens=8)
    finish(p, [0], [1, 2, 3, 4, 5], "a")
    finish(p, [0], [6, 7, 8, 9, 10], "b")
    assert p.num_global_tokens == 5
    assert p.propose(request([1, 2]), 3) == []
    assert p.propose(request([6, 7], "x"), 3) == [8, 9, 10]
    fresh = SuffixTrie(16)
    fresh.add([6, 7, 8, 9, 10], 0)
    assert p._global.num_nodes == fresh.num_nodes          # nothing of "a" is left
    finish(p, [0], list(range(20, 40)), "c")                  # longer than the cap: its last 8 tokens
    assert p.num_global_tokens == 8
    assert p.propose(request([32, 33], "y"), 2) == [34, 35] and p.propose(request([21, 22], "z"), 2) == []
    p.clear_history()
    assert p.num_global_tokens == 0 and p.propose(request([33, 34], "w"), 2) == []


def test_the_index_grows_with_the_sequence_and_a_reused_id_starts_over():
    p = proposer()
    req = request([3, 4, 5, 3])
    assert p.propose(req, 2) == []               # "3" alone is below min_match
    req.append_token(4)
    assert p.propose(req, 2) == [5, 3]
    for t in (5, 3, 4):
        req.append_token(t)
    assert p.propose(req, 3) == [5, 3, 4]
    counted = p._requests["r"].trie
    fresh = SuffixTrie(16)
    fresh.add(req.all_token_ids, 0)
    assert counted.num_nodes == fresh.num_nodes      # extended, the same as counted at once
    assert p.propose(request([9, 8, 9]), 2) == []    # the id "r" again, shorter: nothing of before
    assert p.propose(request([1, 2, 1, 2, 7, 1, 2]), 2) == [7, 1]    # same id, longer, another sequence
    p.forget("r")
    assert p.num_global_tokens == 0                  # all of it was prompt
    p.check_integrity()


def test_the_trie_counts_and_uncounts():
    trie = SuffixTrie(3)
    trie.add([1, 2, 1, 2, 3], 0)
    trie.add([2, 3], 10)
    node = trie.find([1, 2])
    assert node is not None and trie._count[node] == 2
    assert trie.find([1, 2, 1, 2]) is None                     # deeper than max_depth
    two = trie.find([2])
    assert two is not None and trie.continuation(two, 2, 0.0) == ([3], 2 / 3)     # "2 3" twice, "2 1" once
    one = trie.find([1])
    assert one is not None and trie.continuation(one, 2, 0.0) == ([2, 3], 1.5)    # "1 2 1", "1 2 3": the later
    assert trie.continuation(one, 2, 0.6) == ([2], 1.0)
    trie.remove([1, 2, 1, 2, 3])
    trie.check_integrity()
    assert trie.num_nodes == 4 and trie.find([1]) is None       # the root, "2", "3", "2 3"
    trie.remove([2, 3])
    assert trie.num_nodes == 1
    trie.add([4, 4, 4], 20)                                     # freed nodes are used again
    assert trie.num_nodes == 4 and trie.longest_match([4, 4, 4], 1, 3) == 2
    trie.check_integrity()


def test_configs_take_the_suffix_keys_and_refuse_others():
    config = SpeculativeConfig.from_json('{"method": "suffix", "num_speculative_tokens": 8, "suffix_max_depth": 24, '
                                         '"suffix_min_prob": 0.2, "suffix_max_global_tokens": 0}')
    p = make_proposer(config)
    assert isinstance(p, SuffixProposer)
    assert (p.max_depth, p.min_match, p.min_prob, p.max_global_tokens) == (24, 2, 0.2, 0)
    cases = [('{"method": "suffix", "prompt_lookup_max": 3}', "does not use prompt_lookup_max"),
             ('{"method": "ngram", "suffix_max_depth": 8}', "does not use suffix_max_depth"),
             ('{"method": "self", "suffix_min_prob": 0.5}', "does not use suffix_min_prob"),
             ('{"method": "suffix", "skip_layers": [1]}', "does not use skip_layers"),
             ('{"method": "suffix", "suffix_min_prob": 1.5}', "suffix_min_prob must be a number in"),
             ('{"method": "suffix", "suffix_max_global_tokens": -1}', "suffix_max_global_tokens must be an integer"),
             ('{"method": "suffix", "suffix_min_match": 0}', "suffix_min_match must be an integer >= 1"),
             ('{"method": "suffix", "num_speculative_tokens": 8, "suffix_max_depth": 9}', "at least 10"),
             ('{"method": "suffix", "model": "x"}', '"model" is the draft method')]
    for text, message in cases:
        with pytest.raises(ValueError, match=message):
            SpeculativeConfig.from_json(text)


def test_no_history_kept_with_a_cap_of_zero():
    p = proposer(max_global_tokens=0)
    finish(p, [0], [1, 2, 3], "a")
    assert p.num_global_tokens == 0 and p.propose(request([1, 2]), 1) == []

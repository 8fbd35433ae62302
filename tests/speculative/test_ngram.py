"""Prompt lookup: the tokens after the most recent earlier occurrence of the last n tokens."""

from __future__ import annotations

import pytest

from kvserve.config import SpeculativeConfig
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams
from kvserve.speculative.build import make_proposer
from kvserve.speculative.proposers import NgramProposer


def request(ids: list[int], rid: str = "r") -> Request:
    return Request(rid, ids, SamplingParams(), arrival_seq=0)


def test_the_longest_n_that_matches_and_its_most_recent_occurrence():
    p = NgramProposer(min_n=1, max_n=3)
    assert p.propose(request([1, 2, 3, 4, 5, 9, 1, 2, 3]), 2) == [4, 5]
    # "1 2" occurs at 0 and 3: the later one wins
    assert p.propose(request([1, 2, 7, 1, 2, 8, 1, 2], "b"), 2) == [8, 1]
    # "9 1 2" never occurred, "1 2" did
    assert p.propose(request([1, 2, 7, 9, 1, 2], "c"), 3) == [7, 9, 1]


def test_a_draft_stops_at_the_end_of_the_sequence():
    assert NgramProposer(1, 2).propose(request([5, 6, 5]), 4) == [6, 5]


def test_an_occurrence_with_a_whole_draft_after_it_comes_first():
    # the most recent "4 4 4" is followed by one token; the one before it by three
    assert NgramProposer(1, 3).propose(request([4] * 8), 3) == [4, 4, 4]
    assert NgramProposer(1, 2).propose(request([7, 8, 7, 8, 7, 8], "b"), 4) == [7, 8, 7, 8]
    assert NgramProposer(1, 3).propose(request([1, 2, 3, 9, 1, 2, 3], "c"), 3) == [9, 1, 2]


def test_no_match_no_draft():
    p = NgramProposer(min_n=2, max_n=3)
    assert p.propose(request([1, 2, 3, 4, 5, 1]), 3) == []     # only "1" recurs, below min_n
    assert p.propose(request([7], "b"), 3) == []


def test_a_byte_match_across_two_ids_is_not_a_match():
    # int32 little endian: 256 = 00 01 00 00, 0 = 00 00 00 00, so [256, 0] holds 01 00 00 00 (= 1)
    # at byte 1; the last token 1 occurs nowhere as an id
    assert NgramProposer(1, 1).propose(request([256, 0, 5, 1]), 2) == []
    assert NgramProposer(1, 1).propose(request([1, 256, 0, 5, 1]), 2) == [256, 0]


def test_the_state_follows_the_sequence_and_is_forgotten():
    p = NgramProposer(1, 2)
    req = request([3, 4, 3])
    assert p.propose(req, 1) == [4]
    req.append_token(9)
    assert p.propose(req, 2) == []          # "3 9" and "9" never occurred before
    req.append_token(3)
    req.append_token(4)
    assert p.propose(req, 2) == [3, 9]      # "3 4" at 0 (the one at 4 is the suffix itself)
    p.forget("r")
    assert p.propose(request([8, 8]), 1) == [8]


def test_configs_name_their_proposer_and_bad_ones_are_refused():
    assert isinstance(make_proposer(SpeculativeConfig("ngram", 4, 3, 1)), NgramProposer)
    cases = [('{"method": "ngram", "k": 2}', "unknown key"), ('{"num_speculative_tokens": 2}', "needs a method"),
             ('{"method": "eagle"}', "must be one of ngram"), ("not json", "not JSON"), ("[1]", "JSON object"),
             ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens must be an integer >= 1"),
             ('{"method": "ngram", "prompt_lookup_min": 4}', "prompt_lookup_min (4) must not exceed")]
    for text, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            SpeculativeConfig.from_json(text)

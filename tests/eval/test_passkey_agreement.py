"""Passkey prompts and answers; the greedy agreement metric."""

from __future__ import annotations

import pytest

from kvserve.eval.agreement import agreement, common_prefix_len
from kvserve.eval.passkey import (
    HEAD,
    NEEDLE,
    QUESTION,
    build_cases,
    build_filler,
    filler_sentences,
    is_correct,
    needle_cut,
    parse_answer,
)


def encode(text: str) -> list[int]:
    """A stand-in tokenizer: one token per word (space-prefixed), ids by hash."""
    return [hash(w) % 50000 for w in text.replace(" ", " \x00").split("\x00") if w]


@pytest.mark.parametrize("align", [1, 16, 64])
@pytest.mark.parametrize("length", [256, 1000, 2048])
def test_the_needle_sits_at_the_requested_depth(length, align):
    depths = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]
    cases = build_cases(encode, [length], depths, seed=3, align=align)
    head = encode(HEAD)
    question = encode(QUESTION)
    filler = build_filler(encode, filler_sentences("repeat"), length)
    for case, depth in zip(cases, depths):
        cut = case.needle_start - len(head)
        assert case.depth == depth
        assert case.needle_start % align == 0
        assert 0 <= cut <= length
        assert abs(cut - depth * length) <= align          # nearest aligned position (clamped at the ends)
        assert case.token_ids[:len(head)] == head
        assert case.token_ids[case.needle_start:case.needle_start + case.needle_len] == encode(
            NEEDLE.format(key=case.key))
        # the filler, cut once, around the needle; then the question
        rest = case.token_ids[len(head):case.needle_start] + case.token_ids[case.needle_start + case.needle_len:]
        assert rest == filler + question
        assert len(case.token_ids) == len(head) + length + case.needle_len + len(question)


def test_depth_one_puts_the_needle_at_the_end_of_the_filler():
    [case] = build_cases(encode, [500], [1.0])
    assert case.token_ids[case.needle_start + case.needle_len:] == encode(QUESTION)


def test_needle_cut_by_hand():
    assert needle_cut(30, 1024, 0.0, 64) == 34            # 30 + 34 = 64
    assert needle_cut(30, 1024, 1.0, 64) == 994           # 30 + 994 = 1024, the last aligned position
    assert needle_cut(30, 1024, 0.5, 64) == 482           # 512 - 30
    assert needle_cut(0, 100, 0.5, 1) == 50
    with pytest.raises(ValueError):
        needle_cut(30, 10, 0.5, 64)                       # no aligned position inside the filler
    with pytest.raises(ValueError):
        needle_cut(30, 100, 1.5, 1)


def test_prompts_share_their_prefix_up_to_the_needle():
    cases = build_cases(encode, [512, 1024], [0.0, 0.5, 1.0], align=64)
    by_start = sorted(cases, key=lambda c: -c.needle_start)
    longest = by_start[0]
    for c in by_start[1:]:
        assert c.token_ids[:c.needle_start] == longest.token_ids[:c.needle_start]


def test_keys_are_deterministic_five_digit_numbers():
    a = build_cases(encode, [300, 600], [0.0, 0.5], seed=7, trials=2)
    b = build_cases(encode, [300, 600], [0.0, 0.5], seed=7, trials=2)
    c = build_cases(encode, [300, 600], [0.0, 0.5], seed=8, trials=2)
    assert len(a) == 8
    assert [x.key for x in a] == [x.key for x in b] != [x.key for x in c]
    assert all(10000 <= x.key < 100000 for x in a)
    assert len({x.key for x in a}) == 8


def test_text_filler_uses_sentences_of_the_text():
    text = "It was cold.  He said \"no\". She left!\nThe end? Yes."
    assert filler_sentences("text", text) == [" It was cold.", " He said \"no\".", " She left!", " The end?",
                                               " Yes."]
    with pytest.raises(ValueError):
        filler_sentences("text", None)
    with pytest.raises(ValueError):
        filler_sentences("lorem")


@pytest.mark.parametrize("text,expected", [
    (" 12345. Remember it.", 12345),
    ("12345", 12345),
    (" the pass key. 77013 is the", 77013),
    (" the pass key. 770", 770),
    (" no number here", None),
    ("", None),
])
def test_parse_answer(text, expected):
    assert parse_answer(text) == expected


def test_is_correct_takes_the_first_number_only():
    [case] = build_cases(encode, [200], [0.5], seed=1)
    assert is_correct(case, f" {case.key}. Remember it.")
    assert is_correct(case, f" the pass key. {case.key}")
    assert not is_correct(case, f" 11111 or {case.key}")
    assert not is_correct(case, f" {str(case.key)[:3]}")


def test_common_prefix_len():
    assert common_prefix_len([1, 2, 3], [1, 2, 3]) == 3
    assert common_prefix_len([1, 2, 3], [1, 5, 3]) == 1
    assert common_prefix_len([9], [1]) == 0
    assert common_prefix_len([], [1]) == 0
    assert common_prefix_len([1, 2], [1, 2, 3]) == 2


def test_agreement_is_the_mean_common_prefix_fraction():
    refs = [[1, 2, 3, 4], [5, 6, 7, 8], [1, 1, 1, 1]]
    outs = [[1, 2, 3, 4], [5, 6, 0, 8], [2, 1, 1, 1]]   # 4/4, 2/4 (a later match does not count), 0/4
    assert agreement(outs, refs, 4) == pytest.approx((1 + 0.5 + 0) / 3)
    assert agreement(refs, refs, 4) == 1.0


def test_agreement_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        agreement([[1]], [[1], [2]], 1)
    with pytest.raises(ValueError):
        agreement([], [], 1)
    with pytest.raises(ValueError):
        agreement([[1, 2, 3]], [[1, 2, 3]], 2)

"""The sampler's corner cases and logits processing, on hand-made logits (exact values)."""

from __future__ import annotations

import math

import pytest
import torch

from kvserve.request import Request
from kvserve.sampling.processors import process_logits, unpack_bitmask
from kvserve.sampling.sampler import Sampler
from kvserve.sampling_params import SamplingParams

VOCAB = 8


def request(params: SamplingParams, prompt: list[int] = (0,), output: list[int] = ()) -> Request:
    req = Request("r", list(prompt), params, arrival_seq=0)
    for t in output:
        req.append_token(t)
    return req


def sample(logits: list[list[float]], *reqs: Request):
    return Sampler(seed=0, eos_token_ids=[7]).sample(torch.tensor(logits), list(reqs))


ROW = [0.0, 3.0, 1.0, 2.5, -1.0, 0.5, 0.0, 0.0]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1e-38), SamplingParams(temperature=1e-6), SamplingParams(temperature=0.0),
    SamplingParams(top_p=1e-300), SamplingParams(temperature=1e-38, top_p=1e-300),
    SamplingParams(temperature=1.0, top_p=1e-45), SamplingParams(top_k=10**6), SamplingParams(top_k=1),
])
def test_extreme_parameters_pick_the_top_token(params):
    got = sample([ROW], request(params))
    assert got.token_ids == [1] and got.errors == {}


def test_tiny_temperature_is_greedy_but_a_small_one_still_samples():
    assert SamplingParams(temperature=1e-6).is_greedy and not SamplingParams(temperature=1e-4).is_greedy


def test_nan_logits_fail_their_row_only():
    got = sample([ROW, [math.nan] + ROW[1:]], request(SamplingParams()), request(SamplingParams(temperature=0)))
    assert got.token_ids[1] is None and "NaN" in got.errors[1].message
    assert got.token_ids[0] is not None and 0 not in got.errors


def test_positive_infinity_takes_all_the_probability():
    row = [0.0, math.inf, 1.0, math.inf, 0.0, 0.0, 0.0, 0.0]
    for seed in range(8):
        got = sample([row], request(SamplingParams(seed=seed)))
        assert got.token_ids[0] in (1, 3) and got.errors == {}


def test_every_token_masked_fails_the_row():
    row = [-math.inf] * VOCAB
    got = sample([row, ROW], request(SamplingParams()), request(SamplingParams()))
    assert got.token_ids[0] is None and "no token" in got.errors[0].message and got.token_ids[1] is not None


def test_penalties_exact():
    p = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    req = request(p, prompt=[4], output=[1, 1, 3])
    out, errors = process_logits(torch.tensor([ROW]), [req], [7])
    expected = list(ROW)
    expected[4] = -1.0 * 2.0                       # prompt token, negative: multiplied
    expected[1] = 3.0 / 2.0 - 0.5 - 2 * 0.25       # generated twice
    expected[3] = 2.5 / 2.0 - 0.5 - 1 * 0.25       # generated once
    assert errors == {} and out[0].tolist() == pytest.approx(expected)
    assert sample([ROW], req).token_ids == [2]   # 1 and 3 fall to 0.5, below 2's 1.0


def test_logit_bias_and_min_tokens():
    biased = request(SamplingParams(temperature=0, logit_bias={1: -100, 6: 5.0}))
    held = request(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[1]), output=[2])
    free = request(SamplingParams(temperature=0, min_tokens=1, stop_token_ids=[1]), output=[2])
    eos_row = list(ROW)
    eos_row[7] = 10.0
    eos_held = request(SamplingParams(temperature=0, min_tokens=1))
    got = sample([ROW, ROW, ROW, eos_row], biased, held, free, eos_held)
    assert got.token_ids == [6, 3, 1, 1]


def test_unpack_bitmask():
    mask = torch.tensor([[0b101, -1]], dtype=torch.int32)
    bits = unpack_bitmask(mask, 40)
    assert bits.shape == (1, 40)
    assert bits[0, :3].tolist() == [True, False, True] and not bits[0, 3:32].any() and bits[0, 32:].all()
    high = unpack_bitmask(torch.tensor([[-(1 << 31), 1 << 9]], dtype=torch.int32), 64)[0]
    assert high.nonzero()[0].tolist() == [31, 41]


class _Constraint:
    def __init__(self, allowed: list[int] | None) -> None:
        self.allowed = allowed

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.allowed is None:
            raise RuntimeError("poisoned grammar")
        bitmask[row] = 0
        for t in self.allowed:
            bitmask[row, t // 32] |= 1 << (t % 32)

    def accept(self, token_id: int) -> None:
        pass

    @property
    def is_finished(self) -> bool:
        return False


def test_grammar_masks_touch_their_own_rows_only():
    constrained = request(SamplingParams(temperature=0))
    constrained.constraint = _Constraint([2, 5])
    poisoned = request(SamplingParams(temperature=0))
    poisoned.constraint = _Constraint(None)
    plain = request(SamplingParams(temperature=0))
    got = sample([ROW, ROW, ROW], constrained, poisoned, plain)
    assert got.token_ids == [2, None, 1]
    assert list(got.errors) == [1] and "poisoned grammar" in got.errors[1].message

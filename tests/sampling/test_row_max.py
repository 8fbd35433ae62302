"""The greedy argmax by the C++ kernel (kvserve/model/csrc/rowmax.h, ``sampler.row_max``): torch's
``max(dim=-1)`` bit for bit, on every instruction set this CPU runs."""

from __future__ import annotations

import pytest
import torch

from kvserve.model.cpu_extension import load_extension, supported_isas
from kvserve.sampling.sampler import Sampler, row_max

ISAS = supported_isas()
INF = float("inf")


def cases(n: int, vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    plain = torch.randn(n, vocab, generator=g)
    ties = (torch.randn(n, vocab, generator=g) * 2).round()       # the maximum held many times
    zeros = torch.zeros(n, vocab)
    zeros[:, vocab // 2:] = -0.0                                   # +0 first, then -0
    neg_zeros = -torch.zeros(n, vocab)
    neg_zeros[:, vocab // 3:] = 0.0                                # -0 first, then +0
    masked = torch.randn(n, vocab, generator=g)
    masked[:, ::3] = -INF                                          # a grammar's mask
    all_masked = torch.full((n, vocab), -INF)
    plus_inf = torch.randn(n, vocab, generator=g)
    plus_inf[:, vocab // 2] = INF
    plus_inf[:, -1] = INF
    return [plain, ties, zeros, neg_zeros, masked, all_masked, plus_inf]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 100, 49152, 151936])
def test_each_rows_max_and_first_index_are_torchs(isa, vocab):
    ext = load_extension(isa)
    assert ext is not None
    for n in (1, 3):
        for x in cases(n, vocab, seed=vocab + n):
            top, index = row_max(x, ext)
            want_top, want_index = x.max(dim=-1)
            assert torch.equal(index, want_index)
            assert torch.equal(top.view(torch.int32), want_top.view(torch.int32))   # the sign of a zero too


@pytest.mark.parametrize("isa", ISAS)
def test_rows_holding_a_nan_are_torchs_and_the_sampler_fails_them(isa):
    ext = load_extension(isa)
    x = torch.randn(4, 1000)
    x[0, 5] = float("nan")
    x[2, 999] = float("nan")
    _, _, rest = ext.row_argmax(x)
    assert rest.tolist() == [True, False, True, False]
    top, index = row_max(x, ext)
    want_top, want_index = x.max(dim=-1)
    assert torch.equal(index, want_index) and torch.equal(top.isnan(), want_top.isnan())
    assert torch.equal(top[[1, 3]], want_top[[1, 3]])


def test_other_logits_go_to_torch():
    ext = load_extension()
    x = torch.randn(3, 40)
    for other in (x.t().contiguous().t(), x.double(), x[0]):      # strided, float64, one dimension
        top, index = row_max(other, ext)
        want_top, want_index = other.max(dim=-1)
        assert torch.equal(index, want_index) and torch.equal(top, want_top)
    with pytest.raises(ValueError, match="logits must be a contiguous CPU float32 matrix"):
        ext.row_argmax(x.double())


def test_the_sampler_draws_the_same_tokens_with_the_kernel():
    from kvserve.request import Request
    from kvserve.sampling_params import SamplingParams

    x = torch.randn(5, 3000)
    x[1, 17] = x[1].max() + 1
    x[1, 2000] = x[1, 17]                       # a tie: the first
    x[3] = -INF
    x[3, 42] = 0.0                              # one token allowed
    rows = [Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.0), arrival_seq=i) for i in range(5)]
    with_kernel = Sampler(0, kernels=load_extension()).sample(x, rows)
    plain = Sampler(0).sample(x, rows)
    assert with_kernel.token_ids == plain.token_ids == x.argmax(dim=-1).tolist()
    assert with_kernel.token_ids[1] == 17 and with_kernel.token_ids[3] == 42

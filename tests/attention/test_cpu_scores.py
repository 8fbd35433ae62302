"""The CPU kernel's attention weights (``AttentionScores``, what KV budgets score by): for each
scored query and query head, the softmax weight each visible key gets, added per KV head,
equal to a dense reference over the stored keys, through context splits and partial tiles;
the attention output unchanged bit for bit."""

from __future__ import annotations

import pytest
import torch
from attention.cases import make_case, reference_scores

from kvserve.attention import cpu
from kvserve.attention.cpu_extension import load_extension
from kvserve.kv.storage.layout import AttentionScores

pytestmark = pytest.mark.skipif(not cpu.is_available(), reason="the C++ CPU attention kernel cannot be built here")

LENS = [700, 40, 37, 130]          # 700: split over the cores (every 256 keys)
QUERIES = [1, 3, 1, 9]
SCORE_FROM = [0, 1, 1, 2]          # the third sequence's one query is row 0 < 1: not scored


@pytest.mark.parametrize("spec", ["fp32", "fp16", "int8", "int4"])
@pytest.mark.parametrize("group", [1, 3])
def test_scores_are_the_softmax_weights_each_key_gets(spec, group):
    case = make_case(spec, lens=LENS, num_queries=QUERIES, group=group, num_kv_heads=2, seed=4 + group)
    ext = load_extension()
    halves = cpu.register_halves(ext, case.key, case.value, case.q.shape[-1])
    plain = cpu.run_registered(ext, halves, case.q, case.batch, case.scale)
    weights = torch.zeros(len(LENS), 2, case.batch.max_context_len)
    scores = AttentionScores(weights, torch.tensor(SCORE_FROM, dtype=torch.int32))
    scored = cpu.run_registered(ext, halves, case.q, case.batch, case.scale, scores=scores)
    assert torch.equal(scored, plain)
    torch.testing.assert_close(weights, reference_scores(case, SCORE_FROM), atol=2e-6, rtol=1e-5)
    # each scored query hands out a weight of 1 per query head (2 KV heads x group)
    sums = weights.sum(dim=(1, 2))
    assert sums.tolist() == pytest.approx([float(2 * group * (n - f)) if f < n else 0.0
                                           for n, f in zip(QUERIES, SCORE_FROM)], abs=1e-4)


def test_scores_too_short_for_a_context_are_refused():
    case = make_case("fp32", lens=[40], num_queries=[1], group=1, num_kv_heads=2, seed=1)
    ext = load_extension()
    halves = cpu.register_halves(ext, case.key, case.value, case.q.shape[-1])
    short = AttentionScores(torch.zeros(1, 2, 16), torch.zeros(1, dtype=torch.int32))
    with pytest.raises(ValueError, match="every context token"):
        cpu.run_registered(ext, halves, case.q, case.batch, case.scale, scores=short)

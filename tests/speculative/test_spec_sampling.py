"""Speculative sampling keeps the target's distribution: ``Sampler.verify_draft`` on fixed logits
rows, many seeded trials, each emitted position's tokens against the exact distribution by a
chi-square test (significance 0.001; the trials are seeded, so the outcome never changes)."""

from __future__ import annotations

from collections import Counter

import torch

from kvserve.request import Request
from kvserve.sampling.sampler import Sampler
from kvserve.sampling_params import SamplingParams

VOCAB = 8
NUM_TRIALS = 12000
SIGNIFICANCE = 1e-3


def chi_square_p_value(counts: Counter[int], probs: torch.Tensor) -> float:
    """P(X >= the statistic) for the observed ``counts`` of tokens drawn from ``probs``."""
    n = sum(counts.values())
    support = [t for t in range(len(probs)) if probs[t] > 0]
    assert set(counts) <= set(support), "a token the distribution cannot give was drawn"
    stat = sum((counts.get(t, 0) - n * probs[t].item()) ** 2 / (n * probs[t].item()) for t in support)
    df = len(support) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_drafted_tokens_are_kept_or_replaced_with_the_targets_distribution():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, VOCAB, generator=g) * 1.5
    params = SamplingParams(temperature=0.8, top_k=6, max_tokens=None)
    sampler = Sampler(seed=0)
    req = Request("r", [1], params, arrival_seq=0)
    p = [sampler.probs(logits[i], req) for i in range(3)]
    draft = (int(p[0].argmax()), int(p[1].argsort()[-2]))     # a likely token, then a less likely one
    emitted = [sampler.verify_draft(logits, req, draft) for _ in range(NUM_TRIALS)]
    assert all(1 <= len(e) <= 3 and e[:-1] == list(draft[:len(e) - 1]) for e in emitted)
    first = Counter(e[0] for e in emitted)
    after_first = Counter(e[1] for e in emitted if len(e) > 1)
    after_both = Counter(e[2] for e in emitted if len(e) > 2)
    for counts, probs in ((first, p[0]), (after_first, p[1]), (after_both, p[2])):
        assert sum(counts.values()) > 500
        assert chi_square_p_value(counts, probs) > SIGNIFICANCE
    # the drafts are kept as often as the target draws them
    assert abs(first[draft[0]] / NUM_TRIALS - p[0][draft[0]].item()) < 0.02


def test_a_filtered_out_draft_is_always_replaced():
    logits = torch.tensor([[4.0, 3.0, 0.0, -1.0], [1.0, 0.0, 0.0, 0.0]])
    req = Request("r", [1], SamplingParams(temperature=1.0, top_k=2), arrival_seq=0)
    sampler = Sampler(seed=0)
    outs = [sampler.verify_draft(logits, req, (3,)) for _ in range(200)]     # top-k 2 drops token 3
    assert all(len(o) == 1 and o[0] in (0, 1) for o in outs)

"""When drafting pays: the fitted step cost, the draft length it gives, the acceptance estimate."""

from __future__ import annotations

import pytest
from tiny import tiny_model

from kvserve import LLM, SamplingParams
from kvserve.request import Request
from kvserve.speculative.cost import FixedCosts, StepCosts, draft_length
from kvserve.speculative.proposers import Proposer
from kvserve.speculative.speculator import PROBE_EVERY, Acceptance


def test_the_fit_finds_the_steps_line_and_forgets_the_prior():
    costs = StepCosts(prior_base_s=1.0, prior_row_s=1.0, decay=0.5)
    for _ in range(40):
        for n in (1, 5, 9):
            costs.observe(n, 0.002 + 0.0005 * n)
    assert costs.base_s == pytest.approx(0.002, rel=1e-6) and costs.row_s == pytest.approx(0.0005, rel=1e-6)
    # q = b B / t(B): a row over a plain step's cost per token
    assert costs.row_share(1) == pytest.approx(0.0005 / 0.0025)
    assert costs.row_share(16) == pytest.approx(0.008 / 0.010)


def test_the_prior_holds_until_steps_are_measured():
    costs = StepCosts(prior_base_s=3.5e-3, prior_row_s=0.75e-3)
    assert costs.base_s == pytest.approx(3.5e-3) and costs.row_s == pytest.approx(0.75e-3)


@pytest.mark.parametrize(("p", "q", "k"), [
    (0.5, 0.18, 2),      # 0.5^2 = 0.25 > 0.18 >= 0.125
    (0.9, 0.18, 4),      # capped at k_max
    (0.5, 0.25, 1),      # 0.5^2 = 0.25 is not more than q
    (0.3, 0.46, 0),      # p itself does not pay
    (0.99, 0.0, 4),
    (1.0, 0.5, 4),
])
def test_a_drafted_token_pays_while_its_chance_beats_its_cost(p, q, k):
    assert draft_length(p, q, 4) == k


def test_acceptance_counts_tokens_up_to_the_first_rejection():
    a = Acceptance(prior=0.5, weight=2.0, decay=1.0)
    a.observe(4, 4)          # 4 checked, 4 accepted
    a.observe(4, 1)          # 2 checked (1 accepted, then the rejection), the rest unseen
    assert a.p == pytest.approx((1 + 4 + 1) / (2 + 4 + 2))


class AlwaysZero(Proposer):
    """Drafts token 0, whatever the sequence: every probe is a draft."""

    name = "zero"

    def propose(self, request: Request, num_tokens: int) -> list[int]:
        return [0] * num_tokens


def test_a_large_batch_stops_drafting_and_probes_now_and_then():
    loaded = tiny_model()
    llm = LLM(loaded=loaded, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    spec = llm.engine.speculator
    assert spec is not None
    spec.costs = StepCosts(prior_base_s=0.0, prior_row_s=1.0)     # rows are all a step costs: q = 1
    spec.costs.observe = lambda num_rows, seconds: None            # type: ignore[method-assign]
    spec.proposer = AlwaysZero()
    prompt = [5, 6, 7, 8] * 6
    params = SamplingParams(max_tokens=15 * PROBE_EVERY, temperature=0.0, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    plain = LLM(loaded=loaded).generate([prompt], params)[0]
    assert out.token_ids == plain.token_ids
    # every decode step judged its draft not to pay; the only drafts are one-token probes
    num_decode_steps = llm.engine.num_steps - 1
    assert spec.stats.num_skipped == num_decode_steps
    assert num_decode_steps >= 14 * PROBE_EVERY
    # a probe costs prompt lookup one row: one every PROBE_EVERY steps (8, 16, ..., 112; at step
    # 120 the request makes its last token: no room for a draft)
    assert out.num_draft_tokens == spec.stats.num_drafts == 14


def test_a_model_proposer_probes_less_and_less_often():
    """A probe costs a model proposer a drafting pass: the interval doubles after each one."""
    llm = LLM(loaded=tiny_model(), speculative_config={"method": "self"})
    spec = llm.engine.speculator
    assert spec is not None
    spec.costs = FixedCosts(0.0, 1.0)           # rows are all a step costs: q = 1, no draft pays
    prompt = [5, 6, 7, 8] * 6
    params = SamplingParams(max_tokens=15 * PROBE_EVERY, temperature=0.0, ignore_eos=True)
    out = llm.generate([prompt], params)[0]
    assert llm.engine.num_steps - 1 >= 14 * PROBE_EVERY
    # probes at steps 8, 16 (then every 16), 32 (every 32), 64 (every 64; 128 is past the end)
    assert out.num_draft_tokens == spec.stats.num_drafts == 4

"""The engine's side of speculative decoding: which requests draft, how far, and what is accepted.

A step with drafts, for one request whose known tokens are all computed but the last:

    known     ... t                       the last token, not computed yet
    draft           d1 d2 d3              from the proposer (k = 3)
    chunk         [ t  d1 d2 d3 ]         one chunk of k + 1 tokens in the batch: k + 1 logits rows
    targets       [ g1 g2 g3 g4 ]         the target's token after each row (greedy: argmax)
    accepted        d1 d2 == g1 g2, d3 != g3   -> appended: g1 g2 g3 (2 drafts + the target's own)

The KV of t, d1, d2 is now exact; d3's slot is overwritten by g3's in the next step
(``Scheduler.accept_draft`` moves ``num_computed_tokens`` past the accepted drafts only, and the
KV manager releases blocks that hold nothing accepted). Row i is processed as if the first i
drafts were appended (penalties count them, ``min_tokens`` counts them, the grammar's mask is
the one after them: kvserve/sampling/rows.py), so each row's distribution is the one plain
decoding would draw from there: a greedy request's output is token for token the output
without speculation, and a sampled one's is drawn by speculative sampling
(``Sampler.verify_draft``) from exactly the distribution of drawing one token at a time. A
grammar's request keeps only the drafted tokens its grammar accepts. Requests with a KV budget
do not draft (a budget compacts by the tokens observed, drafted ones included), nor do
requests under a ``zip:`` KV format (which blocks keep their finer copy follows the steps
taken: drafting would change it, and with it the tokens), nor requests with a seed: their draws must repeat, and how far a request drafts follows the
machine's measured timing.

How far each request drafts is decided per step (spec/cost.py): k grows with the request's
measured acceptance and shrinks as the batch grows, down to no draft at all; a request that
stopped drafting tries one token every ``PROBE_EVERY`` steps, so its acceptance stays known. A
probe costs prompt lookup one row, but a model proposer a drafting pass: with one, the interval
doubles after each probe that did not make drafting pay, up to ``PROBE_MAX``. Probes fall on
steps that are multiples of the interval, so the requests that probe share one pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from kvserve.config import SpeculativeConfig
from kvserve.kv.budget.budgets import Budgets
from kvserve.request import Request
from kvserve.sampling.sampler import Sampler
from kvserve.scheduler.scheduler import SchedulerOutput
from kvserve.speculative.cost import FixedCosts, StepCosts, draft_length
from kvserve.speculative.proposers import Proposer

PROBE_EVERY = 8              # steps between one-token drafts of a request that stopped drafting, at first
PROBE_MAX = 128              # ... and at most
PRIOR_ACCEPTANCE = 0.5       # p of a proposer before any draft was checked
# a decode step's cost on this project's CPU box (SmolLM2-135M, gguf weights: 4.2 ms at 1 row,
# 15.7 ms at 16; docs/weights.md) until the engine's own steps are measured
PRIOR_STEP_BASE_S, PRIOR_STEP_ROW_S = 3.5e-3, 0.75e-3


class Acceptance:
    """p, the chance that a drafted token is accepted when those before it were: accepted
    tokens over tokens checked up to the first rejection, older drafts weighing less."""

    def __init__(self, prior: float, weight: float = 2.0, decay: float = 0.8) -> None:
        self.decay = decay
        self._accepted, self._checked = prior * weight, weight

    def observe(self, num_drafted: int, num_accepted: int) -> None:
        checked = num_accepted + (1 if num_accepted < num_drafted else 0)
        self._accepted = self.decay * self._accepted + num_accepted
        self._checked = self.decay * self._checked + checked

    @property
    def p(self) -> float:
        return self._accepted / self._checked


@dataclass
class SpecStats:
    """Counters since the engine started (read by the metrics observer)."""

    method: str = ""
    num_drafts: int = 0               # chunks that carried a draft
    num_draft_tokens: int = 0         # tokens proposed and checked
    num_accepted_tokens: int = 0      # of those, accepted
    num_skipped: int = 0              # decoding requests that could draft but whose draft would not pay

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a drafted chunk gave on average: accepted drafts plus the target's own."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def num_accepted(draft: Sequence[int], targets: Sequence[int]) -> int:
    """The longest run of drafted tokens the target agrees with, from the first."""
    n = 0
    while n < len(draft) and draft[n] == targets[n]:
        n += 1
    return n


def before_block_end(position: int, block_size: int) -> int:
    """How many tokens may follow ``position`` in a chunk that holds no block's last slot but
    (maybe) at ``position`` itself.

    Where a format encodes whole blocks, a step encodes a block as its last slot is written,
    before it attends: a query at that slot or later reads the block encoded, one before it
    reads the block's full-precision row. Plain decoding has one query per step, so each query
    reads the block as this rule says; a chunk holding queries on both sides of a block's last
    slot could not (one representation per block and step), so drafts stop short of it."""
    offset = position % block_size
    next_last = position + (block_size if offset == block_size - 1 else block_size - 1 - offset)
    return next_last - position - 1


class Speculation:
    """What the engine calls of speculative decoding. This base drafts nothing (decoding without
    speculation: a null object, so the engine asks no "is it on?"); ``Speculator`` drafts."""

    stats: SpecStats | None = None      # counters (None: off)

    def propose(self, running: Sequence[Request]) -> dict[str, list[int]]:
        """Drafts for the running requests about to decode (request id -> tokens)."""
        return {}

    def fill(self, out: SchedulerOutput) -> None:
        """Drafts made in a pass of their own, into the scheduled chunks that carry placeholders."""

    def verify(self, logits: torch.Tensor, req: Request, draft: Sequence[int], row_tokens: list[int],
               sampler: Sampler) -> list[int]:
        """The tokens a drafted request's rows give: the drafts kept, then one of the model's."""
        raise AssertionError("verify: nothing was drafted")

    def observe_step(self, num_rows: int, seconds: float) -> None:
        """A step that only decoded (one known token per request, drafts besides) took ``seconds``."""

    def always_draft(self) -> None:
        """Draft every step, whether it pays or not (measurements)."""

    def forget(self, request_id: str) -> None:
        """Drop what is kept for a finished request."""

    def clear_history(self) -> None:
        """Drop what the proposer learnt from finished requests (measurements start cold)."""

    def check_integrity(self) -> None:
        """Check what the proposer holds."""


class Speculator(Speculation):
    def __init__(self, config: SpeculativeConfig, proposer: Proposer, budgets: Budgets,
                 max_model_len: int, whole_block_size: int | None = None) -> None:
        """``whole_block_size``: the block size, where the KV format encodes whole blocks (KIVI keys,
        ``+outN``): a chunk with drafts then never holds a block's last slot but at its start
        (``before_block_end``)."""
        self.config = config
        self.whole_block_size = whole_block_size
        self.proposer = proposer
        self.budgets = budgets
        self.max_model_len = max_model_len
        self.stats: SpecStats = SpecStats(config.method)
        self.costs = StepCosts(PRIOR_STEP_BASE_S, PRIOR_STEP_ROW_S)
        self.acceptance = Acceptance(PRIOR_ACCEPTANCE)           # the proposer's, over every request
        self._acceptance: dict[str, Acceptance] = {}             # each request's
        self._probe_every: dict[str, int] = {}                   # each non-drafting request's probe interval
        self._step = 0

    def can_draft(self, req: Request) -> bool:
        """Whether ``req`` takes drafts (the module docstring says which do)."""
        p = req.params
        return (p.speculate and (p.is_greedy or p.seed is None)
                and self.budgets.max_blocks(p, req.num_prompt_tokens) is None and self.budgets.takes_drafts)

    def propose(self, running: Sequence[Request]) -> dict[str, list[int]]:
        """Drafts for the running requests about to decode (request id -> tokens). A model
        proposer's are placeholders of the length it will draft, filled by ``fill`` once the
        step is scheduled."""
        drafts: dict[str, list[int]] = {}
        decoding = [r for r in running if r.num_computed_tokens == r.num_tokens - 1]
        q = self._row_share(len(decoding))
        self._step += 1
        for req in decoding:
            if not self.can_draft(req):
                continue
            rid = req.request_id
            # room for the drafts and the target's own token, within max_tokens and the context
            room = min(req.max_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens) - 1
            p = self._acceptance[rid].p if rid in self._acceptance else self.acceptance.p
            k = draft_length(p, q, self.config.num_speculative_tokens)
            probing = False
            if k == 0:
                self.stats.num_skipped += 1
                every = self._probe_every.setdefault(rid, PROBE_EVERY)
                probing = self._step % every == 0
                k = 1 if probing else 0
            else:
                self._probe_every.pop(rid, None)
            k = min(k, room)
            if self.whole_block_size is not None:
                k = min(k, before_block_end(req.num_tokens - 1, self.whole_block_size))
            if k <= 0:
                continue
            draft = self.proposer.propose(req, k)
            if draft and req.constraint is not None and not self.proposer.runs_pass:
                draft = draft[:req.constraint.valid_prefix(draft)]   # what the grammar rejects is never accepted
            if draft:
                drafts[rid] = draft
                if probing and self.proposer.runs_pass:     # a pass spent: back off
                    self._probe_every[rid] = min(2 * self._probe_every[rid], PROBE_MAX)
        return drafts

    def always_draft(self) -> None:
        """Turn the cost model off: every request that can draft drafts ``num_speculative_tokens``
        tokens each step, paying or not (to measure what a proposer gives when never backing off)."""
        self.costs = FixedCosts(1.0, 0.0)
        self.proposer.always_draft()

    def _row_share(self, batch: int) -> float:
        """q of spec/cost.py: what a drafted token costs (its row in the step, and for a model
        proposer a drafting pass's share) over what a plain step's token costs."""
        q = self.costs.row_share(batch)
        if self.proposer.runs_pass:
            step = self.costs.step_s(batch)
            q += self.proposer.pass_seconds(batch) / step if step > 0 else 1.0
        return q

    def fill(self, out: SchedulerOutput) -> None:
        """A model proposer's drafts for the scheduled chunks that carry placeholders."""
        if not self.proposer.runs_pass:
            return
        at = [i for i, c in enumerate(out.chunks) if c.draft]
        if not at:
            return
        drafts = self.proposer.draft([(out.chunks[i].request, len(out.chunks[i].draft)) for i in at])
        for i, draft in zip(at, drafts):
            out.chunks[i] = replace(out.chunks[i], draft=tuple(draft))

    def observe_step(self, num_rows: int, seconds: float) -> None:
        self.costs.observe(num_rows, seconds)

    def verify(self, logits: torch.Tensor, req: Request, draft: Sequence[int], row_tokens: list[int],
               sampler: Sampler) -> list[int]:
        """The tokens ``req``'s rows give (``logits`` [k + 1, vocab], ``row_tokens`` the sampler's
        token for each): the drafts kept, then one of the model's. Greedy: the drafts that
        agree with each row's argmax; sampled: speculative sampling. Counted in the stats."""
        if req.params.is_greedy:
            emitted = row_tokens[:num_accepted(draft, row_tokens) + 1]
        else:
            emitted = sampler.verify_draft(logits, req, draft)
        self.record(req, len(draft), len(emitted) - 1)
        return emitted

    def record(self, req: Request, num_draft_tokens: int, accepted: int) -> None:
        req.num_draft_tokens += num_draft_tokens
        req.num_accepted_tokens += accepted
        self._acceptance.setdefault(req.request_id, Acceptance(self.acceptance.p)).observe(num_draft_tokens, accepted)
        self.acceptance.observe(num_draft_tokens, accepted)
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_draft_tokens
        s.num_accepted_tokens += accepted

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
        self._acceptance.pop(request_id, None)
        self._probe_every.pop(request_id, None)

    def clear_history(self) -> None:
        self.proposer.clear_history()

    def check_integrity(self) -> None:
        self.proposer.check_integrity()

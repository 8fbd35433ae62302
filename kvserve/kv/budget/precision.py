"""Precision by saliency: which blocks of a ``zip:`` KV format keep their finer copy.

Every request gets a ``ProbeObserver``, the ``saliency`` policy's state without a budget: the
probe queries' attention is scored as for the ``saliency`` budget (docs/budgets.md), except
that decode queries are probes only every 16th position, like the prompt's. After each step
that filled one of its blocks (``settle``) the request keeps the finer copies of its most
salient full blocks, ``ceil(salient x full blocks)`` of them; the others lose theirs, unless
another running request counts the block among its own most salient (a shared block's
precision is the most any of its readers asks for). A block's saliency is its most salient token's: per token, ZipCache's
normalized attention summed over KV heads and averaged over layers. ``rank=recent`` (the
control: no saliency, and no probe scored) ranks the first block (the attention sink) first,
then the newest.

A prompt is ranked again once it is whole. While its chunks run, the finer copies its settles
drop are held aside in host memory (bytes, ``ZipKVCache.finer_copies``), up to ``host_bytes``
for all requests (beyond that a dropped copy is gone); at the first settle after its last
chunk the prompt is ranked with its question added to every token's saliency
(``ProbeObserver.question``: the normalized attention of the probes of the prompt's last
window alone, the question in a chat, which is what the answer reads; from then on in every
settle), the blocks then ranked most salient get their held copies back, into free side
slots, and the rest are released. So which blocks keep their finer copy is decided with the
whole prompt seen, as ZipCache quantizes after the prefill: a fact early in a long prompt is
not ranked by the filler after it alone (docs/kv_formats.md, the passkeys). The prompt's own logits are those
of the precision it had while its chunks ran. After that a block that loses its finer copy
never gets it back: precision only falls, as the context grows and saliency settles.

This is the engine's ``Budgets`` under such a format, and it runs KV budgets too, of the
``saliency-blocks`` policy alone: one measure, ``block_saliency`` (the question's attention
included), then decides both which blocks a request keeps and which of those keep their finer
copy. A budgeted request's state is its observer with that budget (its probes are the saliency
budgets': every decode query among them). Once the prompt is whole and its full blocks pass
``budget // block_size``, a compaction keeps that many (``BudgetState.choose_blocks``: the
first, the attention sink; those of the last window, up to 32 tokens; the most salient of the
rest), then the open block; the table is those blocks in order, and the others are freed. No
entry is written: a kept block keeps its base parts and its finer copy as they are, so a
compaction costs a ranking, a shared or cached block stays as it is, and the kept KV is never
encoded a second time (a compaction that moves single entries would encode every block it
touches again, from values already rounded: with a 2-bit base that lost needles;
docs/budgets.md). The blocks leaving the table lose their finer copies (but those another
running request keeps among its own), and the request is ranked again at once over what it
kept (slots are no longer positions then: saliency and the question are read at each slot's
position). Other policies are refused (``ZIP_POLICY``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvserve.kv.block_pool import Block
from kvserve.kv.budget.budgets import BudgetStats, BudgetStep, KVBudgets
from kvserve.kv.budget.host_store import HostBlockStore
from kvserve.kv.budget.policies import PROBE_STRIDE, SNAPKV_WINDOW, get_policy
from kvserve.kv.budget.state import BudgetState, TokenPlan, seen_by
from kvserve.kv.storage.zip import ZipKVCache
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams

# the saliency policy's state with this budget has the budget policy's probe window (32 positions)
_OBSERVED_BUDGET = 2 * SNAPKV_WINDOW


class ProbeObserver(BudgetState):
    """The ``saliency`` policy's state, for the attention path to score into. Without a budget
    (``bounded`` false) nothing is ever evicted, so a slot is its position; with one it is the
    ``saliency-blocks`` budget's state (module docstring). A slot's saliency adds the question's
    attention once the prompt is whole (``slot_saliency``)."""

    def __init__(self, num_layers: int, num_kv_heads: int, block_size: int, device: torch.device,
                 budget: int | None = None) -> None:
        policy = get_policy("saliency-blocks" if budget is not None else "saliency")
        self.bounded = budget is not None
        if budget is None:
            super().__init__(policy, _OBSERVED_BUDGET, [_OBSERVED_BUDGET] * num_layers, num_kv_heads, block_size,
                             device)
        else:
            super().__init__(policy, budget, policy.layer_budgets(budget, num_layers, block_size), num_kv_heads,
                             block_size, device)
        # the question: the probes of the prompt's last window (``begin_question``, ``end_question``)
        self._before_question: tuple[torch.Tensor, int] | None = None
        self.question: torch.Tensor | None = None
        self.regraded = False       # ranked with the whole prompt seen (``SaliencyPrecision.settle``)

    def prepare(self, slot_start: int, first_pos: int, num_new: int) -> None:
        assert self.bounded or slot_start == first_pos, "an observer's slots are its positions"
        super().prepare(slot_start, first_pos, num_new)

    def key_mask(self, layer: int, num_slots: int) -> torch.Tensor:
        if self.bounded:
            return super().key_mask(layer, num_slots)
        return torch.ones(num_slots, dtype=torch.bool, device=self.device)

    def slot_saliency(self, num_slots: int) -> torch.Tensor:
        """``BudgetState.slot_saliency`` with the question's attention added to every slot's once
        the prompt is whole (module docstring)."""
        per_slot = super().slot_saliency(num_slots)
        question = self.question_at(num_slots)
        return per_slot if question is None else per_slot + question

    def question_at(self, num_slots: int) -> torch.Tensor | None:
        """[num_slots] the question's attention to what the first ``num_slots`` slots hold: per slot
        its position's, averaged over layers and KV heads (which hold other positions there once
        a budget has compacted; before, every slot is its position). None before the prompt is whole."""
        if self.question is None:
            return None
        pos = self._all_pos[..., :num_slots]
        known = pos < self.question.shape[0]
        return (self.question[pos.clamp(max=self.question.shape[0] - 1)] * known).mean(dim=(0, 1))

    def begin_question(self) -> None:
        """The next step scores the first probes of the prompt's last window: what the scores
        hold now is not the question's (once: a window's steps after its first add to it)."""
        assert self._all_score is not None
        if self._before_question is not None:
            return
        self._before_question = (self._all_score[..., :self.num_recorded].clone(), len(self.probes))

    def end_question(self) -> None:
        """The prompt is whole: ``question`` is per token the normalized attention that the probes
        scored since ``begin_question`` gave it (summed over KV heads, averaged over layers): the
        prompt's last window, and the stride probes that shared a step with its first rows."""
        if self._before_question is None:        # no probe scored (rank=recent)
            return
        assert self._all_score is not None and not self.is_compacted, "a question ranked after a compaction"
        before, first_probe = self._before_question
        n = self.num_recorded
        added = self._all_score[..., :n].clone()
        added[..., :before.shape[-1]] -= before
        added /= seen_by(self.probes[first_probe:], torch.arange(n, device=self.device))
        self.question = added.sum(dim=1).mean(dim=0)
        self._before_question = None


#: why a ``zip:`` format runs KV budgets of one policy alone
ZIP_POLICY = ("one measure ranks both which blocks a budget keeps and which keep their finer copy: "
              "saliency-blocks' (the others keep single entries, whose moves would encode the kept blocks again, "
              "or stash blocks without their finer copies)")


class SaliencyPrecision(KVBudgets):
    #: which blocks keep their finer copy follows the steps a request took: a drafting request's
    #: tokens would not be those of plain decoding
    takes_drafts = False
    #: compactions keep whole blocks: no entry is written again
    rewrites_entries = False

    def __init__(self, storage: ZipKVCache, num_kv_heads: int, host_bytes: int,
                 default_budget: int | None = None, default_policy: str = "saliency-blocks") -> None:
        if host_bytes < 0:
            raise ValueError(f"host memory for held finer copies must be >= 0 bytes, got {host_bytes}")
        assert storage.format.refine is not None
        self.spec = storage.format.spec
        if default_budget is not None:
            self._check_policy(default_policy)
        super().__init__(storage, num_kv_heads, default_budget, default_policy, HostBlockStore(0))
        self.storage: ZipKVCache = storage
        self.salient = storage.format.refine.salient
        self.rank = storage.format.refine.rank
        self._states: dict[str, BudgetState] = {}   # ProbeObserver each: ``_observer``
        self._wanted: dict[str, set[int]] = {}      # per request, the blocks it keeps refined
        self._settled: dict[str, int] = {}          # per request, its full blocks when it last settled
        self._before: dict[str, list[int]] = {}     # per compacting request, its table when planned
        self.num_dropped = 0                        # finer copies dropped by ``settle`` and compactions, all requests
        self.host_bytes = host_bytes
        self.copy_nbytes = storage.finer_nbytes
        self._held: dict[str, dict[int, torch.Tensor]] = {}   # per request, its prompt's dropped copies
        self.num_unheld = 0         # copies a prompt dropped with no host room to hold them
        self.num_restored = 0       # held copies given back when their prompt was whole

    def _check_policy(self, name: str) -> None:
        if name != "saliency-blocks":
            raise ValueError(f"KV policy {name!r} cannot run under the KV format {self.spec}: {ZIP_POLICY}; "
                             "give kv_policy saliency-blocks")

    def check(self, params: SamplingParams) -> None:
        super().check(params)
        resolved = self.resolve(params)
        if resolved is not None:
            self._check_policy(resolved[1])

    def start(self, request: Request) -> None:
        rid = request.request_id
        if rid not in self._states:
            resolved = self.resolve(request.params)
            self._states[rid] = ProbeObserver(self.num_layers, self.num_kv_heads, self.block_size,
                                              self.storage.device, None if resolved is None else resolved[0])

    def _observer(self, request_id: str) -> ProbeObserver | None:
        state = self._states.get(request_id)
        assert state is None or isinstance(state, ProbeObserver)
        return state

    def begin_step(self, request: Request, num_new: int) -> BudgetStep | None:
        state = self._observer(request.request_id)
        if state is None:
            return None
        first_pos = request.num_computed_tokens
        slot_start = first_pos - state.num_evicted
        state.prepare(slot_start, first_pos, num_new)
        prompt = request.num_prompt_tokens
        window = range(prompt - state.window, prompt)
        if state.bounded:
            # the saliency budgets' probes (every decode query among them): eviction reads them
            rows = state.probe_rows(first_pos, num_new, request.num_tokens)
        else:
            # probes by position: every 16th and the prompt's last window; decode queries only every
            # 16th too (the last token of each block, the step that fills it and settles), so 15
            # decode steps in 16 score nothing
            rows = () if self.rank != "saliency" else tuple(
                r for r in range(num_new) if first_pos + r in window or (first_pos + r + 1) % PROBE_STRIDE == 0)
        if any(first_pos + r in window for r in rows):
            state.begin_question()
        state.record_probes(first_pos, rows)
        return BudgetStep(state, slot_start, 0, state.is_compacted, bool(rows) or state.is_compacted, rows)

    def target_slots(self, request: Request) -> int | None:
        state = self._observer(request.request_id)
        return None if state is None or not state.bounded else super().target_slots(request)

    def kept_blocks(self, request: Request, block_ids: list[int]) -> list[int] | None:
        """``saliency-blocks``' choice (``BudgetState.choose_blocks``), ranked by ``block_saliency``
        (the question's attention included); the table is remembered for ``apply_blocks``."""
        kept = super().kept_blocks(request, block_ids)
        self._before[request.request_id] = list(block_ids)
        return kept

    def apply_blocks(self, request: Request, kept: list[int], block_ids: list[int]) -> None:
        """The blocks leaving the table lose their finer copies (but those another running
        request keeps among its own); the request is ranked again over what it kept."""
        rid = request.request_id
        state = self._observer(rid)
        assert state is not None
        super().apply_blocks(request, kept, block_ids)
        now = set(block_ids)
        self._wanted.pop(rid, None)
        others = self._wanted_by_others(rid)
        self.num_dropped += len(self.storage.refined.drop(
            b for b in self._before.pop(rid) if b not in now and b not in others))
        self._rank(request, block_ids, state.num_recorded // self.block_size, regrade=False)

    def plan(self, request: Request, block_ids: list[int], rewritten: frozenset[int] = frozenset()) -> TokenPlan:
        raise RuntimeError("a zip: format's budgets keep whole blocks (kept_blocks)")

    def apply(self, request: Request, plan: TokenPlan, block_ids: list[int]) -> None:
        raise RuntimeError("a zip: format's budgets keep whole blocks (kept_blocks)")

    def drop(self, request_id: str) -> None:
        super().drop(request_id)
        self._wanted.pop(request_id, None)
        self._settled.pop(request_id, None)
        self._held.pop(request_id, None)
        self._before.pop(request_id, None)

    @property
    def held_nbytes(self) -> int:
        return self.copy_nbytes * sum(len(h) for h in self._held.values())

    def stats(self) -> BudgetStats:
        return BudgetStats(self._num_compactions, self.held_nbytes, self.host_bytes, self.num_unheld)

    def block_saliency(self, request_id: str, num_blocks: int) -> torch.Tensor:
        """[num_blocks] the saliency of the request's first ``num_blocks`` blocks of slots (module
        docstring): per slot, its saliency summed over KV heads and averaged over layers, plus the
        question's attention to it; per block, its most salient slot's."""
        state = self._observer(request_id)
        assert state is not None
        return state.block_saliency(num_blocks)

    def settle(self, request: Request, table: Sequence[Block]) -> None:
        rid = request.request_id
        state = self._observer(rid)
        if state is None:
            return
        num_full = min(request.num_computed_tokens - state.num_evicted, state.num_recorded) // self.block_size
        prompt_whole = request.num_computed_tokens >= request.num_prompt_tokens
        regrade = prompt_whole and not state.regraded      # the first settle with the whole prompt
        if num_full == self._settled.get(rid, 0) and not regrade:
            return
        if regrade:
            state.end_question()
            state.regraded = True
        self._rank(request, [b.block_id for b in table[:num_full]], num_full, regrade)

    def _wanted_by_others(self, request_id: str) -> set[int]:
        return set().union(*(w for r, w in self._wanted.items() if r != request_id))

    def _rank(self, request: Request, table: Sequence[int], num_full: int, regrade: bool) -> None:
        """Keep the finer copies of the request's ``ceil(salient x num_full)`` most salient full
        blocks (of ``table``, its block ids); drop the others' (module docstring)."""
        rid = request.request_id
        prompt_whole = request.num_computed_tokens >= request.num_prompt_tokens
        self._settled[rid] = num_full
        block_ids = list(table[:num_full])
        score = (self.block_saliency(rid, num_full) if self.rank == "saliency" else _recency(num_full)).tolist()
        keep = math.ceil(self.salient * num_full)
        # most salient first; ties go to the earlier block
        order = sorted(range(num_full), key=lambda i: (-score[i], i))
        wanted = {block_ids[i] for i in order[:keep]}
        self._wanted[rid] = wanted
        others = self._wanted_by_others(rid)
        losing = [b for b in block_ids if b not in wanted and b not in others]
        if not prompt_whole:
            self._hold(rid, losing)
        dropped = self.storage.refined.drop(losing)
        self.num_dropped += len(dropped)
        held = self._held.pop(rid, {}) if regrade else {}
        back = [block_ids[i] for i in order[:keep]
                if block_ids[i] in held and self.storage.refined.slot(block_ids[i]) is None]
        if back:
            self.num_restored += len(self.storage.restore_finer(back, torch.stack([held[b] for b in back])))

    def check_integrity(self) -> None:
        super().check_integrity()
        assert self._held.keys() <= self._states.keys(), "held finer copies of a request with no state"
        assert self.held_nbytes <= self.host_bytes, "held finer copies over the host room"
        refined = self.storage.refined
        assert all(refined.slot(b) is None for held in self._held.values() for b in held), (
            "a held finer copy of a block that holds one")

    def _hold(self, request_id: str, block_ids: list[int]) -> None:
        """Hold aside the finer copies of those of ``block_ids`` that have one, while the host
        room lasts (module docstring)."""
        refined = [b for b in block_ids if self.storage.refined.slot(b) is not None]
        room = (self.host_bytes - self.held_nbytes) // self.copy_nbytes if self.copy_nbytes else 0
        taken = refined[:max(room, 0)]
        self.num_unheld += len(refined) - len(taken)
        if taken:
            held = self._held.setdefault(request_id, {})
            held.update(zip(taken, self.storage.finer_copies(taken)))


def _recency(num_blocks: int) -> torch.Tensor:
    """``rank=recent``'s scores: block 0 first, then the newest."""
    score = torch.arange(num_blocks, dtype=torch.float32)
    score[0] = float(num_blocks)
    return score

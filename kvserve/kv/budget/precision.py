"""Precision by saliency: which blocks of a ``zip:`` KV format keep their finer copy.

Every request gets a ``ProbeObserver``, the ``saliency`` policy's state without a budget: the
probe queries' attention is scored as for the ``saliency`` budget (docs/budgets.md), except
that decode queries are probes only every 16th position, like the prompt's. After each step
that filled one of its blocks (``settle``) the request keeps the finer copies of its most
salient full blocks, ``ceil(salient x full blocks)`` of them; the others lose theirs, unless
another running request counts the block among its own most salient (a shared block's
precision is the most any of its readers asks for). A block's saliency is its most salient token's: per token, ZipCache's
normalized attention summed over KV heads and averaged over layers. A block that loses its
finer copy never gets it back (the full-precision values are gone): precision only falls, as
the context grows and saliency settles. ``rank=recent`` (the control: no saliency, and no
probe scored) ranks the first block (the attention sink) first, then the newest.

KV budgets that evict are not available here (the blocks are quantized: nothing can be
compacted), so this is the engine's ``Budgets`` under such a format.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from kvserve.kv.block_pool import Block
from kvserve.kv.budget.budgets import BudgetStep, NoBudgets
from kvserve.kv.budget.policies import PROBE_STRIDE, SNAPKV_WINDOW, get_policy
from kvserve.kv.budget.state import BudgetState
from kvserve.kv.storage.zip import ZipKVCache
from kvserve.request import Request

# the saliency policy's state with this budget has the budget policy's probe window (32 positions)
_OBSERVED_BUDGET = 2 * SNAPKV_WINDOW


class ProbeObserver(BudgetState):
    """The ``saliency`` policy's state without a budget, for the attention path to score into:
    nothing is ever evicted, so a slot is its position. ``saliency`` is
    ``BudgetState.saliency``'s, read for every layer at once (``saliency_of_layers``; tested equal)."""

    def __init__(self, num_layers: int, num_kv_heads: int, block_size: int, device: torch.device) -> None:
        super().__init__(get_policy("saliency"), _OBSERVED_BUDGET, [_OBSERVED_BUDGET] * num_layers, num_kv_heads,
                         block_size, device)

    def prepare(self, slot_start: int, first_pos: int, num_new: int) -> None:
        assert slot_start == first_pos, "an observer's slots are its positions"
        super().prepare(slot_start, first_pos, num_new)

    def key_mask(self, layer: int, num_slots: int) -> torch.Tensor:
        return torch.ones(num_slots, dtype=torch.bool, device=self.device)

    def saliency(self, layer: int, slots: torch.Tensor | None = None) -> torch.Tensor:
        every = self.saliency_of_layers(self.num_recorded)[layer]
        return every if slots is None else every[:, slots]

    def saliency_of_layers(self, num_slots: int) -> torch.Tensor:
        """[layers, heads, num_slots] the saliency of the first ``num_slots`` slots in every layer."""
        probes = torch.tensor(self.probes, dtype=torch.long, device=self.device)
        seen_by = len(self.probes) - torch.searchsorted(probes, torch.arange(num_slots, device=self.device))
        assert self._all_score is not None
        return self._all_score[..., :num_slots] / seen_by.clamp(min=1)


#: why a ``zip:`` format runs no KV budgets
ZIP_NO_BUDGETS = ("which blocks keep a finer copy follows the slots of the requests reading them, and a compaction "
                  "would move them")


class SaliencyPrecision(NoBudgets):
    #: which blocks keep their finer copy follows the steps a request took: a drafting request's
    #: tokens would not be those of plain decoding
    takes_drafts = False

    def __init__(self, storage: ZipKVCache, num_kv_heads: int) -> None:
        assert storage.format.refine is not None
        super().__init__(f"KV format {storage.format.spec}: {ZIP_NO_BUDGETS}")
        self.storage = storage
        self.salient = storage.format.refine.salient
        self.rank = storage.format.refine.rank
        self.num_layers = storage.num_layers
        self.num_kv_heads = num_kv_heads
        self.block_size = storage.block_size
        self._states: dict[str, ProbeObserver] = {}
        self._wanted: dict[str, set[int]] = {}      # per request, the blocks it keeps refined
        self._settled: dict[str, int] = {}          # per request, its full blocks when it last settled
        self.num_dropped = 0                        # finer copies dropped by ``settle``, all requests

    def start(self, request: Request) -> None:
        if request.request_id not in self._states:
            self._states[request.request_id] = ProbeObserver(self.num_layers, self.num_kv_heads, self.block_size,
                                                             self.storage.device)

    def get(self, request_id: str) -> BudgetState | None:
        return self._states.get(request_id)

    def begin_step(self, request: Request, num_new: int) -> BudgetStep | None:
        state = self._states.get(request.request_id)
        if state is None:
            return None
        first_pos = request.num_computed_tokens
        state.prepare(first_pos, first_pos, num_new)
        # probes by position: every 16th and the prompt's last window; decode queries only every
        # 16th too (the last token of each block, the step that fills it and settles), so 15 decode
        # steps in 16 score nothing
        prompt = request.num_prompt_tokens
        rows = () if self.rank != "saliency" else tuple(
            r for r in range(num_new)
            if prompt - state.window <= first_pos + r < prompt or (first_pos + r + 1) % PROBE_STRIDE == 0)
        state.record_probes(first_pos, rows)
        return BudgetStep(state, first_pos, 0, False, bool(rows), rows)

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._wanted.pop(request_id, None)
        self._settled.pop(request_id, None)

    def block_saliency(self, request_id: str, num_blocks: int) -> torch.Tensor:
        """[num_blocks] the saliency of the request's first ``num_blocks`` blocks (module docstring)."""
        per_token = self._states[request_id].saliency_of_layers(num_blocks * self.block_size).sum(dim=1).mean(dim=0)
        return per_token.view(num_blocks, self.block_size).amax(dim=1)

    def settle(self, request: Request, table: Sequence[Block]) -> None:
        rid = request.request_id
        state = self._states.get(rid)
        num_full = min(request.num_computed_tokens, 0 if state is None else state.num_recorded) // self.block_size
        if state is None or num_full == self._settled.get(rid, 0):
            return
        self._settled[rid] = num_full
        block_ids = [b.block_id for b in table[:num_full]]
        score = (self.block_saliency(rid, num_full) if self.rank == "saliency" else _recency(num_full)).tolist()
        keep = math.ceil(self.salient * num_full)
        # most salient first; ties go to the earlier block
        order = sorted(range(num_full), key=lambda i: (-score[i], i))
        wanted = {block_ids[i] for i in order[:keep]}
        self._wanted[rid] = wanted
        others = set().union(*(w for r, w in self._wanted.items() if r != rid))
        dropped = self.storage.refined.drop(b for b in block_ids if b not in wanted and b not in others)
        self.num_dropped += len(dropped)


def _recency(num_blocks: int) -> torch.Tensor:
    """``rank=recent``'s scores: block 0 first, then the newest."""
    score = torch.arange(num_blocks, dtype=torch.float32)
    score[0] = float(num_blocks)
    return score

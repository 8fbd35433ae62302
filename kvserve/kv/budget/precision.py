"""Precision by saliency: which blocks of a ``zip:`` KV format keep their finer copy.

Every request gets a ``BudgetState`` under the ``saliency`` policy that never compacts: the
probe queries' attention is scored as for the ``saliency`` budget (docs/budgets.md), and after
each step that filled one of its blocks (``settle``) the request keeps the finer copies of its
most salient full blocks,
``ceil(salient x full blocks)`` of them; the others lose theirs, unless another running request
counts the block among its own most salient (a shared block's precision is the most any of its
readers asks for). A block's saliency is its most salient token's: per token, ZipCache's
normalized attention summed over KV heads and averaged over layers. A block that loses its
finer copy never gets it back (the full-precision values are gone): precision only falls, as
the context grows and saliency settles. ``rank=recent`` (the control: no saliency) ranks the
first block (the attention sink) first, then the newest.

KV budgets that evict are not available here (the blocks are quantized: nothing can be
compacted), so this is the engine's ``Budgets`` under such a format.
"""

from __future__ import annotations

import math

import torch

from kvserve.kv.budget.budgets import BudgetStep, NoBudgets
from kvserve.kv.budget.policies import SNAPKV_WINDOW, get_policy
from kvserve.kv.budget.state import BudgetState
from kvserve.kv.storage.zip import ZipKVCache
from kvserve.request import Request

# the saliency policy's state with this budget has the budget policy's probe window (32 positions)
_OBSERVED_BUDGET = 2 * SNAPKV_WINDOW


class SaliencyPrecision(NoBudgets):
    def __init__(self, storage: ZipKVCache, num_kv_heads: int) -> None:
        assert storage.format.refine is not None
        super().__init__(f"KV format {storage.format.spec} is quantized; budgets need the native format")
        self.storage = storage
        self.salient = storage.format.refine.salient
        self.rank = storage.format.refine.rank
        self.num_layers = storage.num_layers
        self.num_kv_heads = num_kv_heads
        self.block_size = storage.block_size
        self.policy = get_policy("saliency")
        self._states: dict[str, BudgetState] = {}
        self._wanted: dict[str, set[int]] = {}      # per request, the blocks it keeps refined
        self._settled: dict[str, int] = {}          # per request, its full blocks when it last settled
        self.num_dropped = 0                        # finer copies dropped by ``settle``, all requests

    def start(self, request: Request) -> None:
        if request.request_id not in self._states:
            self._states[request.request_id] = BudgetState(
                self.policy, _OBSERVED_BUDGET, [_OBSERVED_BUDGET] * self.num_layers, self.num_kv_heads,
                self.block_size, self.storage.device)

    def get(self, request_id: str) -> BudgetState | None:
        return self._states.get(request_id)

    def begin_step(self, request: Request, num_new: int) -> BudgetStep | None:
        state = self._states.get(request.request_id)
        if state is None:
            return None
        first_pos = request.num_computed_tokens
        state.prepare(first_pos, first_pos, num_new)
        rows = state.probe_rows(first_pos, num_new, request.num_tokens)
        state.record_probes(first_pos, rows)
        return BudgetStep(state, first_pos, 0, False, bool(rows), rows)

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)
        self._wanted.pop(request_id, None)
        self._settled.pop(request_id, None)

    def block_saliency(self, request_id: str, num_blocks: int) -> torch.Tensor:
        """[num_blocks] the saliency of the request's first ``num_blocks`` blocks (module docstring)."""
        state = self._states[request_id]
        num_slots = num_blocks * self.block_size
        per_token = torch.stack([state.saliency(layer)[:, :num_slots].sum(dim=0) for layer in range(self.num_layers)])
        return per_token.mean(dim=0).view(num_blocks, self.block_size).amax(dim=1)

    def settle(self, request: Request, block_ids: list[int]) -> None:
        rid = request.request_id
        state = self._states.get(rid)
        num_full = min(request.num_computed_tokens, 0 if state is None else state.num_recorded) // self.block_size
        if state is None or num_full == self._settled.get(rid, 0):
            return
        self._settled[rid] = num_full
        score = self.block_saliency(rid, num_full) if self.rank == "saliency" else _recency(num_full)
        keep = math.ceil(self.salient * num_full)
        # most salient first; ties go to the earlier block
        order = sorted(range(num_full), key=lambda i: (-float(score[i]), i))
        wanted = {block_ids[i] for i in order[:keep]}
        self._wanted[rid] = wanted
        others = set().union(*(w for r, w in self._wanted.items() if r != rid))
        dropped = self.storage.refined.drop(b for b in block_ids[:num_full] if b not in wanted and b not in others)
        self.num_dropped += len(dropped)


def _recency(num_blocks: int) -> torch.Tensor:
    """``rank=recent``'s scores: block 0 first, then the newest."""
    score = torch.arange(num_blocks, dtype=torch.float32)
    score[0] = float(num_blocks)
    return score

"""KV budgets of the running requests: who has one, when it is due, and the compaction.

The KV manager owns block tables and calls these verbs; this object owns each
budgeted request's ``BudgetState`` and reads and writes the paged K/V tensors:

    start(request)     a request with a budget (its own or the engine's) gets a state
    is_due(...)        its context exceeds the budget and a compaction would free a block
    plan(...)          choose what stays (reads the cache, changes nothing)
    apply(...)         write the kept entries to the front of the (rewritten) table
    drop(request_id)   forget the state (finished or preempted: it restarts from scratch)

A request's budget is ``params.kv_budget`` or else the engine's ``kv_budget``; its
policy is ``params.kv_policy`` or else the engine's ``kv_policy``.
"""

from __future__ import annotations

import torch

from kvserve.kv.budget.arkvale import ArkValeState
from kvserve.kv.budget.policies import check_budget, get_policy
from kvserve.kv.budget.state import BudgetState, TokenPlan
from kvserve.kv.paged_cache import PagedKVCache
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


class NoBudgets:
    """The null object for engines that cannot run budgets (quantized KV formats)."""

    def __init__(self, reason: str = "") -> None:
        self.reason = reason

    def check(self, params: SamplingParams) -> None:
        if params.kv_budget is not None or params.kv_policy is not None:
            raise ValueError(f"KV budgets are not available here: {self.reason}")

    def start(self, request: Request) -> None:
        pass

    def get(self, request_id: str) -> BudgetState | None:
        return None

    def num_evicted(self, request_id: str) -> int:
        return 0

    def drop(self, request_id: str) -> None:
        pass

    def max_blocks(self, params: SamplingParams, num_prompt_tokens: int) -> int | None:
        return None

    def target_slots(self, request: Request) -> int | None:
        return None

    def plan(self, request: Request, block_ids: list[int]) -> TokenPlan:
        raise RuntimeError("no KV budgets here")

    def apply(self, request: Request, plan: TokenPlan, block_ids: list[int]) -> None:
        raise RuntimeError("no KV budgets here")

    @property
    def host_nbytes(self) -> int:
        return 0


class KVBudgets(NoBudgets):
    def __init__(self, cache: PagedKVCache, num_kv_heads: int, default_budget: int | None,
                 default_policy: str) -> None:
        super().__init__()
        self.cache = cache
        self.num_layers = len(cache.key_caches)
        self.num_kv_heads = num_kv_heads
        self.block_size = cache.block_size
        self.device = cache.key_caches[0].device
        self.default_budget = default_budget
        self.default_policy = get_policy(default_policy)
        if default_budget is not None:
            check_budget(default_budget, self.default_policy, self.block_size)
        self._states: dict[str, BudgetState] = {}
        self.num_compactions = 0

    def resolve(self, params: SamplingParams) -> tuple[int, str] | None:
        """The (budget, policy name) a request runs under, or None for no budget."""
        budget = params.kv_budget if params.kv_budget is not None else self.default_budget
        if budget is None:
            return None
        return budget, params.kv_policy or self.default_policy.name

    def check(self, params: SamplingParams) -> None:
        if params.kv_policy is not None and params.kv_budget is None and self.default_budget is None:
            raise ValueError(f"kv_policy {params.kv_policy!r} needs a kv_budget (the engine sets none)")
        resolved = self.resolve(params)
        if resolved is not None:
            check_budget(resolved[0], get_policy(resolved[1]), self.block_size)

    def max_blocks(self, params: SamplingParams, num_prompt_tokens: int) -> int | None:
        """Most blocks a budgeted request holds at once (its prefill, or budget plus a block
        and the open one), or None when it has no budget."""
        resolved = self.resolve(params)
        if resolved is None:
            return None
        budget, name = resolved
        top = max(get_policy(name).layer_budgets(budget, self.num_layers))
        return max(-(-(num_prompt_tokens + 1) // self.block_size), top // self.block_size + 3)

    def start(self, request: Request) -> None:
        resolved = self.resolve(request.params)
        if resolved is None or request.request_id in self._states:
            return
        budget, name = resolved
        policy = get_policy(name)
        cls = ArkValeState if policy.is_paged else BudgetState
        self._states[request.request_id] = cls(
            policy, budget, policy.layer_budgets(budget, self.num_layers), self.num_kv_heads,
            self.block_size, self.device)

    def get(self, request_id: str) -> BudgetState | None:
        return self._states.get(request_id)

    def num_evicted(self, request_id: str) -> int:
        state = self._states.get(request_id)
        return 0 if state is None else state.num_evicted

    def drop(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    @property
    def host_nbytes(self) -> int:
        return sum(s.host_nbytes for s in self._states.values() if isinstance(s, ArkValeState))

    # -- compaction ----------------------------------------------------------
    def target_slots(self, request: Request) -> int | None:
        """Slots the request keeps if it compacts now, or None when no compaction is due:
        its context fits the budget, it is mid-prefill under a policy that waits for the
        end of the prefill, or compacting would not free a whole block."""
        state = self._states.get(request.request_id)
        if state is None:
            return None
        num_computed = request.num_computed_tokens
        if num_computed <= state.budget:
            return None
        if not state.policy.evicts_in_prefill and num_computed < request.num_tokens:
            return None
        num_slots = num_computed - state.num_evicted
        if isinstance(state, ArkValeState):
            target = state.num_resident * self.block_size + num_computed % self.block_size
        else:
            target = state.max_layer_budget
        if num_slots - target < self.block_size:
            return None
        return target

    def plan(self, request: Request, block_ids: list[int]) -> TokenPlan:
        state = self._states[request.request_id]
        num_slots = request.num_computed_tokens - state.num_evicted
        table = torch.tensor([block_ids], dtype=torch.long, device=self.device)
        keys, values = [], []
        for layer in range(self.num_layers):
            k, v = self.cache.gather(layer, table)
            keys.append(k[0, :num_slots])
            values.append(v[0, :num_slots])
        return state.plan(keys, values, num_slots)

    def apply(self, request: Request, plan: TokenPlan, block_ids: list[int]) -> None:
        """Write the plan's entries to slots [0, kept) of the table ``block_ids``."""
        bs = self.block_size
        for layer in range(self.num_layers):
            n = plan.keys[layer].shape[0]
            slots = torch.tensor([block_ids[s // bs] * bs + s % bs for s in range(n)],
                                 dtype=torch.long, device=self.device)
            self.cache.write(layer, plan.keys[layer], plan.values[layer], slots)
        self._states[request.request_id].apply(plan, request.num_computed_tokens)
        self.num_compactions += 1

"""KV budgets of the running requests: who has one, when it is due, and the compaction.

``Budgets`` is the one owner of every budgeted request's ``BudgetState``; the KV manager,
the model runner and the attention path call its verbs (and the states' policy hooks),
never a state's fields:

    start(request)        a request with a budget (its own or the engine's) gets a state
    begin_step(req, n)    a step is about to compute n tokens: record their slots, say how
                          attention must treat the chunk
    target_slots(req)     a compaction is due: how many slots stay
    plan(...)             choose what stays (reads the storage, changes nothing)
    apply(...)            write the kept entries to the front of the (rewritten) table
    drop(request_id)      forget the state (finished or preempted: it restarts from scratch)
    settle(req, blocks)   after a step: which blocks keep a finer copy (``zip:`` formats only)

A request's budget is ``params.kv_budget`` or else the engine's ``kv_budget``; its
policy is ``params.kv_policy`` or else the engine's ``kv_policy``. ``KVBudgets`` runs
them (and ``SaliencyPrecision``, kv/budget/precision.py, under a ``zip:`` KV format, whose
compactions keep whole blocks: ``kept_blocks``); ``NoBudgets`` stands in where an engine's parts
are built without budgets.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar, NamedTuple

import torch

from kvserve.kv.block_pool import Block
from kvserve.kv.budget.arkvale import ArkValeState
from kvserve.kv.budget.host_store import HostBlockStore
from kvserve.kv.budget.policies import check_budget, get_policy
from kvserve.kv.budget.state import BudgetState, SlotReader, TokenPlan
from kvserve.kv.storage import KVStorage
from kvserve.request import Request
from kvserve.sampling_params import SamplingParams


class BudgetStep(NamedTuple):
    """How a budgeted request's chunk goes through this step (``Budgets.begin_step``)."""

    state: BudgetState
    slot_start: int        # cache slot of the chunk's first token (its position - num_evicted)
    observe_from: int      # first query position whose attention weights the policy scores
    is_compacted: bool     # slots are no longer positions: attended on its own, with its masks
    is_observed: bool      # attention must see the chunk (to score it, capture queries, or attend)
    scored_rows: tuple[int, ...] | None = None   # the chunk's rows the policy scores (probes); None: from observe_from


class BudgetStats(NamedTuple):
    num_compactions: int
    host_nbytes: int            # ArkVale's stashed blocks, all requests
    host_capacity_bytes: int
    num_host_evictions: int     # stashed blocks pushed out for room: they can no longer be recalled


class Budgets(ABC):
    """The KV budgets of an engine's requests (module docstring)."""

    @abstractmethod
    def check(self, params: SamplingParams) -> None:
        """Raise ValueError for a budget or policy this engine cannot run."""

    @abstractmethod
    def max_blocks(self, params: SamplingParams, num_prompt_tokens: int) -> int | None:
        """Most blocks a budgeted request holds at once, or None when it has no budget."""

    @abstractmethod
    def start(self, request: Request) -> None: ...

    @abstractmethod
    def get(self, request_id: str) -> BudgetState | None:
        """The request's state, for inspection (tests, tools)."""

    @abstractmethod
    def num_evicted(self, request_id: str) -> int:
        """Positions of the request no longer on the device (slot = position - num_evicted)."""

    @abstractmethod
    def is_compacted(self, request_id: str) -> bool: ...

    @abstractmethod
    def begin_step(self, request: Request, num_new: int) -> BudgetStep | None:
        """Record the slots a step is about to fill; None for a request without a budget."""

    @abstractmethod
    def target_slots(self, request: Request) -> int | None:
        """Slots the request keeps if it compacts now, or None when no compaction is due."""

    @abstractmethod
    def plan(self, request: Request, block_ids: list[int], rewritten: frozenset[int] = frozenset()) -> TokenPlan:
        """``rewritten``: the indexes in ``block_ids`` of the blocks the compaction replaces by fresh ones."""

    @abstractmethod
    def apply(self, request: Request, plan: TokenPlan, block_ids: list[int]) -> None: ...

    def kept_blocks(self, request: Request, block_ids: list[int]) -> list[int] | None:
        """A compaction that keeps whole blocks: the indexes in ``block_ids`` (the request's table)
        of the blocks it keeps, ascending, the open one last; the others leave the table and no
        entry moves (``apply_blocks``). None (here): the compaction moves entries (``plan``)."""
        return None

    def apply_blocks(self, request: Request, kept: list[int], block_ids: list[int]) -> None:
        """The table is now ``block_ids``: the blocks ``kept_blocks`` named, in that order."""
        raise RuntimeError("this engine's budgets move entries")

    @abstractmethod
    def drop(self, request_id: str) -> None: ...

    #: Requests may draft (speculative decoding) as far as the budgets go: false where the KV a
    #: request reads depends on the steps it took (precision by saliency)
    takes_drafts: ClassVar[bool] = True

    def settle(self, request: Request, table: Sequence[Block]) -> None:
        """After a step of ``request`` (its block table): precision by saliency decides which of
        its blocks keep their finer copy (kv/budget/precision.py); nothing elsewhere."""

    @abstractmethod
    def stats(self) -> BudgetStats: ...

    @property
    def num_compactions(self) -> int:
        return self.stats().num_compactions

    @property
    def host_nbytes(self) -> int:
        return self.stats().host_nbytes

    def check_integrity(self) -> None:
        pass


class NoBudgets(Budgets):
    """The null object for engines that run no budgets (an engine's parts built without them)."""

    def __init__(self, reason: str = "") -> None:
        self.reason = reason

    def check(self, params: SamplingParams) -> None:
        if params.kv_budget is not None or params.kv_policy is not None:
            raise ValueError(f"KV budgets are not available here: {self.reason}")

    def max_blocks(self, params: SamplingParams, num_prompt_tokens: int) -> int | None:
        return None

    def start(self, request: Request) -> None:
        pass

    def get(self, request_id: str) -> BudgetState | None:
        return None

    def num_evicted(self, request_id: str) -> int:
        return 0

    def is_compacted(self, request_id: str) -> bool:
        return False

    def begin_step(self, request: Request, num_new: int) -> BudgetStep | None:
        return None

    def target_slots(self, request: Request) -> int | None:
        return None

    def plan(self, request: Request, block_ids: list[int], rewritten: frozenset[int] = frozenset()) -> TokenPlan:
        raise RuntimeError("no KV budgets here")

    def apply(self, request: Request, plan: TokenPlan, block_ids: list[int]) -> None:
        raise RuntimeError("no KV budgets here")

    def drop(self, request_id: str) -> None:
        pass

    def stats(self) -> BudgetStats:
        return BudgetStats(0, 0, 0, 0)


class KVBudgets(Budgets):
    """``storage`` must support budgets; ``host_store`` takes ArkVale's blocks off the device."""

    #: compactions write entries into slots (``plan``, ``apply``): the storage must support it
    rewrites_entries: ClassVar[bool] = True

    def __init__(self, storage: KVStorage, num_kv_heads: int, default_budget: int | None,
                 default_policy: str, host_store: HostBlockStore) -> None:
        if self.rewrites_entries and not storage.supports_budgets:
            raise ValueError(f"{type(storage).__name__} cannot run KV budgets")
        self.storage = storage
        self.num_layers = storage.num_layers
        self.num_kv_heads = num_kv_heads
        self.block_size = storage.block_size
        self.device = storage.device
        self.default_budget = default_budget
        self.default_policy = get_policy(default_policy)
        if default_budget is not None:
            check_budget(default_budget, self.default_policy, self.block_size)
        self.host_store = host_store
        self._states: dict[str, BudgetState] = {}
        self._num_compactions = 0

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
        """Its prefill, or budget plus a block and the open one."""
        resolved = self.resolve(params)
        if resolved is None:
            return None
        budget, name = resolved
        top = max(get_policy(name).layer_budgets(budget, self.num_layers, self.block_size))
        return max(-(-(num_prompt_tokens + 1) // self.block_size), top // self.block_size + 3)

    def start(self, request: Request) -> None:
        rid = request.request_id
        resolved = self.resolve(request.params)
        if resolved is None or rid in self._states:
            return
        budget, name = resolved
        policy = get_policy(name)
        layer_budgets = policy.layer_budgets(budget, self.num_layers, self.block_size)
        shape = (self.num_kv_heads, self.block_size, self.device)
        self._states[rid] = (ArkValeState(policy, budget, layer_budgets, *shape, self.host_store, rid)
                             if policy.is_paged else BudgetState(policy, budget, layer_budgets, *shape))

    def get(self, request_id: str) -> BudgetState | None:
        return self._states.get(request_id)

    def num_evicted(self, request_id: str) -> int:
        state = self._states.get(request_id)
        return 0 if state is None else state.num_evicted

    def is_compacted(self, request_id: str) -> bool:
        state = self._states.get(request_id)
        return state is not None and state.is_compacted

    def begin_step(self, request: Request, num_new: int) -> BudgetStep | None:
        state = self._states.get(request.request_id)
        if state is None:
            return None
        first_pos = request.num_computed_tokens
        slot_start = first_pos - state.num_evicted
        state.prepare(slot_start, first_pos, num_new)
        observe_from = state.observe_from(request.num_tokens)
        is_observed = state.is_compacted or observe_from < first_pos + num_new or state.captures_queries
        scored_rows = None
        if state.policy.weights == "probe":
            scored_rows = state.probe_rows(first_pos, num_new, request.num_tokens)
            state.record_probes(first_pos, scored_rows)
        return BudgetStep(state, slot_start, observe_from, state.is_compacted, is_observed, scored_rows)

    def drop(self, request_id: str) -> None:
        state = self._states.pop(request_id, None)
        if state is not None:
            state.release()

    def stats(self) -> BudgetStats:
        store = self.host_store
        return BudgetStats(self._num_compactions, store.nbytes, store.capacity_bytes, store.num_evicted)

    def kept_blocks(self, request: Request, block_ids: list[int]) -> list[int] | None:
        state = self._states[request.request_id]
        if not state.policy.keeps_blocks:
            return None
        num_slots = request.num_computed_tokens - state.num_evicted
        assert len(block_ids) >= -(-num_slots // self.block_size), "a table short of its slots"
        return state.choose_blocks(num_slots)

    def apply_blocks(self, request: Request, kept: list[int], block_ids: list[int]) -> None:
        state = self._states[request.request_id]
        state.keep_blocks(kept, request.num_computed_tokens)
        self._num_compactions += 1

    def check_integrity(self) -> None:
        self.host_store.check_integrity()
        assert self.host_store.owners() <= self._states.keys(), "stashed blocks of a request with no budget state"

    # -- compaction ----------------------------------------------------------
    def target_slots(self, request: Request) -> int | None:
        """None when its context fits the budget, it is mid-prefill under a policy that waits
        for the end of the prefill, or compacting would not free a whole block."""
        state = self._states.get(request.request_id)
        if state is None:
            return None
        num_computed = request.num_computed_tokens
        if num_computed <= state.budget:
            return None
        if not state.policy.evicts_in_prefill and num_computed < request.num_tokens:
            return None
        num_slots = num_computed - state.num_evicted
        target = state.target_slots(num_computed)
        if num_slots - target < self.block_size:
            return None
        return target

    def plan(self, request: Request, block_ids: list[int], rewritten: frozenset[int] = frozenset()) -> TokenPlan:
        state = self._states[request.request_id]
        num_slots = request.num_computed_tokens - state.num_evicted
        reader = SlotReader(self.storage, block_ids, self.block_size, self.device)
        return state.plan_from(reader, num_slots, rewritten)

    def apply(self, request: Request, plan: TokenPlan, block_ids: list[int]) -> None:
        """Write the plan's entries to slots [0, kept) of the table ``block_ids``. The block
        holding slot ``plan.num_slots`` (where the next token goes) is open again; the slots
        after a layer's last entry in its block (a hole, or the tokens to come) take copies of
        that entry, so a format that encodes whole blocks sees no stale values there."""
        bs = self.block_size
        if plan.num_slots % bs:
            self.storage.reopen(block_ids[plan.num_slots // bs])
        for layer in range(self.num_layers):
            keys, values = plan.keys[layer], plan.values[layer]
            n = keys.shape[0]
            if n == 0:
                continue
            rel = list(range(n) if plan.slots is None else plan.slots[layer])
            last = max(rel)
            pad = range(last + 1, -(-(last + 1) // bs) * bs)
            if pad:
                at = rel.index(last)
                rel += pad
                keys = torch.cat([keys, keys[at:at + 1].expand(len(pad), *keys.shape[1:])])
                values = torch.cat([values, values[at:at + 1].expand(len(pad), *values.shape[1:])])
            slots = torch.tensor([block_ids[s // bs] * bs + s % bs for s in rel], dtype=torch.long, device=self.device)
            self.storage.write_slots(layer, keys, values, slots)
        self._states[request.request_id].apply(plan, request.num_computed_tokens)
        self._num_compactions += 1

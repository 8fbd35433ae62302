"""A budgeted request's view of its own cache slots, per layer and per KV head.

A request's block table holds *slots*, not positions. Until its first compaction
slot s holds position s. A compaction gathers, per layer and KV head, the kept
entries to the front (in position order), so the layout becomes

    slot      0 ............ b_l ....... base ...................... num_slots
    layer l   | kept entries |  hole    | tokens since the compaction |
                (per head)    (masked)    (slot = position - num_evicted)

where ``base`` is the largest layer budget (layers with smaller budgets, as in
pyramid, mask their hole). Positions of new tokens keep counting the true sequence
position (RoPE was applied before K was cached, so kept keys need no change).

Per layer the state keeps, for each slot and KV head: the position it holds, the
accumulated attention it received (policies that score), the number of tokens
merged into it (``merge``); and per slot whether it holds an entry at all.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

from kvserve.kv.budget.policies import PROBE_STRIDE, BudgetPolicy

if TYPE_CHECKING:
    from kvserve.kv.storage import KVStorage


class TokenPlan:
    """A compaction computed from the cache (nothing changed yet): per layer the kept
    keys and values ([num_kept, heads, dim]) and their slot metadata."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots                 # slots after the compaction (= base)
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.pos: list[torch.Tensor] = []          # [heads, num_kept]
        self.score: list[torch.Tensor | None] = []
        self.weight: list[torch.Tensor | None] = []
        # per layer, the slot each row of keys/values goes to; None: rows fill slots 0, 1, ...
        self.slots: list[list[int]] | None = None


class SlotReader:
    """A request's slots as they stand before a compaction, read on demand."""

    def __init__(self, storage: KVStorage, block_ids: list[int], block_size: int, device: torch.device) -> None:
        self.storage = storage
        self.block_ids = block_ids
        self.block_size = block_size
        self.device = device

    def read(self, layer: int, num_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots [0, num_slots) of ``layer``: keys, values [num_slots, heads, dim]."""
        table = torch.tensor([self.block_ids], dtype=torch.long, device=self.device)
        k, v = self.storage.gather(layer, table, self.storage.open_overlay(self.block_ids))
        return k[0, :num_slots], v[0, :num_slots]

    def read_blocks(self, layer: int, slot_blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of whole slot blocks (slots ``i * block_size ...`` for each ``i``): [n, block_size, heads, dim]."""
        ids = [self.block_ids[i] for i in slot_blocks]
        k, v = self.storage.gather(layer, torch.tensor([ids], dtype=torch.long, device=self.device),
                                   self.storage.open_overlay(ids))
        shape = (len(slot_blocks), self.block_size, *k.shape[2:])
        return k.view(shape), v.view(shape)

    def stored_blocks(self, layer: int, slot_blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Slot blocks as the storage stores them (``KVStorage.stored_blocks``)."""
        ids = torch.tensor([self.block_ids[i] for i in slot_blocks], dtype=torch.long, device=self.device)
        return self.storage.stored_blocks(layer, ids)


class BudgetState:
    """Owned by ``KVBudgets``; the attention path reads its masks and adds scores.

    Policy hooks (a subclass overrides what its policy does differently):
    ``target_slots`` (slots kept by a compaction), ``captures_queries`` (attention must
    see every chunk), ``before_attention`` (called in each layer before the request is
    attended), ``release`` (the request is gone).
    """

    #: attention calls ``before_attention`` for every chunk, not only those it scores or attends
    captures_queries: ClassVar[bool] = False

    def __init__(self, policy: BudgetPolicy, budget: int, layer_budgets: list[int], num_kv_heads: int,
                 block_size: int, device: torch.device) -> None:
        self.policy = policy
        self.budget = budget
        self.layer_budgets = layer_budgets
        self.window = policy.window(layer_budgets)
        self.num_kv_heads = num_kv_heads
        self.block_size = block_size
        self.device = device
        self.num_evicted = 0          # positions no longer on the device: slot = position - num_evicted
        self.num_compactions = 0
        self.num_recorded = 0         # slots whose position this state knows
        # per layer, once compacted: the slot blocks [first, end) holding no entry (``block_holes``)
        self._block_holes: tuple[tuple[int, int], ...] | None = None
        num_layers = len(layer_budgets)
        self._capacity = 0
        # every layer's slots in one tensor each ([layers, ...]), so a step records its slots in
        # one write per kind; ``pos``, ``valid``, ``score`` and ``weight`` are per-layer views
        self._all_pos = torch.empty(num_layers, num_kv_heads, 0, dtype=torch.long, device=device)
        self._all_valid = torch.empty(num_layers, 0, dtype=torch.bool, device=device)
        has_score = policy.weights != "none"
        self._all_score = torch.empty(num_layers, num_kv_heads, 0, device=device) if has_score else None
        self._all_weight = torch.empty(num_layers, num_kv_heads, 0, device=device) if policy.merges else None
        self._view_layers()
        self.probes: list[int] = []     # positions of the probe queries scored so far, ascending ("probe")

    @property
    def is_compacted(self) -> bool:
        return self.num_compactions > 0

    @property
    def max_layer_budget(self) -> int:
        return max(self.layer_budgets)

    @property
    def is_dense(self) -> bool:
        """Every layer keeps as many entries as the others, so once compacted each layer holds an
        entry in every slot (kept ones first, then the tokens since): no slot is masked."""
        return len(set(self.layer_budgets)) == 1

    @property
    def block_holes(self) -> tuple[tuple[int, int], ...] | None:
        """Per layer of a compacted request, the slot blocks ``[first, end)`` of its hole, between
        its kept entries and the tokens since (``first == end``: none); None where a hole is not
        whole blocks, or before the first compaction. A backend reading in place skips these blocks
        (a block table per layer) instead of masking the hole's slots."""
        return self._block_holes

    @property
    def scores_attention(self) -> bool:
        """The policy accumulates the attention weights its slots receive (``add_scores``)."""
        return self.score is not None

    def num_kept(self, layer: int, num_slots: int) -> int:
        return int(self.valid[layer][:num_slots].sum())

    # -- policy hooks --------------------------------------------------------
    def target_slots(self, num_computed: int) -> int:
        """Slots the request keeps if it compacts with ``num_computed`` tokens computed."""
        return self.max_layer_budget

    def before_attention(self, layer: int, q: torch.Tensor, storage: KVStorage, block_ids: list[int],
                         is_compacted: bool) -> None:
        """Layer ``layer`` is about to attend the chunk's queries ``q`` ([n, heads, dim]) over
        the request's blocks ``block_ids`` (``is_compacted``: its slots are no longer positions)."""

    def release(self) -> None:
        """The request finished or was preempted: give back what the state holds outside it."""

    # -- per step ----------------------------------------------------------
    def prepare(self, slot_start: int, first_pos: int, num_new: int) -> None:
        """Record the slots a step is about to fill with positions first_pos ..., and
        any slots before them filled without a step (prefix-cache hits)."""
        end = slot_start + num_new
        begin = min(self.num_recorded, slot_start)
        self._grow(-(-end // self.block_size) * self.block_size)
        positions = torch.arange(first_pos - (slot_start - begin), first_pos + num_new, device=self.device)
        self._all_pos[:, :, begin:end] = positions
        self._all_valid[:, begin:end] = True
        if self._all_score is not None:
            self._all_score[:, :, begin:end] = 0
        if self._all_weight is not None:
            self._all_weight[:, :, begin:end] = 1
        self.num_recorded = end

    def observe_from(self, num_known_tokens: int) -> int:
        """First query position whose attention weights this policy accumulates.

        ``window`` policies score with the queries just before the next compaction:
        the end of the prefill, or the point where the cache exceeds its budget by a block.
        """
        if self.policy.weights in ("all", "probe"):
            return 0
        if self.policy.weights == "window":
            next_compaction = max(num_known_tokens, self.num_evicted + self.max_layer_budget + self.block_size)
            return next_compaction - self.window
        return 1 << 62

    def probe_rows(self, first_pos: int, num_new: int, num_known_tokens: int) -> tuple[int, ...]:
        """The rows of a chunk (positions first_pos, ...) that are probe queries: the window before
        the end of the known tokens (so every decode query), and every PROBE_STRIDE-th position
        (the last of each stride) before it. Chosen by position alone, so a prompt gets the same
        probes however it is chunked."""
        recent = num_known_tokens - self.window
        return tuple(r for r in range(num_new)
                     if first_pos + r >= recent or (first_pos + r + 1) % PROBE_STRIDE == 0)

    def record_probes(self, first_pos: int, rows: tuple[int, ...]) -> None:
        """The chunk's probe rows are about to be scored in every layer (steps come in position
        order: budgeted requests do not draft, a preempted one starts a new state)."""
        assert not rows or not self.probes or first_pos + rows[0] > self.probes[-1], "probes out of order"
        self.probes.extend(first_pos + r for r in rows)

    def saliency(self, layer: int, slots: torch.Tensor | None = None) -> torch.Tensor:
        """ZipCache's normalized attention score of ``slots`` (default: every recorded slot) in
        ``layer``, per KV head: the attention weights the probe queries gave the entry (summed over
        the query heads of its KV head), divided by the number of probes at or after its position,
        those that could see it (at least 1). [heads, len(slots)]."""
        assert self.score is not None and self.policy.weights == "probe"
        if slots is None:
            slots = torch.arange(self.num_recorded, device=self.device)
        return self.score[layer][:, slots] / seen_by(self.probes, self.pos[layer][:, slots])

    def saliency_of_layers(self, num_slots: int) -> torch.Tensor:
        """[layers, heads, num_slots] ``saliency`` of the first ``num_slots`` slots in every layer."""
        assert self._all_score is not None and self.policy.weights == "probe"
        return self._all_score[..., :num_slots] / seen_by(self.probes, self._all_pos[..., :num_slots])

    def slot_saliency(self, num_slots: int) -> torch.Tensor:
        """[num_slots] each slot's saliency summed over KV heads and averaged over layers."""
        return self.saliency_of_layers(num_slots).sum(dim=1).mean(dim=0)

    def block_saliency(self, num_blocks: int) -> torch.Tensor:
        """[num_blocks] per block of slots, its most salient slot's ``slot_saliency``."""
        bs = self.block_size
        return self.slot_saliency(num_blocks * bs).view(num_blocks, bs).amax(dim=1)

    def choose_blocks(self, num_slots: int) -> list[int]:
        """The slot blocks a compaction over whole blocks keeps (``policy.keeps_blocks``), of the
        ``num_slots`` slots now held: ``budget // block_size`` full blocks, the first (the sinks)
        and those of the window among them, the rest the most salient (``block_saliency``; ties to
        the earlier), ascending, then the open block where the slots end inside one."""
        bs = self.block_size
        full, tail = divmod(num_slots, bs)
        keep = min(full, self.budget // bs)
        window = range(max(full - -(-self.window // bs), 0), full)
        forced = sorted({0, *window}, key=lambda i: (i == 0, -i))[:keep]      # the window first, then the sink
        score = self.block_saliency(full).tolist()
        rest = sorted((i for i in range(full) if i not in forced), key=lambda i: (-score[i], i))
        kept = sorted([*forced, *rest[:keep - len(forced)]])
        return kept + [full] if tail else kept

    def key_mask(self, layer: int, num_slots: int) -> torch.Tensor:
        """[num_slots] True where the layer's slot holds an entry."""
        self._grow(num_slots)
        return self.valid[layer][:num_slots]

    def add_scores(self, layer: int, scores: torch.Tensor, first_slot: int = 0) -> None:
        """Accumulate attention received by each slot: scores [heads, n] for slots first_slot, ..."""
        assert self.score is not None
        self.score[layer][:, first_slot:first_slot + scores.shape[1]] += scores

    # -- compaction ----------------------------------------------------------
    def plan_from(self, reader: SlotReader, num_slots: int, rewritten: frozenset[int]) -> TokenPlan:
        """``plan`` over what ``reader`` reads; ``rewritten``: the slot blocks whose table block the
        compaction replaces by a fresh one (a shared or cached block), so a plan that moves only
        some entries must write these whole."""
        keys, values = zip(*(reader.read(layer, num_slots) for layer in range(len(self.layer_budgets))))
        return self.plan(list(keys), list(values), num_slots)

    def plan(self, keys: list[torch.Tensor], values: list[torch.Tensor], num_slots: int) -> TokenPlan:
        """Choose the kept entries of every layer. keys/values: per layer [num_slots, heads, dim]."""
        plan = TokenPlan(self.max_layer_budget)
        for layer, (k, v) in enumerate(zip(keys, values)):
            valid_idx = self.valid[layer][:num_slots].nonzero().squeeze(1)
            b = self.layer_budgets[layer]
            if valid_idx.shape[0] <= b:
                keep = valid_idx.expand(self.num_kv_heads, -1)
            else:
                if self.score is None:
                    score = None
                elif self.policy.weights == "probe":
                    score = self.saliency(layer, valid_idx)
                else:
                    score = self.score[layer][:, valid_idx]
                keep = self.policy.keep(valid_idx, score, b, self.window, self.num_kv_heads)
            kh, vh = k.transpose(0, 1), v.transpose(0, 1)            # [heads, slots, dim]
            idx = keep[..., None].expand(-1, -1, k.shape[-1])
            new_k, new_v = kh.gather(1, idx), vh.gather(1, idx)
            score_kept = None if self.score is None else self.score[layer].gather(1, keep)
            weight_kept = None
            if self.weight is not None:
                weight_kept = self.weight[layer].gather(1, keep)
                evicted = _evicted(valid_idx, keep, num_slots)
                if evicted is not None:
                    new_k, new_v, weight_kept = merge_into_kept(
                        kh, vh, self.weight[layer], evicted, new_k, new_v, weight_kept)
                    if self.score is not None and score_kept is not None:
                        score_kept = score_kept + _scatter_to_targets(
                            self.score[layer].gather(1, evicted), kh, evicted, new_k)
            plan.keys.append(new_k.transpose(0, 1))
            plan.values.append(new_v.transpose(0, 1))
            plan.pos.append(self.pos[layer].gather(1, keep))
            plan.score.append(score_kept)
            plan.weight.append(weight_kept)
        return plan

    def apply(self, plan: TokenPlan, num_computed: int) -> None:
        """The plan's entries now sit in slots [0, kept) of every layer."""
        bs, base = self.block_size, plan.num_slots
        num_kept = [p.shape[1] for p in plan.pos]
        self._block_holes = (tuple((n // bs, base // bs) for n in num_kept)
                             if base % bs == 0 and all(n % bs == 0 for n in num_kept) else None)
        for layer in range(len(self.layer_budgets)):
            n = num_kept[layer]
            self.valid[layer][:] = False
            self.valid[layer][:n] = True
            self.pos[layer][:, :n] = plan.pos[layer]
            if self.score is not None:
                kept = plan.score[layer]
                # window policies score afresh with the next window; h2o and saliency keep accumulating
                self.score[layer][:] = 0
                if self.policy.weights in ("all", "probe") and kept is not None:
                    self.score[layer][:, :n] = kept
            weight = plan.weight[layer]
            if self.weight is not None and weight is not None:
                self.weight[layer][:, :n] = weight
        self.num_evicted = num_computed - plan.num_slots
        self.num_recorded = plan.num_slots
        self.num_compactions += 1

    def keep_blocks(self, kept: list[int], num_computed: int) -> None:
        """A compaction of a request with ``num_computed`` tokens computed kept whole slot blocks
        ``kept`` (ascending; the open block last where its slots end inside one) and dropped the
        others: slot ``i * bs + r`` now holds what slot ``kept[i] * bs + r`` held, in every layer
        and head."""
        bs = self.block_size
        num_slots = num_computed - self.num_evicted
        tail = num_slots % bs
        assert not tail or kept[-1] == num_slots // bs, "the open block is kept last"
        old = torch.tensor(kept, dtype=torch.long, device=self.device)
        index = (old[:, None] * bs + torch.arange(bs, device=self.device)).flatten()
        n = index.numel()
        self._all_pos[..., :n] = self._all_pos[..., index]
        self._all_valid[..., :n] = self._all_valid[..., index]
        self._all_valid[..., n:] = False
        if self._all_score is not None:
            self._all_score[..., :n] = self._all_score[..., index]
            self._all_score[..., n:] = 0
        if self._all_weight is not None:
            self._all_weight[..., :n] = self._all_weight[..., index]
        self.num_recorded = n - (bs - tail if tail else 0)
        self.num_evicted = num_computed - self.num_recorded
        full = len(kept) - (1 if tail else 0)
        self._block_holes = ((full, full),) * len(self.layer_budgets)      # no hole in any layer
        self.num_compactions += 1

    def _grow(self, capacity: int) -> None:
        if capacity <= self._capacity:
            return
        new = max(capacity, 2 * self._capacity)

        def pad(t: torch.Tensor, fill: float | bool) -> torch.Tensor:
            extra = torch.full((*t.shape[:-1], new - t.shape[-1]), fill, dtype=t.dtype, device=t.device)
            return torch.cat([t, extra], dim=-1)

        self._all_pos = pad(self._all_pos, 0)
        self._all_valid = pad(self._all_valid, False)
        if self._all_score is not None:
            self._all_score = pad(self._all_score, 0.0)
        if self._all_weight is not None:
            self._all_weight = pad(self._all_weight, 1.0)
        self._capacity = new
        self._view_layers()

    def _view_layers(self) -> None:
        self.pos: list[torch.Tensor] = list(self._all_pos.unbind(0))              # [heads, slots] each
        self.valid: list[torch.Tensor] = list(self._all_valid.unbind(0))          # [slots]
        self.score: list[torch.Tensor] | None = (
            None if self._all_score is None else list(self._all_score.unbind(0)))
        self.weight: list[torch.Tensor] | None = (
            None if self._all_weight is None else list(self._all_weight.unbind(0)))


def seen_by(probes: list[int], positions: torch.Tensor) -> torch.Tensor:
    """How many of ``probes`` (ascending positions) could see each of ``positions``: those at or
    after it, at least 1 (the divisor of ZipCache's normalized attention)."""
    at = torch.tensor(probes, dtype=torch.long, device=positions.device)
    return (len(probes) - torch.searchsorted(at, positions.contiguous())).clamp(min=1)


def _evicted(valid_idx: torch.Tensor, keep: torch.Tensor, num_slots: int) -> torch.Tensor | None:
    """Per head, the valid slots not kept: [heads, n_valid - budget], or None when none are."""
    heads = keep.shape[0]
    is_evicted = torch.zeros(heads, num_slots, dtype=torch.bool, device=keep.device)
    is_evicted[:, valid_idx] = True
    is_evicted.scatter_(1, keep, False)
    count = int(is_evicted[0].sum())
    if count == 0:
        return None
    return is_evicted.nonzero()[:, 1].view(heads, count)


def _targets(kh: torch.Tensor, evicted: torch.Tensor, new_k: torch.Tensor) -> torch.Tensor:
    """For each evicted entry, the kept entry whose key is most similar (cosine): [heads, n_evicted]."""
    ek = kh.gather(1, evicted[..., None].expand(-1, -1, kh.shape[-1]))
    sim = F.normalize(ek, dim=-1) @ F.normalize(new_k, dim=-1).transpose(1, 2)
    return sim.argmax(-1)


def _scatter_to_targets(values: torch.Tensor, kh: torch.Tensor, evicted: torch.Tensor,
                        new_k: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(new_k.shape[:2], dtype=values.dtype, device=values.device)
    return out.scatter_add_(1, _targets(kh, evicted, new_k), values)


def merge_into_kept(kh: torch.Tensor, vh: torch.Tensor, weight: torch.Tensor, evicted: torch.Tensor,
                    new_k: torch.Tensor, new_v: torch.Tensor, new_w: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fold each evicted entry into its most similar kept entry, as weighted means:
    k' = (w_kept k_kept + sum w_e k_e) / (w_kept + sum w_e), the same for v; the weights add."""
    dim = kh.shape[-1]
    target = _targets(kh, evicted, new_k)                     # [heads, n_evicted]
    w_e = weight.gather(1, evicted)                            # [heads, n_evicted]
    idx = evicted[..., None].expand(-1, -1, dim)
    tgt = target[..., None].expand(-1, -1, dim)
    sum_k = (new_k * new_w[..., None]).scatter_add(1, tgt, kh.gather(1, idx) * w_e[..., None])
    sum_v = (new_v * new_w[..., None]).scatter_add(1, tgt, vh.gather(1, idx) * w_e[..., None])
    total = new_w.scatter_add(1, target, w_e)
    return sum_k / total[..., None], sum_v / total[..., None], total

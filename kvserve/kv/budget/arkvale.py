"""ArkVale-style recallable pages: the request keeps ``R = budget / block_size`` full
blocks per layer on the device; the others wait in host memory and come back when
they matter again.

Every full block gets, per layer, a *digest* of its keys: the per-channel minimum
and maximum over its tokens, per KV head. For a query q, no key k of the block can
score more than

    ub(q, block) = sum_c max(q_c * min_c, q_c * max_c)      >= q . k for every k in it
                 = q . centre + |q| . half_width             (centre, half_width per channel)

Blocks are ranked by ``q . centre + w * |q| . half_width``: ``w = 1`` is that bound
(policy ``arkvale-bound``), ``w = 0`` the centre of the box. The bound is loose where a
block's keys spread widely (prose and filler blocks hold a few tokens with extreme
channels, so their box is wide even where no single key scores high), and then it can
rank a block that one head attends to sharply below dozens of wide ones; the default
``arkvale`` takes ``w = ARKVALE_BOUND_WEIGHT`` (docs/budgets.md has the measurement).

At each decode step and layer, all full blocks (device and host) are ranked that way
(pages.py: one C++ call on CPU) and the top R are wanted resident: a host block in the top
set swaps places with a resident block outside it (device -> host, host -> device), best
against worst, as long as it outscores that block by more than the policy's
``recall_margin`` (logits), so near ties do not churn; then attention runs over the
resident blocks plus the open tail. The first block (the attention sinks) and the most
recent full block are always resident. Blocks are ranked per query head relative to that
head's best block, then by their best head, so a block that one head needs is kept even
if the other heads ignore it.

Layout of a request's slots (per layer, all heads alike):

    slot-block   0 .. R-1                       R ...
                 | resident full blocks (any order) | tail: tokens after the last full block |

The first compaction (at the end of the prefill) keeps the top R blocks for the last query
seen, in block order, moves the rest to the host, and puts the tail right after them. Each
later one (when the tail fills a block) moves only what changes: of the resident blocks and
the blocks filled since, the lowest ranked go to the host, the new ones that stay take
their slots, and the tail moves down to slot-block R. So positions
``>= num_evicted + R * block_size`` map to slots linearly.

Host blocks live in the engine's ``HostBlockStore`` (host_store.py), bounded in bytes.
A block the store evicted for room cannot come back: it ranks below every other block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from kvserve.kv.budget.host_store import HostBlock, HostBlockStore, StashKey
from kvserve.kv.budget.pages import HOST, LOST, RESIDENT, DigestBox, PageSelector
from kvserve.kv.budget.policies import ArkVale, BudgetPolicy
from kvserve.kv.budget.state import BudgetState, SlotReader, TokenPlan

if TYPE_CHECKING:
    from kvserve.kv.storage import KVStorage


def keep_ends_on_top(rank: torch.Tensor) -> torch.Tensor:
    """``rank`` (one key per full block) with the first block (the attention sinks) and the most
    recent full block above every other."""
    rank[0] = rank[rank.shape[0] - 1] = float("inf")
    return rank


def block_scores(q: torch.Tensor, dmin: torch.Tensor, dmax: torch.Tensor,
                 bound_weight: float = 1.0) -> torch.Tensor:
    """Rank key for each block: q [heads, dim], dmin/dmax [blocks, kv_heads, dim] -> [blocks].
    Per query head ``q . centre + bound_weight * |q| . half_width`` (1: the bound on q . k),
    relative to that head's best block; then each block's best head."""
    num_blocks, kv_heads, dim = dmin.shape
    qg = q.float().view(kv_heads, -1, dim)[None]                    # [1, kv, group, dim]
    lo, hi = dmin.float()[:, :, None, :], dmax.float()[:, :, None, :]
    s = (qg * (hi + lo)).sum(-1) / 2
    if bound_weight:
        s = s + bound_weight * (qg.abs() * (hi - lo)).sum(-1) / 2
    s = s.reshape(num_blocks, -1)                                    # [blocks, heads]
    return (s - s.max(dim=0).values).max(dim=1).values


class Stash(NamedTuple):
    """Blocks of one layer bound for the host store: their indexes, keys and values [n, block_size,
    heads, dim], or as the storage stashes them (``KVStorage.stored_blocks``; None when there are
    none)."""

    indexes: list[int]
    keys: torch.Tensor | None
    values: torch.Tensor | None


def stash(blocks: list[tuple[int, torch.Tensor, torch.Tensor]]) -> Stash:
    """The blocks (index, keys, values), copied into one batch."""
    if not blocks:
        return Stash([], None, None)
    return Stash([j for j, _, _ in blocks], torch.stack([k for _, k, _ in blocks]),
                 torch.stack([v for _, _, v in blocks]))


class PagePlan(TokenPlan):
    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.resident: list[list[int]] = []
        self.to_host: list[Stash] = []
        self.host_slots: list[list[int]] = []  # per layer: the slot block each of to_host's was read from
        self.digests: list[DigestBox] = []     # per layer: every full block's digest


class ArkValeState(BudgetState):
    """``owner``: the request id its blocks are stashed under in ``host_store``."""

    captures_queries = True

    def __init__(self, policy: BudgetPolicy, budget: int, layer_budgets: list[int], num_kv_heads: int,
                 block_size: int, device: torch.device, host_store: HostBlockStore, owner: str) -> None:
        super().__init__(policy, budget, layer_budgets, num_kv_heads, block_size, device)
        assert isinstance(policy, ArkVale)
        self.bound_weight = policy.bound_weight
        self.recall_margin = policy.recall_margin     # logits
        self.host_store = host_store
        self.owner = owner
        num_layers = len(layer_budgets)
        self.num_resident = budget // block_size
        self.resident: list[list[int]] = [[] for _ in range(num_layers)]
        self.last_q: list[torch.Tensor | None] = [None] * num_layers
        self.boxes: list[DigestBox | None] = [None] * num_layers        # per layer, every full block's digest
        self.where: list[torch.Tensor | None] = [None] * num_layers     # per full block: HOST, RESIDENT or LOST
        self._num_evicted_seen = 0      # the host store's evictions of this request already marked LOST
        self.selector = PageSelector(device)
        self._pos_on_cpu = device.type == "cpu"
        self._in_place: bool | None = None       # see _trades_in_place
        self.recalls: list[tuple[int, int]] = []       # (layer, block) each time a host block came back

    @property
    def host(self) -> list[dict[int, HostBlock]]:
        """Per layer, the stashed blocks by index (read from the store)."""
        return [self.host_store.blocks_of(self.owner, layer) for layer in range(len(self.layer_budgets))]

    @property
    def host_nbytes(self) -> int:
        return self.host_store.nbytes_of(self.owner)

    def num_digested(self, layer: int) -> int:
        box = self.boxes[layer]
        return 0 if box is None else box.num_blocks

    def capture_query(self, layer: int, q: torch.Tensor) -> None:
        """Keep the layer's latest query ([heads, dim]): the next compaction ranks blocks by it."""
        last = self.last_q[layer]
        if last is None or last.shape != q.shape or last.dtype != q.dtype:
            self.last_q[layer] = q.detach().clone()
        else:
            last.copy_(q)       # the same memory each step: no allocation

    # -- policy hooks --------------------------------------------------------
    def target_slots(self, num_computed: int) -> int:
        return self.num_resident * self.block_size + num_computed % self.block_size

    def before_attention(self, layer: int, q: torch.Tensor, storage: KVStorage, block_ids: list[int],
                         is_compacted: bool) -> None:
        self.capture_query(layer, q[-1])
        if is_compacted and q.shape[0] == 1:
            self.select(layer, q[0], storage, block_ids)

    def release(self) -> None:
        self.host_store.drop_owner(self.owner)

    # -- decode: make the top blocks resident --------------------------------
    def select(self, layer: int, q: torch.Tensor, storage: KVStorage, block_ids: list[int]) -> None:
        """Swap the host blocks that rank in the top set for ``q`` with resident blocks outside
        it, while each gains more than the margin (pages.py; ``block_ids``: the request's table)."""
        resident = self.resident[layer]
        box, where = self.boxes[layer], self.where[layer]
        if box is None or where is None or box.num_blocks <= len(resident):
            return
        margin = self.recall_margin * q.shape[-1] ** 0.5      # logits -> raw q . k
        parts = storage.layer_parts(layer)
        if self._trades_in_place(parts):       # (which marks this layer's lost blocks itself)
            assert parts is not None and self.selector.native is not None
            pool = self.host_store.pool         # (none yet: nothing to recall, so no pair is made)
            done = self.selector.native.swap_pages(
                box.store, box.num_blocks, q.float().contiguous(), self.bound_weight, where, len(resident), margin,
                self.host_store.rows_of(self.owner, layer, box.num_blocks),
                pool if pool is not None else torch.empty(0, 2, 0), parts[0], parts[1], block_ids, resident,
                self.pos[layer], self.block_size).tolist()
            if done:
                self.host_store.swapped(self.owner, layer, [(j_in, j_out) for j_in, j_out, _ in done])
                for j_in, _, i in done:
                    resident[i] = j_in
                self.recalls.extend((layer, j_in) for j_in, _, _ in done)
            return
        self._mark_lost()
        pairs = self.selector.swaps(box, q, self.bound_weight, where, len(resident), margin)
        if not pairs:
            return
        coming = [j for j, _ in pairs]
        places = [resident.index(j) for _, j in pairs]     # where in ``resident`` each comes in
        going = [resident[i] for i in places]
        coming_keys, going_keys = [self._key(layer, j) for j in coming], [self._key(layer, j) for j in going]
        # all taken before any outgoing block is stashed, which may evict the oldest blocks
        k_in, v_in = self.host_store.take_many(coming_keys)
        slots = torch.tensor([block_ids[i] for i in places], dtype=torch.long, device=storage.device)
        k_out, v_out = storage.swap_blocks(layer, slots, k_in.to(storage.device), v_in.to(storage.device))
        self.host_store.put_many(going_keys, k_out, v_out)
        bs = self.block_size
        for i, j_in in zip(places, coming):
            where[j_in], where[resident[i]] = RESIDENT, HOST
            resident[i] = j_in
            self.pos[layer][:, i * bs:(i + 1) * bs] = torch.arange(j_in * bs, (j_in + 1) * bs, device=self.device)
        self.recalls.extend((layer, j) for j in coming)

    def _trades_in_place(self, parts: tuple[list[torch.Tensor], list[torch.Tensor]] | None) -> bool:
        """Whether ``select`` chooses and trades blocks in one C++ pass (``swap_pages``): CPU
        blocks (any KV format: their bytes trade places), positions on the CPU, the C++ build
        loaded; decided once (the storage's tensors do not change)."""
        if self._in_place is None:
            self._in_place = (parts is not None and self.selector.native is not None and self._pos_on_cpu
                              and self.host_store.can_exchange(parts))
        return self._in_place

    def _mark_lost(self) -> None:
        """Mark LOST, in every layer, the host blocks the store has evicted since the last look."""
        num_evicted = self.host_store.num_evicted_of(self.owner)
        if num_evicted == self._num_evicted_seen:
            return
        self._num_evicted_seen = num_evicted
        for layer, where in enumerate(self.where):
            if where is None:
                continue
            host = (where == HOST).nonzero().flatten().tolist()
            lost = [j for j in host if not self.host_store.contains(self._key(layer, j))]
            if lost:
                where[lost] = LOST

    def _key(self, layer: int, index: int) -> StashKey:
        return StashKey(self.owner, layer, index)

    def _rank(self, layer: int, q: torch.Tensor | None, box: DigestBox) -> torch.Tensor:
        """Rank key of every full block: its score for ``q`` (recency without a query), the first
        and the latest block on top, the blocks the host store evicted for room at the bottom."""
        num_blocks = box.num_blocks
        rank = (torch.arange(num_blocks, dtype=torch.float32, device=self.device) if q is None
                else self.selector.scores(box, q, self.bound_weight))
        return self._demote_lost(layer, keep_ends_on_top(rank))

    def _demote_lost(self, layer: int, rank: torch.Tensor) -> torch.Tensor:
        """``rank`` with the blocks the host store evicted for room at the bottom (blocks digested
        since the last compaction are on the device: none of them is lost)."""
        where = self.where[layer]
        if where is not None and self.host_store.num_evicted_of(self.owner):
            self._mark_lost()
            lost = (where == LOST).nonzero().flatten()
            rank[lost.to(rank.device)] = float("-inf")
        return rank

    # -- compaction ----------------------------------------------------------
    def plan(self, keys: list[torch.Tensor], values: list[torch.Tensor], num_slots: int) -> PagePlan:
        """The first compaction (``plan_from`` makes the later ones): of the prompt's full blocks,
        the top R for the last query seen stay, in block order, the others go to the host, and the
        tail follows the kept blocks. Nothing is evicted before it, so slot = position."""
        assert not self.is_compacted, "later compactions go through plan_from"
        bs = self.block_size
        num_full = num_slots // bs
        tail_slot = num_full * bs
        plan = PagePlan(self.num_resident * bs + num_slots - tail_slot)
        for layer, (k, v) in enumerate(zip(keys, values)):
            blocks_k = k[:tail_slot].view(num_full, bs, *k.shape[1:])
            blocks_v = v[:tail_slot].view(num_full, bs, *v.shape[1:])
            box = DigestBox.extend(None, blocks_k.amin(dim=1), blocks_k.amax(dim=1))
            keep = sorted(self._rank(layer, self.last_q[layer], box).topk(self.num_resident).indices.tolist())
            kept = set(keep)
            plan.to_host.append(stash([(j, blocks_k[j], blocks_v[j]) for j in range(num_full) if j not in kept]))
            plan.host_slots.append(plan.to_host[-1].indexes)       # (slot = position)
            plan.keys.append(torch.cat([blocks_k[keep].flatten(0, 1), k[tail_slot:num_slots]]))
            plan.values.append(torch.cat([blocks_v[keep].flatten(0, 1), v[tail_slot:num_slots]]))
            plan.resident.append(keep)
            plan.digests.append(box)
        return plan

    def plan_from(self, reader: SlotReader, num_slots: int, rewritten: frozenset[int]) -> TokenPlan:
        """Once compacted, a compaction moves only what changes: the blocks filled since go into
        the slots of the resident blocks that leave (or to the host), and the open tail after the
        resident blocks; the blocks that stay keep their slots (unless their table block is
        ``rewritten``). The first compaction gathers and places every block (``plan``)."""
        if not self.is_compacted:
            return self._stored(reader, super().plan_from(reader, num_slots, rewritten))
        bs, num_resident = self.block_size, self.num_resident
        num_full = (self.num_evicted + num_slots) // bs
        tail_slot = num_full * bs - self.num_evicted
        moved_from = num_resident * bs                    # the blocks filled since, then the tail
        plan = PagePlan(moved_from + num_slots - tail_slot)
        plan.slots = []
        for layer in range(len(self.layer_budgets)):
            resident = self.resident[layer]
            first_recent = self.num_digested(layer)
            num_new = num_full - first_recent
            k_new, v_new = reader.read_blocks(layer, list(range(num_resident, -(-num_slots // bs))))
            box = DigestBox.extend(self.boxes[layer], k_new[:num_new].amin(dim=1), k_new[:num_new].amax(dim=1))
            # the blocks filled since take the places of the lowest ranked of them and the resident
            # ones; host blocks come back through ``select``, where the margin applies
            candidates = resident + list(range(first_recent, num_full))
            rank = self._rank(layer, self.last_q[layer], box)[candidates]
            dropped = {candidates[n] for n in rank.topk(num_new, largest=False).indices.tolist()}
            keep = set(candidates) - dropped
            leaving = [i for i, j in enumerate(resident) if j in dropped]
            incoming = [j for j in range(first_recent, num_full) if j in keep]
            stay_rewritten = sorted(i for i in rewritten if i < num_resident and resident[i] in keep)
            k_old, v_old = reader.read_blocks(layer, leaving + stay_rewritten) if leaving or stay_rewritten else (
                k_new[:0], v_new[:0])
            to_host = stash([(resident[i], k_old[n], v_old[n]) for n, i in enumerate(leaving)]
                            + [(j, k_new[j - first_recent], v_new[j - first_recent])
                               for j in range(first_recent, num_full) if j not in keep])
            host_slots = leaving + [num_resident + j - first_recent for j in range(first_recent, num_full) if j not in keep]
            new_resident = list(resident)
            parts: list[tuple[torch.Tensor, torch.Tensor]] = []
            slots: list[int] = []
            for i, j in zip(leaving, incoming, strict=True):
                parts.append((k_new[j - first_recent], v_new[j - first_recent]))
                new_resident[i] = j
                slots += range(i * bs, (i + 1) * bs)
            for n, i in enumerate(stay_rewritten):
                parts.append((k_old[len(leaving) + n], v_old[len(leaving) + n]))
                slots += range(i * bs, (i + 1) * bs)
            tail = slice(tail_slot - moved_from, num_slots - moved_from)
            parts.append((k_new.flatten(0, 1)[tail], v_new.flatten(0, 1)[tail]))
            slots += range(moved_from, moved_from + num_slots - tail_slot)
            plan.keys.append(torch.cat([k for k, _ in parts]))
            plan.values.append(torch.cat([v for _, v in parts]))
            plan.slots.append(slots)
            plan.resident.append(new_resident)
            plan.to_host.append(to_host)
            plan.host_slots.append(host_slots)
            plan.digests.append(box)
        return self._stored(reader, plan)

    @staticmethod
    def _stored(reader: SlotReader, plan: TokenPlan) -> PagePlan:
        """``plan`` with the blocks bound for the host as the storage stores them, where that is
        not their keys and values (a quantized format's bytes: a block comes back exactly)."""
        assert isinstance(plan, PagePlan)
        if reader.storage.stashes_decoded:
            return plan
        for layer, (to_host, slots) in enumerate(zip(plan.to_host, plan.host_slots, strict=True)):
            if to_host.indexes:
                plan.to_host[layer] = Stash(to_host.indexes, *reader.stored_blocks(layer, slots))
        return plan

    def apply(self, plan: TokenPlan, num_computed: int) -> None:
        assert isinstance(plan, PagePlan)
        bs = self.block_size
        for layer in range(len(self.layer_budgets)):
            box = self.boxes[layer] = plan.digests[layer]
            indexes, k_host, v_host = plan.to_host[layer]
            if k_host is not None and v_host is not None:
                self.host_store.put_many([self._key(layer, j) for j in indexes], k_host, v_host)
            self.resident[layer] = list(plan.resident[layer])
            where = torch.full((box.num_blocks,), HOST, dtype=torch.uint8)
            where[plan.resident[layer]] = RESIDENT
            self.where[layer] = where
            starts = torch.tensor(plan.resident[layer], device=self.device)[:, None] * bs
            kept = (starts + torch.arange(bs, device=self.device)).flatten()
            tail_start = num_computed - (plan.num_slots - kept.shape[0])
            self._grow(plan.num_slots)
            self.pos[layer][:, :plan.num_slots] = torch.cat([kept, torch.arange(tail_start, num_computed,
                                                                                 device=self.device)])
            self.valid[layer][:] = False
            self.valid[layer][:plan.num_slots] = True
        self.num_evicted = num_computed - plan.num_slots
        self.num_recorded = plan.num_slots
        self.num_compactions += 1
        self._num_evicted_seen = 0      # ``where`` is new: mark every eviction (the stashes above may add some)
        self._mark_lost()

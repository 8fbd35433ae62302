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
and the top R are made resident: a host block entering the top set swaps
places with a device block leaving it (device -> host, host -> device), then
attention runs over the resident blocks plus the open tail. The first block (the
attention sinks) and the most recent full block are always resident. Blocks are ranked per
query head relative to that head's best block, then by their best head, so a block
that one head needs is kept even if the other heads ignore it.

Layout of a request's slots (per layer, all heads alike):

    slot-block   0 .. R-1                       R ...
                 | resident full blocks (any order) | tail: tokens after the last full block |

Compaction (when the tail fills a block, and once at the end of the prefill) keeps the
top R blocks for the last query seen, moves the rest to the host, and puts the tail
right after them; so positions ``>= num_evicted + R * block_size`` map to slots linearly.

Host blocks live in the engine's ``HostBlockStore`` (host_store.py), bounded in bytes.
A block the store evicted for room cannot come back: it ranks below every other block.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvserve.kv.budget.host_store import HostBlock, HostBlockStore, StashKey
from kvserve.kv.budget.policies import ArkVale, BudgetPolicy
from kvserve.kv.budget.state import BudgetState, TokenPlan

if TYPE_CHECKING:
    from kvserve.kv.storage import KVStorage


def rank_blocks(q: torch.Tensor | None, dmin: torch.Tensor, dmax: torch.Tensor,
                bound_weight: float = 1.0) -> torch.Tensor:
    """Rank key of every full block: its score for ``q`` (recency without a query), with the
    first block (the attention sinks) and the most recent full block always on top."""
    num_blocks = dmin.shape[0]
    rank = torch.arange(num_blocks, dtype=torch.float32) if q is None else block_scores(q, dmin, dmax, bound_weight)
    return keep_ends_on_top(rank)


def keep_ends_on_top(rank: torch.Tensor) -> torch.Tensor:
    """``rank`` (one key per full block) with the first block (the attention sinks) and the most
    recent full block above every other."""
    rank[0] = rank[rank.shape[0] - 1] = float("inf")
    return rank


class DigestBox:
    """A layer's digests as the centre and half width of each block's key box, laid out for
    two batched products per query: [kv_heads, blocks, dim] each (built once per compaction)."""

    def __init__(self, dmin: torch.Tensor, dmax: torch.Tensor) -> None:
        lo, hi = dmin.float().transpose(0, 1), dmax.float().transpose(0, 1)
        self.source = dmin
        self.centre = ((hi + lo) / 2).contiguous()
        self.half_width = ((hi - lo) / 2).contiguous()

    def scores(self, q: torch.Tensor, bound_weight: float) -> torch.Tensor:
        """``block_scores`` of ``q`` [heads, dim] -> [blocks], without the [blocks, heads, dim]
        intermediates: per KV head, [blocks, dim] x [dim, group]."""
        kv_heads, num_blocks, dim = self.centre.shape
        qg = q.float().view(kv_heads, -1, dim).transpose(1, 2)            # [kv, dim, group]
        s = torch.bmm(self.centre, qg)                                     # [kv, blocks, group]
        if bound_weight:
            s = s + bound_weight * torch.bmm(self.half_width, qg.abs())
        s = s.transpose(0, 1).reshape(num_blocks, -1)                      # [blocks, heads]
        return (s - s.max(dim=0).values).max(dim=1).values


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


class PagePlan(TokenPlan):
    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.resident: list[list[int]] = []
        self.to_host: list[dict[int, HostBlock]] = []
        self.from_host: list[list[int]] = []
        self.digests: list[tuple[torch.Tensor, torch.Tensor]] = []   # per layer: min, max of every full block


class ArkValeState(BudgetState):
    """``owner``: the request id its blocks are stashed under in ``host_store``."""

    captures_queries = True

    def __init__(self, policy: BudgetPolicy, budget: int, layer_budgets: list[int], num_kv_heads: int,
                 block_size: int, device: torch.device, host_store: HostBlockStore, owner: str) -> None:
        super().__init__(policy, budget, layer_budgets, num_kv_heads, block_size, device)
        assert isinstance(policy, ArkVale)
        self.bound_weight = policy.bound_weight
        self.host_store = host_store
        self.owner = owner
        num_layers = len(layer_budgets)
        self.num_resident = budget // block_size
        self.resident: list[list[int]] = [[] for _ in range(num_layers)]
        self.dmin: list[torch.Tensor | None] = [None] * num_layers
        self.dmax: list[torch.Tensor | None] = [None] * num_layers
        self.last_q: list[torch.Tensor | None] = [None] * num_layers
        self._boxes: list[DigestBox | None] = [None] * num_layers       # the digests as ``select`` reads them
        self.recalls: list[tuple[int, int]] = []       # (layer, block) each time a host block came back
        self.host_device = torch.device("cpu")

    @property
    def host(self) -> list[dict[int, HostBlock]]:
        """Per layer, the stashed blocks by index (read from the store)."""
        return [self.host_store.blocks_of(self.owner, layer) for layer in range(len(self.layer_budgets))]

    @property
    def host_nbytes(self) -> int:
        return self.host_store.nbytes_of(self.owner)

    def num_digested(self, layer: int) -> int:
        d = self.dmin[layer]
        return 0 if d is None else d.shape[0]

    def capture_query(self, layer: int, q: torch.Tensor) -> None:
        """Keep the layer's latest query ([heads, dim]): the next compaction ranks blocks by it."""
        self.last_q[layer] = q.detach().clone()

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
        """Rank every full block by its digest score for ``q`` and swap host blocks of the
        top set with resident blocks outside it (``block_ids``: the request's table)."""
        resident = self.resident[layer]
        dmin, dmax = self.dmin[layer], self.dmax[layer]
        if dmin is None or dmax is None or dmin.shape[0] <= len(resident):
            return
        box = self._boxes[layer]
        if box is None or box.source is not dmin:
            box = self._boxes[layer] = DigestBox(dmin, dmax)
        rank = keep_ends_on_top(box.scores(q, self.bound_weight))
        top = self._demote_lost(layer, rank).topk(len(resident)).indices.tolist()
        wanted = set(top)
        on_device = set(resident)
        missing = [j for j in top if j not in on_device and self.host_store.contains(self._key(layer, j))]
        if not missing:
            return
        spare = [i for i, j in enumerate(resident) if j not in wanted]
        # all taken before any outgoing block is stashed, which may evict the oldest blocks
        recalled = [(j, i, self.host_store.take(self._key(layer, j))) for j, i in zip(missing, spare)]
        slots = torch.tensor([block_ids[i] for _, i, _ in recalled], dtype=torch.long, device=storage.device)
        incoming_k = torch.stack([k for _, _, (k, _) in recalled]).to(storage.device)
        incoming_v = torch.stack([v for _, _, (_, v) in recalled]).to(storage.device)
        out_k, out_v = storage.swap_blocks(layer, slots, incoming_k, incoming_v)
        out_k, out_v = out_k.to(self.host_device), out_v.to(self.host_device)
        for n, (j_new, i, _) in enumerate(recalled):
            # each block its own storage: a view would keep the whole batch alive past its bytes' count
            self.host_store.put(self._key(layer, resident[i]), (out_k[n].clone(), out_v[n].clone()))
            resident[i] = j_new
            self.recalls.append((layer, j_new))

    def _key(self, layer: int, index: int) -> StashKey:
        return StashKey(self.owner, layer, index)

    def _rank(self, layer: int, q: torch.Tensor | None, dmin: torch.Tensor, dmax: torch.Tensor) -> torch.Tensor:
        """``rank_blocks``, with the blocks the host store evicted for room at the bottom."""
        return self._demote_lost(layer, rank_blocks(q, dmin, dmax, self.bound_weight))

    def _demote_lost(self, layer: int, rank: torch.Tensor) -> torch.Tensor:
        """``rank`` with the blocks the host store evicted for room at the bottom."""
        if self.host_store.num_evicted_of(self.owner):
            resident = set(self.resident[layer])
            # blocks the last compaction digested are resident or stashed, unless evicted
            lost = [j for j in range(self.num_digested(layer))
                    if j not in resident and not self.host_store.contains(self._key(layer, j))]
            if lost:
                rank[lost] = float("-inf")
        return rank

    # -- compaction ----------------------------------------------------------
    def plan(self, keys: list[torch.Tensor], values: list[torch.Tensor], num_slots: int) -> PagePlan:
        bs = self.block_size
        num_tokens = self.num_evicted + num_slots
        num_full = num_tokens // bs
        tail_slot = num_full * bs - self.num_evicted
        plan = PagePlan(self.num_resident * bs + num_slots - tail_slot)
        for layer, (k, v) in enumerate(zip(keys, values)):
            resident = self.resident[layer]
            first_recent = self.num_digested(layer)

            slot_of = {j: i for i, j in enumerate(resident)}

            def block(j: int, layer: int = layer, k: torch.Tensor = k, v: torch.Tensor = v,
                      slot_of: dict[int, int] = slot_of, first_recent: int = first_recent) -> HostBlock:
                if j in slot_of:        # resident
                    s = slot_of[j] * bs
                elif j >= first_recent:  # filled since the last compaction
                    s = j * bs - self.num_evicted
                else:                   # in host memory
                    hk, hv = self.host_store.peek(self._key(layer, j))
                    return hk.to(k.device), hv.to(v.device)
                return k[s:s + bs], v[s:s + bs]

            new_blocks = [block(j) for j in range(first_recent, num_full)]
            dmin = torch.stack([b[0].amin(dim=0) for b in new_blocks])
            dmax = torch.stack([b[0].amax(dim=0) for b in new_blocks])
            old_min, old_max = self.dmin[layer], self.dmax[layer]
            all_min = dmin if old_min is None else torch.cat([old_min, dmin])
            all_max = dmax if old_max is None else torch.cat([old_max, dmax])
            rank = self._rank(layer, self.last_q[layer], all_min, all_max)
            keep = sorted(rank.topk(self.num_resident).indices.tolist())
            kept = set(keep)
            on_device = set(resident) | set(range(first_recent, num_full))
            to_host: dict[int, HostBlock] = {}
            for j in sorted(on_device - kept):
                hk, hv = block(j)
                to_host[j] = (hk.to(self.host_device, copy=True), hv.to(self.host_device, copy=True))
            parts = [block(j) for j in keep]
            plan.keys.append(torch.cat([p[0] for p in parts] + [k[tail_slot:num_slots]]))
            plan.values.append(torch.cat([p[1] for p in parts] + [v[tail_slot:num_slots]]))
            plan.resident.append(keep)
            plan.to_host.append(to_host)
            plan.from_host.append([j for j in keep if j not in on_device])
            plan.digests.append((all_min, all_max))
        return plan

    def apply(self, plan: TokenPlan, num_computed: int) -> None:
        assert isinstance(plan, PagePlan)
        bs = self.block_size
        # recalled blocks leave the store before any new one arrives (which may evict the oldest)
        for layer, recalled in enumerate(plan.from_host):
            for j in recalled:
                self.host_store.remove(self._key(layer, j))
        for layer in range(len(self.layer_budgets)):
            self.dmin[layer], self.dmax[layer] = plan.digests[layer]
            for j, stashed in plan.to_host[layer].items():
                self.host_store.put(self._key(layer, j), stashed)
            self.resident[layer] = list(plan.resident[layer])
            positions = [j * bs + o for j in plan.resident[layer] for o in range(bs)]
            tail_start = num_computed - (plan.num_slots - len(positions))
            positions += list(range(tail_start, num_computed))
            self._grow(plan.num_slots)
            self.pos[layer][:, :plan.num_slots] = torch.tensor(positions, device=self.device)
            self.valid[layer][:] = False
            self.valid[layer][:plan.num_slots] = True
        self.num_evicted = num_computed - plan.num_slots
        self.num_recorded = plan.num_slots
        self.num_compactions += 1

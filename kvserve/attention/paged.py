"""Attention over the paged KV cache: the step's metadata, the dispatch to the engine's
backend (backends.py), and the portable torch path.

With a backend that reads in place (cpu, triton), every decode and every prefill chunk
over cached context is one ``PagedChunks``: a single kernel call per layer over ragged
sequences, each block read in its stored format. The torch path below is the reference
and the fallback.

A step's tokens are flattened into one batch: each request contributes a run of
consecutive tokens. Requests with a single new token (decodes) are attended in
one padded call; each prefill chunk gets its own call, causal within the chunk
and open to the request's earlier tokens already in the cache. A blend's chunk
(``kvserve.request.BlendRows``) contributes its computed rows, positions with gaps: each
attends up to its own position (``PagedBatch.query_positions``), and the step also writes
the keys and values of the positions between them, given (``SuppliedKV``).

    flat tokens  | p0 p0 p0 p0 | d1 | p2 p2 | d3 |
    decode group: token_idx = [4, 7], block_table [2, max_blocks], mask [2, 1, 1, max_blocks * block_size]
    prefills    : (start 0, end 4), (start 5, end 7)

A request under a KV budget (kv/budget/) takes the common path, in place where the backend
reads in place, as long as every layer holds an entry in every slot it reads: before its first
compaction (slot = position), and after it where the policy keeps the same number of entries
in every layer (``BudgetState.is_dense``: all but pyramid; the slots are then a plain
sequence, the kept entries first, RoPE already applied). Pyramid's smaller layers leave a hole
of whole blocks between their kept entries and the tokens since (``BudgetState.block_holes``):
a backend reading in place gets, for each such layer, a block table without those blocks
(``PagedChunks.layer_batches``), and the weights it scores are put back at their slots. The
budgeted chunk then only *observes*: it adds the attention weights its policy scores by. A
compacted request whose holes are not whole blocks, or on the torch backend with holes, is
attended on its own (``BudgetedChunk.attended_here``), each layer masking the slots it does
not hold. In each layer the states' ``before_attention`` hooks
run before any attention (ArkVale keeps the query and, in decode, brings back the blocks it
ranks highest, which the step's attention then reads).

Keys and values are read through the storage protocol (kv/storage/), whatever the format.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from kvserve.attention.backends import AttentionBackend, TorchBackend
from kvserve.kv.budget.state import BudgetState
from kvserve.kv.storage import KVStorage, Overlay, StepWrites
from kvserve.kv.storage.layout import AttentionScores, PagedBatch


@dataclass(frozen=True)
class DecodeGroup:
    token_idx: torch.Tensor   # [num_decodes] positions in the flat batch
    block_table: torch.Tensor  # [num_decodes, max_blocks] block ids, padded with block 0
    mask: torch.Tensor        # [num_decodes, 1, 1, max_blocks * block_size] True where a key is real
    is_whole_batch: bool      # every token of the step is a decode (skip the scatter)
    overlay: Overlay | None = None   # open blocks read from elsewhere (the storage's planner says)


@dataclass(frozen=True)
class PrefillChunk:
    start: int                # first position in the flat batch
    end: int                  # one past the last
    num_context_tokens: int   # tokens of this request before the chunk (in the cache)
    block_table: torch.Tensor | None  # [1, num_blocks] the request's blocks; None: attend to the new k, v
                                      # (only where the storage reads back exactly what was written)
    mask: torch.Tensor | None   # [num_new, num_blocks * block_size]; None: plain causal
    overlay: Overlay | None = None


@dataclass(frozen=True)
class BudgetedChunk:
    start: int                # flat batch range of the request's new tokens
    end: int
    slot_start: int           # cache slot of the first new token
    first_pos: int            # its sequence position
    block_ids: list[int]      # the request's blocks holding slots [0, slot_start + n)
    block_table: torch.Tensor  # the same, [1, num_blocks]
    state: BudgetState
    attended_here: bool       # attended here, masked (compacted with holes); else only observed
    observe_from: int         # first query position whose attention weights the policy scores
    is_compacted: bool = False  # its slots are no longer its positions
    scored_in_kernel: bool = False  # the backend adds its attention weights (``PagedChunks.scores``)
    # per layer, the slot blocks [first, end) the backend's table skips (its hole), when read in place
    holes: tuple[tuple[int, int], ...] | None = None
    scored_rows: tuple[int, ...] | None = None   # the rows the policy scores (probes); None: from first_scored_row
    overlay: Overlay | None = None   # its open block read from elsewhere, where the torch path reads it

    @property
    def num_slots(self) -> int:
        """The request's slots after this chunk's tokens."""
        return self.slot_start + self.end - self.start

    @property
    def first_scored_row(self) -> int:
        """The chunk's first query whose attention weights the policy scores (past its last: none)."""
        return max(0, self.observe_from - self.first_pos)


@dataclass(frozen=True)
class ScoredChunks:
    """Budgeted chunks among ``PagedChunks``' sequences whose attention weights the backend adds
    up as it attends (a backend with ``scores_attention``), for their policies' scores."""

    score_from: torch.Tensor                         # int32 [num_seqs]: first scored query row of each
    chunks: tuple[tuple[int, BudgetedChunk], ...]    # (sequence index in the batch, its chunk)


@dataclass(frozen=True)
class PagedChunks:
    """The step's tokens a backend attends in place: ``batch``'s queries are the rows
    ``token_idx`` of the flat batch, in order."""

    token_idx: torch.Tensor   # [num_tokens] positions in the flat batch
    batch: PagedBatch
    is_whole_batch: bool      # every token of the step is in here (skip the gather and scatter)
    scores: ScoredChunks | None = None
    # one batch per layer where some sequence's layer skips blocks (compacted with holes), else None
    layer_batches: tuple[PagedBatch, ...] | None = None
    # batches under a sliding window, made once per step (``batch_for``)
    _windowed: dict[tuple[int, int], PagedBatch] = field(default_factory=dict, compare=False, repr=False)

    def batch_for(self, layer: int, window: int | None = None) -> PagedBatch:
        """The layer's batch; under a sliding ``window``, the same sequences read through it."""
        batch = self.batch if self.layer_batches is None else self.layer_batches[layer]
        if window is None:
            return batch
        key = (id(batch), window)
        if key not in self._windowed:
            self._windowed[key] = replace(batch, window=window)
        return self._windowed[key]


@dataclass(frozen=True)
class SuppliedKV:
    """Keys and values the step writes without computing them: a blend's supplied positions
    (``kvserve.request.BlendRows``). The write plan takes the step's new keys in the order ``order``
    gives: each write's row in the computed rows followed by every part's supplied rows."""

    order: torch.Tensor       # [num_writes] int64
    # per blend chunk: its per-layer keys and values, and the rows [first, end) of them it writes
    parts: tuple[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], int, int], ...]

    def merge(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's keys and values to write, in the write plan's order."""
        ks = [k, *(keys[layer][first:end].to(k.dtype) for keys, _, first, end in self.parts)]
        vs = [v, *(values[layer][first:end].to(v.dtype) for _, values, first, end in self.parts)]
        return torch.cat(ks).index_select(0, self.order), torch.cat(vs).index_select(0, self.order)


TORCH = TorchBackend()


@dataclass(frozen=True)
class AttentionMetadata:
    write: StepWrites             # where the step's new keys and values go (the storage's own plan)
    decode: DecodeGroup | None
    prefills: tuple[PrefillChunk, ...]
    budgeted: tuple[BudgetedChunk, ...] = ()
    paged: PagedChunks | None = None      # read in place by ``backend`` (else decode/prefills above)
    backend: AttentionBackend = TORCH
    supplied: SuppliedKV | None = None    # keys and values written beside the computed ones
    # a model of several layer groups (kv/groups.py): each group's metadata (its tables, its write
    # plan) and each layer's group; None: one group, this metadata every layer's
    groups: tuple[AttentionMetadata, ...] | None = None
    group_of_layer: tuple[int, ...] = ()

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata ``layer`` attends and writes with (its group's)."""
        return self if self.groups is None else self.groups[self.group_of_layer[layer]]

    @property
    def one_kernel_batch(self) -> PagedBatch | None:
        """The batch, where every layer attends the whole step in one backend call and writes
        the computed keys and values alone: one group, nothing supplied, no budget, no scoring,
        no per-layer table (``paged_attention``'s first branch, taken by a caller's own loop)."""
        paged = self.paged
        if (paged is None or not paged.is_whole_batch or paged.scores is not None or paged.layer_batches is not None
                or self.groups is not None or self.supplied is not None or self.budgeted or self.decode is not None):
            return None
        return paged.batch

    @property
    def group_metas(self) -> tuple[AttentionMetadata, ...]:
        """Each group's metadata (with one group, this one)."""
        return (self,) if self.groups is None else self.groups

    @property
    def all_writes(self) -> tuple[StepWrites, ...]:
        """The step's write plans, one per group."""
        return tuple(m.write for m in self.group_metas)


def write_layer(k: torch.Tensor, v: torch.Tensor, layer: int, cache: KVStorage, meta: AttentionMetadata) -> None:
    """The step's writes of one layer: the new tokens' keys and values, a blend's supplied
    ones merged in position order (``SuppliedKV``)."""
    if meta.supplied is None:
        cache.write(layer, k, v, meta.write)
    else:
        cache.write(layer, *meta.supplied.merge(layer, k, v), meta.write)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    cache: KVStorage, meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, Hkv, D] for the step's new tokens. Returns [T, H, D]. ``window``:
    the layer's sliding window (each query sees its last ``window`` positions), None: full."""
    meta = meta.for_layer(layer)
    write_layer(k, v, layer, cache, meta)
    if window is not None and meta.budgeted:
        raise ValueError("KV budgets are not kept on sliding-window layers")
    for b in meta.budgeted:     # before any attention: a hook may bring blocks back
        b.state.before_attention(layer, q[b.start:b.end], cache, b.block_ids, b.is_compacted)
    num_kv_heads = k.shape[1]
    group = q.shape[1] // num_kv_heads
    d, paged = meta.decode, meta.paged
    if d is not None and d.is_whole_batch:
        return _decode(q, d, layer, cache, num_kv_heads, group, scale, window)
    if paged is not None and paged.is_whole_batch:
        return meta.backend.attend(q, *cache.half_stores(layer), paged.batch_for(layer, window), scale)
    out = torch.empty_like(q)
    if paged is not None:
        batch = paged.batch_for(layer, window)
        scores = None
        if paged.scores is not None:
            # as wide as the scored sequences' contexts (the kernel touches no other row)
            width = max(chunk.num_slots for _, chunk in paged.scores.chunks)
            scores = AttentionScores(torch.zeros(batch.block_tables.shape[0], num_kv_heads, width,
                                                 device=q.device), paged.scores.score_from)
        out[paged.token_idx] = meta.backend.attend(q[paged.token_idx].contiguous(), *cache.half_stores(layer),
                                                   batch, scale, scores=scores)
        if scores is not None and paged.scores is not None:
            for seq, chunk in paged.scores.chunks:
                _add_kernel_scores(chunk, layer, scores.weights[seq])
    for p in meta.prefills:
        qs = q[p.start:p.end].transpose(0, 1).unsqueeze(0)            # [1, H, n, D]
        if p.block_table is None:
            ks, vs = k[p.start:p.end], v[p.start:p.end]
            causal, mask = True, None
            if window is not None and p.end - p.start > window:
                n = p.end - p.start
                causal, mask = False, _window_mask(torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), window)
        else:
            ks, vs = cache.gather(layer, p.block_table, p.overlay)
            ks, vs = ks[0], vs[0]
            causal, mask = False, p.mask if window is None or p.mask is None else _window_mask(p.mask, window)
        ks = ks.to(q.dtype).transpose(0, 1).unsqueeze(0)               # [1, Hkv, L, D]
        vs = vs.to(q.dtype).transpose(0, 1).unsqueeze(0)
        o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal,
                                           scale=scale, enable_gqa=group > 1)
        out[p.start:p.end] = o[0].transpose(0, 1)
    if d is not None:
        out[d.token_idx] = _decode(q[d.token_idx], d, layer, cache, num_kv_heads, group, scale, window)
    for b in meta.budgeted:
        budgeted = _budgeted(q[b.start:b.end], b, layer, cache, num_kv_heads, group, scale)
        if budgeted is not None:
            out[b.start:b.end] = budgeted
    return out


def _add_kernel_scores(chunk: BudgetedChunk, layer: int, weights: torch.Tensor) -> None:
    """The weights the backend gave the chunk's keys ([heads, width], in the order of the layer's
    block table) added at the slots they belong to: past a hole, ``end - first`` blocks on."""
    first, end = (0, 0) if chunk.holes is None else chunk.holes[layer]
    if first == end:
        chunk.state.add_scores(layer, weights[:, :chunk.num_slots])
        return
    bs = chunk.state.block_size
    skipped = (end - first) * bs
    chunk.state.add_scores(layer, weights[:, :first * bs])
    chunk.state.add_scores(layer, weights[:, first * bs:chunk.num_slots - skipped], first_slot=end * bs)


def _window_mask(mask: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` [..., L], whose rows are True on a prefix (the keys up to each query), narrowed
    to the last ``window`` keys of each row."""
    ends = mask.sum(dim=-1, keepdim=True)       # each query's position + 1
    return mask & (torch.arange(mask.shape[-1], device=mask.device) >= ends - window)


def _decode(q: torch.Tensor, d: DecodeGroup, layer: int, cache: KVStorage,
            num_kv_heads: int, group: int, scale: float, window: int | None = None) -> torch.Tensor:
    # The `group` query heads sharing a KV head act as `group` query rows of one
    # head, so GQA needs no copy of K and V: [B, Hkv, group, D] x [B, Hkv, L, D].
    num = q.shape[0]
    qd = q.view(num, num_kv_heads, group, q.shape[2])
    kd, vd = cache.gather(layer, d.block_table, d.overlay)   # [B, L, Hkv, D]
    kd = kd.to(q.dtype).transpose(1, 2)
    vd = vd.to(q.dtype).transpose(1, 2)
    mask = d.mask if window is None else _window_mask(d.mask, window)
    o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
    return o.reshape(num, -1, q.shape[2])


def _budgeted(q: torch.Tensor, b: BudgetedChunk, layer: int, cache: KVStorage,
              num_kv_heads: int, group: int, scale: float) -> torch.Tensor | None:
    """Observe (and, when it has holes, attend) one budgeted request's chunk: q [n, H, D]."""
    st = b.state
    if st.scores_attention and not b.scored_in_kernel:
        _score(q, b, layer, cache, num_kv_heads, group, scale)
    if not b.attended_here:
        return None
    num_slots = b.num_slots
    ks, vs = cache.gather(layer, b.block_table, b.overlay)
    kh = ks[0, :num_slots].to(q.dtype).transpose(0, 1)           # [Hkv, S, D]
    vh = vs[0, :num_slots].to(q.dtype).transpose(0, 1)
    mask = _slot_mask(st, layer, range(b.slot_start, num_slots), num_slots, masks_keys=True)
    o = F.scaled_dot_product_attention(q.transpose(0, 1).unsqueeze(0), kh.unsqueeze(0), vh.unsqueeze(0),
                                       attn_mask=mask, scale=scale, enable_gqa=group > 1)
    return o[0].transpose(0, 1)


def _score(q: torch.Tensor, b: BudgetedChunk, layer: int, cache: KVStorage,
           num_kv_heads: int, group: int, scale: float) -> None:
    """Add the attention weights the chunk's scored queries give each slot to the policy's
    scores: the keys alone are read, only the slots held, and no mask is built where none
    applies (one query over a layer that holds every slot)."""
    n, _, dim = q.shape
    rows = range(b.first_scored_row, n) if b.scored_rows is None else b.scored_rows
    if not rows:
        return
    keys = cache.gather_keys(layer, b.block_table, b.overlay)[0, :b.num_slots]        # [S, Hkv, D]
    qs = q[rows.start:] if isinstance(rows, range) else q[torch.tensor(rows, dtype=torch.long, device=q.device)]
    qo = qs.transpose(0, 1).reshape(num_kv_heads, group, len(rows), dim).float()
    logits = torch.einsum("hgnd,shd->hgns", qo, keys.float()) * scale
    slots = (range(b.slot_start + rows.start, b.num_slots) if isinstance(rows, range)
             else tuple(b.slot_start + r for r in rows))
    mask = _slot_mask(b.state, layer, slots, b.num_slots, masks_keys=b.is_compacted and not b.state.is_dense)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    b.state.add_scores(layer, logits.softmax(dim=-1).sum(dim=(1, 2)))


def _slot_mask(st: BudgetState, layer: int, slots: range | tuple[int, ...], num_slots: int,
               masks_keys: bool) -> torch.Tensor | None:
    """[len(slots), num_slots] True where the query at each of ``slots`` sees a slot: up to its
    own, and (``masks_keys``) only the slots the layer holds; None when the queries see every
    slot (one query at the last slot, nothing masked)."""
    valid = st.key_mask(layer, num_slots) if masks_keys else None
    if len(slots) == 1 and slots[0] == num_slots - 1 and (valid is None or bool(valid.all())):
        return None
    device = st.device
    at = (torch.arange(slots.start, slots.stop, device=device) if isinstance(slots, range)
          else torch.tensor(slots, dtype=torch.long, device=device))
    causal = torch.arange(num_slots, device=device)[None, :] <= at[:, None]
    return causal if valid is None else causal & valid[None, :]

"""One forward pass's batch over the paged KV cache: input ids, positions, where new keys and
values go, and the attention metadata (attention/paged.py) that says how each token attends.

Built fresh for every pass and handed to the model with the call: by the model runner for a
scheduled step (engine/model_runner.py), and by drafting models for their passes
(spec/drafters.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.attention.backends import AttentionBackend
from kvserve.attention.paged import (
    AttentionMetadata,
    BudgetedChunk,
    DecodeGroup,
    PagedChunks,
    PrefillChunk,
    ScoredChunks,
    SuppliedKV,
)
from kvserve.kv.budget.budgets import Budgets, BudgetStep
from kvserve.kv.storage import KVStorage
from kvserve.kv.storage.layout import PagedBatch
from kvserve.request import Request

KERNEL_SCORED_ROWS = 8    # chunks of at most this many queries are scored by the backend (decodes)


class BatchBuilder:
    """Accumulates one forward pass's batch, chunk by chunk (CPU lists, then tensors): the
    tokens, their positions, where their keys and values go and how each attends. Where the
    new keys and values go, and how open blocks are read, is the storage's plan."""

    def __init__(self, cache: KVStorage, backend: AttentionBackend, device: torch.device) -> None:
        self.cache, self.backend, self.device = cache, backend, device
        self.block_size = cache.block_size
        self.writes = cache.planner()
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.decode_idx: list[int] = []
        self.decode_tables: list[list[int]] = []
        self.decode_lens: list[int] = []
        self.prefills: list[PrefillChunk] = []
        self.budgeted: list[BudgetedChunk] = []
        # budgeted chunks the backend scores: (their index in ``paged``, chunk)
        self.scored: list[tuple[int, BudgetedChunk]] = []
        # sequences a backend reads in place: (flat start, new tokens, context length, block ids)
        self.paged: list[tuple[int, int, int, list[int]]] = []
        # those whose layers skip blocks: (their index in ``paged``, per layer the blocks skipped)
        self.holed: list[tuple[int, tuple[tuple[int, int], ...]]] = []
        # each write's source, in the planner's order: a flat row, or -1 - i for supplied row i
        self.write_rows: list[int] = []
        self.supplied: list[tuple[Sequence[torch.Tensor], Sequence[torch.Tensor], int, int]] = []
        self.num_supplied = 0
        # sequences in ``paged`` whose queries are not consecutive: index -> their positions
        self.paged_positions: dict[int, tuple[int, ...]] = {}

    def add(self, req: Request, n: int, block_ids: list[int], budgets: Budgets, draft: tuple[int, ...] = ()) -> None:
        """``n`` new tokens of ``req`` from its first not computed, the last ``len(draft)`` of
        them drafted: they take the next positions and slots like known tokens."""
        start = req.num_computed_tokens
        tokens = [*req.all_token_ids[start:start + n - len(draft)], *draft]
        step = budgets.begin_step(req, n)
        if step is None:
            self.add_tokens(block_ids, start, tokens, len(draft))
            return
        flat_start = self._take(start, tokens)
        self.writes.add(block_ids, step.slot_start, n, len(draft))
        # a compacted request whose every layer holds an entry in every slot is a plain sequence
        # of slots: attended like any other (in place, by the backend); one whose layers' holes
        # are whole blocks too, where the backend reads in place (each layer's table skips its
        # hole); else on its own, masked
        holes = None
        if step.is_compacted and not step.state.is_dense and self.backend.reads_in_place:
            holes = step.state.block_holes
        in_place = not step.is_compacted or step.state.is_dense or holes is not None
        first_scored = max(0, step.observe_from - start)
        # a backend that scores adds the weights the policy needs as it attends (short chunks:
        # their logits are kept until the softmax is known)
        in_kernel = (in_place and self.backend.reads_in_place and self.backend.scores_attention and step.is_observed
                     and self.cache.dtype in self.backend.scored_dtypes
                     and step.state.scores_attention and first_scored < n <= KERNEL_SCORED_ROWS
                     # the kernel scores a suffix of the chunk's rows
                     and (step.scored_rows is None or step.scored_rows == tuple(range(first_scored, n))))
        chunk = self._add_budgeted(step, flat_start, start, n, block_ids, attended_here=not in_place,
                                   scored_in_kernel=in_kernel, holes=holes)
        if in_place:
            self._attend(flat_start, step.slot_start, n, block_ids)
            if holes is not None:
                self.holed.append((len(self.paged) - 1, holes))
        if in_kernel:
            assert chunk is not None
            self.scored.append((len(self.paged) - 1, chunk))

    def add_tokens(self, block_ids: list[int], start: int, tokens: Sequence[int], num_drafted: int = 0) -> None:
        """``tokens`` at positions ``start, ...`` of the sequence held in ``block_ids`` (the last
        ``num_drafted`` of them drafted), written to their slots there, each attending to the
        positions before it and itself."""
        flat_start = self._take(start, tokens)
        self.writes.add(block_ids, start, len(tokens), num_drafted)
        self._attend(flat_start, start, len(tokens), block_ids)

    def add_blend(self, req: Request, n: int, block_ids: list[int]) -> None:
        """The next ``n`` positions of a request whose blend the steps compute
        (``req.blend_rows``: ``kvserve.request.BlendRows``): its computed rows among them are the
        chunk's tokens, each attending to every position before it and itself; all ``n`` are
        written, the supplied ones with their given keys and values."""
        rows = req.blend_rows
        if rows is None:
            raise ValueError(f"request {req.request_id} has no blend rows")
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        computed = rows.computed_in(start, end)
        if computed and computed[-1] != end - 1:
            raise ValueError(f"a blend's chunk with computed rows ends at one: [{start}, {end}) does not")
        first, last = rows.supplied_in(start, end)
        flat_start = len(self.input_ids)
        self.input_ids.extend(req.all_token_ids[p] for p in computed)
        self.positions.extend(computed)
        self.writes.add(block_ids, start, n)
        at = 0
        for pos in range(start, end):
            if at < len(computed) and computed[at] == pos:
                self.write_rows.append(flat_start + at)
                at += 1
            else:
                self.write_rows.append(-1 - self.num_supplied - (pos - start - at))
        self.supplied.append((rows.keys, rows.values, first, last))
        self.num_supplied += last - first
        if not computed:
            return      # supplied positions only: written, nothing attends
        # one query sequence: each row sees the keys up to its own position (``query_positions``)
        bs, dev = self.block_size, self.device
        num_blocks = -(-end // bs)
        if self.backend.reads_in_place:
            self.paged.append((flat_start, len(computed), end, block_ids[:num_blocks]))
            self.paged_positions[len(self.paged) - 1] = computed
            return
        query_pos = torch.tensor(computed, dtype=torch.long, device=dev)
        mask = torch.arange(num_blocks * bs, device=dev)[None, :] <= query_pos[:, None]
        table = torch.tensor([block_ids[:num_blocks]], dtype=torch.long, device=dev)
        overlay = self.writes.overlay([(num_blocks - 1, block_ids[num_blocks - 1])])
        self.prefills.append(PrefillChunk(flat_start, flat_start + len(computed), start, table, mask, overlay))

    def _take(self, start: int, tokens: Sequence[int]) -> int:
        flat_start = len(self.input_ids)
        self.input_ids.extend(tokens)
        self.positions.extend(range(start, start + len(tokens)))
        self.write_rows.extend(range(flat_start, flat_start + len(tokens)))
        return flat_start

    def _attend(self, flat_start: int, start: int, n: int, block_ids: list[int]) -> None:
        bs, end = self.block_size, start + n
        num_blocks = -(-end // bs)
        fresh = start == 0 and self.cache.reads_as_written     # attends to its own new keys and values
        # a backend that reads in place takes first chunks too: every query is then attended
        # by one kernel whose result depends on nothing but its own context (batch-invariant)
        if self.backend.reads_in_place:
            self.paged.append((flat_start, n, end, block_ids[:num_blocks]))
        elif n == 1:
            self.decode_idx.append(flat_start)
            self.decode_tables.append(block_ids[:num_blocks])
            self.decode_lens.append(end)
        elif fresh:
            self.prefills.append(PrefillChunk(flat_start, flat_start + n, 0, None, None))
        else:
            dev = self.device
            table = torch.tensor([block_ids[:num_blocks]], dtype=torch.long, device=dev)
            key_pos = torch.arange(num_blocks * bs, device=dev)
            query_pos = torch.arange(start, end, device=dev)
            mask = key_pos[None, :] <= query_pos[:, None]
            overlay = self.writes.overlay([(num_blocks - 1, block_ids[num_blocks - 1])])
            self.prefills.append(PrefillChunk(flat_start, flat_start + n, start, table, mask, overlay))

    def _add_budgeted(self, step: BudgetStep, flat_start: int, start: int, n: int, block_ids: list[int],
                      attended_here: bool, scored_in_kernel: bool,
                      holes: tuple[tuple[int, int], ...] | None) -> BudgetedChunk | None:
        if not step.is_observed:
            return None
        ids = block_ids[:-(-(step.slot_start + n) // self.block_size)]
        # its open block's rows, where the torch path reads its keys (to score or attend it)
        reads = attended_here or (step.state.scores_attention and not scored_in_kernel)
        chunk = BudgetedChunk(
            flat_start, flat_start + n, step.slot_start, start, ids,
            torch.tensor([ids], dtype=torch.long, device=self.device), step.state, attended_here,
            step.observe_from, step.is_compacted, scored_in_kernel, holes, step.scored_rows,
            self.writes.overlay([(len(ids) - 1, ids[-1])]) if reads else None)
        self.budgeted.append(chunk)
        return chunk

    def build(self) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev = self.device
        decode = self._decode_group() if self.decode_idx else None
        paged = self._paged_chunks() if self.paged else None
        supplied = None
        if self.supplied:
            num = len(self.input_ids)
            order = [r if r >= 0 else num - 1 - r for r in self.write_rows]
            supplied = SuppliedKV(torch.tensor(order, dtype=torch.long, device=dev), tuple(self.supplied))
        meta = AttentionMetadata(write=self.writes.build(), decode=decode, prefills=tuple(self.prefills),
                                 budgeted=tuple(self.budgeted), paged=paged, backend=self.backend,
                                 supplied=supplied)
        ids = torch.tensor(self.input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(self.positions, dtype=torch.long, device=dev)
        return ids, pos, meta

    def _paged_chunks(self) -> PagedChunks:
        dev = self.device
        max_blocks = max(len(ids) for _, _, _, ids in self.paged)
        tables = [ids + [ids[-1]] * (max_blocks - len(ids)) for _, _, _, ids in self.paged]
        starts = [0]
        for _, n, _, _ in self.paged:
            starts.append(starts[-1] + n)
        token_idx = [i for flat, n, _, _ in self.paged for i in range(flat, flat + n)]

        def int32(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=dev)

        positions = None
        if self.paged_positions:
            positions = int32([p for k, (_, n, end, _) in enumerate(self.paged)
                               for p in self.paged_positions.get(k, range(end - n, end))])
        batch = PagedBatch(
            block_tables=int32(tables), context_lens=int32([end for _, _, end, _ in self.paged]),
            query_starts=int32(starts), open_rows=int32(self.writes.open_rows([ids[-1] for *_, ids in self.paged])),
            block_size=self.block_size, max_query_len=max(n for _, n, _, _ in self.paged),
            max_context_len=max(end for _, _, end, _ in self.paged), query_positions=positions)
        scores = None
        if self.scored:
            score_from = [n for _, n, _, _ in self.paged]           # past the last query: none scored
            for k, chunk in self.scored:
                score_from[k] = chunk.first_scored_row
            scores = ScoredChunks(int32(score_from), tuple(self.scored))
        return PagedChunks(torch.tensor(token_idx, dtype=torch.long, device=dev), batch,
                           is_whole_batch=len(token_idx) == len(self.input_ids) and not self.budgeted,
                           scores=scores, layer_batches=self._layer_batches(batch, tables) if self.holed else None)

    def _layer_batches(self, batch: PagedBatch, tables: list[list[int]]) -> tuple[PagedBatch, ...]:
        """``batch`` for each layer, with the rows of the sequences that skip blocks in that layer
        (``holed``) shortened by those blocks; layers skipping the same blocks share one batch."""
        bs, dev = self.block_size, self.device
        lens = batch.context_lens.tolist()
        made: dict[tuple[tuple[int, int], ...], PagedBatch] = {}
        out = []
        for layer in range(self.cache.num_layers):
            key = tuple(holes[layer] for _, holes in self.holed)
            layer_batch = made.get(key)
            if layer_batch is None:
                if all(first == end for first, end in key):
                    layer_batch = batch
                else:
                    rows, row_lens = list(tables), list(lens)
                    for (seq, _), (first, end) in zip(self.holed, key):
                        row = tables[seq][:first] + tables[seq][end:]
                        rows[seq] = row + [row[-1]] * (end - first)        # padding: never read
                        row_lens[seq] -= (end - first) * bs
                    layer_batch = PagedBatch(
                        block_tables=torch.tensor(rows, dtype=torch.int32, device=dev),
                        context_lens=torch.tensor(row_lens, dtype=torch.int32, device=dev),
                        query_starts=batch.query_starts, open_rows=batch.open_rows, block_size=bs,
                        max_query_len=batch.max_query_len, max_context_len=batch.max_context_len,
                        query_positions=batch.query_positions)
                made[key] = layer_batch
            out.append(layer_batch)
        return tuple(out)

    def _decode_group(self) -> DecodeGroup:
        bs, dev = self.block_size, self.device
        max_blocks = max(len(t) for t in self.decode_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in self.decode_tables]
        lengths = torch.tensor(self.decode_lens, device=dev)
        mask = torch.arange(max_blocks * bs, device=dev)[None, :] < lengths[:, None]
        overlay = self.writes.overlay([(i * max_blocks + len(t) - 1, t[-1]) for i, t in enumerate(self.decode_tables)])
        return DecodeGroup(
            token_idx=torch.tensor(self.decode_idx, dtype=torch.long, device=dev),
            block_table=torch.tensor(padded, dtype=torch.long, device=dev), mask=mask[:, None, None, :],
            is_whole_batch=len(self.decode_idx) == len(self.input_ids) and not self.budgeted,
            overlay=overlay)

"""Decode steps replayed from CUDA graphs: a step of small kernels launched from Python costs
its launches, not its bytes (a 135M model's step is ~30 layers x ~15 kernels), so a graph of
the whole forward pass, captured once per batch-size bucket, is launched as one.

A graph replays fixed addresses with fixed shapes. Each bucket of ``size`` rows owns its
forward pass over static buffers (slices of one set, sized for the largest bucket):

    ids, positions          [size]                 the step's tokens
    slots                   [size]                 where their keys go     } one set per layer group
    block_tables            [size, max_blocks]     max_blocks = the blocks } (Gemma 3: the full
    context_lens, open_rows [size]                   of max_model_len      } layers', each window's)
    query_starts            [size + 1] = 0, 1, ..., size

A step fits when every row is one decode token read in place (no draft, no budget observing,
no blend) and its writes are slots alone (a storage that keeps open blocks in
residual rows encodes whole blocks some steps and not others: those steps, and every other that
does not fit, run eagerly). The step's batch is built as any other (``BatchBuilder``), then
copied into the bucket's buffers; its ``n`` rows are the first, and the bucket's other rows
are padding that reads and writes only the engine's reserved block (``reserve_block``):

    row      0 .. n-1: the step's           n .. size-1: token 0 at position 0,
    table    its blocks, then the reserved  context 1, every entry the reserved block,
             block up to max_blocks         its key and value written at that block's slot 0

The grid of a kernel is part of the graph: the bucket's batch says ``max_context_len`` =
max_blocks x block_size (the engine gives the blocks of ``GRAPH_MAX_CONTEXT`` tokens, or of
max_model_len if fewer), so the split count covers any context up to it; a split past a
sequence's end reads nothing, and a step with a longer context runs eagerly. Each bucket attends through its own backend instance, so the scratch its kernels
were captured with (split partials, tickets) is its own and never reallocated by another call.

Without ``capture`` (CPU, where no graph exists) the same buffers and padding run eagerly: what
tests check on CPU; the capture itself needs a CUDA device (tests/engine/test_decode_graphs.py
compares replay with the eager step there).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvserve.attention.backends import AttentionBackend
from kvserve.attention.paged import AttentionMetadata, PagedChunks
from kvserve.kv.storage import KVStorage
from kvserve.kv.storage.base import StepWrites
from kvserve.kv.storage.layout import PagedBatch
from kvserve.model.decoder import Decoder

WARMUP_PASSES = 2       # eager passes before a capture: kernels compiled, scratch sized
# The longest context a captured step reads (vLLM's max_seq_len_to_capture): its kernels' grids are
# cut for it (on an H100, 32 splits of 256 keys at batch 1 rather than 128 for a 32k window, each
# merged at every step); a step over a longer context runs eagerly
GRAPH_MAX_CONTEXT = 8192
log = logging.getLogger(__name__)


def graph_batch_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """The buckets for up to ``max_num_seqs`` decoding rows: powers of two, then the limit
    itself (a step pads to the smallest bucket that holds it)."""
    sizes = [1]
    while sizes[-1] * 2 < max_num_seqs:
        sizes.append(sizes[-1] * 2)
    if sizes[-1] < max_num_seqs:
        sizes.append(max_num_seqs)
    return tuple(sizes)


def unfit_reason(device: torch.device, backend: AttentionBackend, storage: KVStorage) -> str | None:
    """Why decode steps of an engine so built could never be captured (None: they can)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, the engine is on {device}"
    if not backend.reads_in_place:
        return f"the {backend.name} attention backend builds each decode step's shapes on the host; use triton"
    if storage.residual.num_rows:
        return ("this KV format keeps open blocks in residual rows and encodes a block when one fills: a step's "
                "writes change shape, so no decode step could replay a graph")
    return None


class StepGraphs:
    """What the model runner asks of decode graphs (``DecodeGraphs``); this null object has none."""

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """A built step's hidden states [n, hidden] through a graph, or None: run it eagerly."""
        return None


@dataclass
class _Bucket:
    size: int
    meta: AttentionMetadata
    hidden: torch.Tensor | None = None      # the captured pass's output (its static address)
    graph: Any = None                       # torch.cuda.CUDAGraph once captured


@dataclass
class GraphStats:
    replayed_steps: int = 0      # steps run through a bucket (replayed, or its buffers run eagerly)
    eager_steps: int = 0         # steps that did not fit
    captured_buckets: int = 0


class _GroupBuffers:
    """One layer group's static rows: where its keys go, its block tables, lengths and open rows
    (groups hold different blocks; the tokens and positions are the same in every group)."""

    def __init__(self, size: int, max_blocks: int, reserved_block: int, block_size: int,
                 device: torch.device) -> None:
        self.reserved_block, self.reserved_slot = reserved_block, reserved_block * block_size
        self.slots = torch.full((size,), self.reserved_slot, dtype=torch.long, device=device)
        self.tables = torch.full((size, max_blocks), reserved_block, dtype=torch.int32, device=device)
        self.lens = torch.ones(size, dtype=torch.int32, device=device)
        self.open_rows = torch.full((size,), -1, dtype=torch.int32, device=device)

    def fill(self, n: int, slots: torch.Tensor, batch: PagedBatch) -> None:
        nb = batch.block_tables.shape[1]
        self.slots[:n].copy_(slots)
        self.tables[:n, :nb].copy_(batch.block_tables)
        self.tables[:n, nb:].fill_(self.reserved_block)
        self.lens[:n].copy_(batch.context_lens)
        self.open_rows[:n].copy_(batch.open_rows)

    def pad(self, n: int, size: int) -> None:
        self.slots[n:size].fill_(self.reserved_slot)
        self.tables[n:size].fill_(self.reserved_block)
        self.lens[n:size].fill_(1)
        self.open_rows[n:size].fill_(-1)

    def meta(self, b: int, starts: torch.Tensor, block_size: int, backend: AttentionBackend) -> AttentionMetadata:
        """Bucket ``b``'s metadata over these rows."""
        dev = self.slots.device
        batch = PagedBatch(block_tables=self.tables[:b], context_lens=self.lens[:b], query_starts=starts[:b + 1],
                           open_rows=self.open_rows[:b], block_size=block_size, max_query_len=1,
                           max_context_len=self.tables.shape[1] * block_size)
        paged = PagedChunks(torch.arange(b, dtype=torch.long, device=dev), batch, is_whole_batch=True)
        none = torch.empty(0, dtype=torch.long, device=dev)
        return AttentionMetadata(write=StepWrites(self.slots[:b], none, none), decode=None, prefills=(),
                                 paged=paged, backend=backend)


class DecodeGraphs(StepGraphs):
    """The buckets of one engine's decode steps (module docstring). ``run`` takes a built step and
    returns its hidden states, or None for a step that does not fit (the caller runs it eagerly)."""

    def __init__(self, model: Decoder, cache: KVStorage, backend: AttentionBackend, reserved_block: int,
                 max_blocks: int, batch_sizes: Sequence[int], capture: bool,
                 group_of_layer: tuple[int, ...] = ()) -> None:
        """``reserved_block``: the block padded rows read and write (``KVCacheManager.reserve_block``);
        ``max_blocks``: the most blocks one sequence's table holds; ``capture``: record CUDA graphs
        (else run the buckets' buffers eagerly); ``group_of_layer``: each layer's group, with
        several layer groups (``AttentionMetadata.group_of_layer``; empty: one)."""
        if capture and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {model.device}")
        self.model, self.cache, self.capture = model, cache, capture
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_blocks = max_blocks
        self.stats = GraphStats()
        dev, size, bs = model.device, self.batch_sizes[-1], cache.block_size
        self.reserved_slot = reserved_block * bs     # where padding rows write, in every layer
        self._ids = torch.zeros(size, dtype=torch.long, device=dev)
        self._positions = torch.zeros(size, dtype=torch.long, device=dev)
        num_groups = max(group_of_layer) + 1 if group_of_layer else 1
        self._groups = [_GroupBuffers(size, max_blocks, reserved_block, bs, dev) for _ in range(num_groups)]
        starts = torch.arange(size + 1, dtype=torch.int32, device=dev)
        self._pool: Any = torch.cuda.graph_pool_handle() if capture else None
        self._buckets: dict[int, _Bucket] = {}
        for b in self.batch_sizes:
            # a backend of its own: its scratch stays the one its kernels were captured with
            own = type(backend)()
            metas = [g.meta(b, starts, bs, own) for g in self._groups]
            meta = metas[0] if num_groups == 1 else replace(metas[0], groups=tuple(metas),
                                                            group_of_layer=group_of_layer)
            self._buckets[b] = _Bucket(b, meta)

    def bucket_for(self, ids: torch.Tensor, meta: AttentionMetadata) -> int | None:
        """The bucket a built step pads to, or None where it does not fit (module docstring)."""
        n = ids.shape[0]
        groups = meta.group_metas
        if len(groups) != len(self._groups) or not all(self._fits(m, n) for m in groups):
            return None
        return next((b for b in self.batch_sizes if b >= n), None)

    def _fits(self, meta: AttentionMetadata, n: int) -> bool:
        """One group's metadata: ``n`` decode rows read in place in one backend call
        (``one_kernel_batch``), written to slots alone."""
        batch, w = meta.one_kernel_batch, meta.write
        if batch is None or meta.prefills:
            return False
        return not (batch.max_query_len != 1 or batch.num_seqs != n or batch.query_positions is not None
                    or batch.window is not None or batch.block_tables.shape[1] > self.max_blocks
                    or w.residual_slots is not None or w.encode_rows.numel() or w.refine_rows is not None
                    or w.kept_block_ids or w.slots.shape[0] != n)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Through the step's bucket (valid until the next call); None when it does not fit
        (nothing done)."""
        size = self.bucket_for(ids, meta)
        if size is None:
            self.stats.eager_steps += 1
            return None
        bucket = self._buckets[size]
        if self.capture and bucket.graph is None:
            self._capture(bucket)           # before the step's rows go in: it runs on padding
        n = ids.shape[0]
        self._ids[:n].copy_(ids)
        self._positions[:n].copy_(positions)
        for g, m in zip(self._groups, meta.group_metas):
            assert m.paged is not None
            g.fill(n, m.write.slots, m.paged.batch)
        self._pad(n, size)
        if self.capture:
            bucket.graph.replay()
            hidden = bucket.hidden
        else:
            hidden = self._forward(bucket)
        self.stats.replayed_steps += 1
        assert hidden is not None
        return hidden[:n]

    def _pad(self, n: int, size: int) -> None:
        """Rows ``n .. size - 1`` made padding."""
        if n < size:
            self._ids[n:size].zero_()
            self._positions[n:size].zero_()
            for g in self._groups:
                g.pad(n, size)

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        b = bucket.size
        return self.model.forward(self._ids[:b], self._positions[:b], self.cache, bucket.meta)

    def _capture(self, bucket: _Bucket) -> None:
        """Warm up (kernels compiled, the bucket's scratch sized), then record the pass, on
        padding rows alone: nothing but the reserved block is written."""
        started = time.perf_counter()
        self._pad(0, bucket.size)
        for _ in range(WARMUP_PASSES):
            self._forward(bucket)
        torch.cuda.synchronize(self.model.device)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a tier's copy on another thread (write-through, prefetch) stays legal meanwhile
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            bucket.hidden = self._forward(bucket)
        bucket.graph = graph
        self.stats.captured_buckets += 1
        log.info("decode steps of up to %d rows captured as a CUDA graph in %.2f s", bucket.size,
                 time.perf_counter() - started)


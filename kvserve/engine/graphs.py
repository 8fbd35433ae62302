"""Decode steps replayed from CUDA graphs: a step of small kernels launched from Python costs
its launches, not its bytes (a 135M model's step is ~30 layers x ~15 kernels), so a graph of
the whole forward pass, captured once per batch-size bucket, is launched as one.

A graph replays fixed addresses with fixed shapes. Each bucket of ``size`` rows owns its
forward pass over static buffers (slices of one set, sized for the largest bucket):

    ids, positions, slots   [size]                 the step's tokens and where their keys go
    block_tables            [size, max_blocks]     max_blocks = the blocks of max_model_len
    context_lens, open_rows [size]; query_starts [size + 1] = 0, 1, ..., size

A step fits when every row is one decode token read in place (no draft, no budget observing,
no blend, one layer group) and its writes are slots alone (a storage that keeps open blocks in
residual rows encodes whole blocks some steps and not others: those steps, and every other that
does not fit, run eagerly). The step's batch is built as any other (``BatchBuilder``), then
copied into the bucket's buffers; its ``n`` rows are the first, and the bucket's other rows
are padding that reads and writes only the engine's reserved block (``reserve_block``):

    row      0 .. n-1: the step's           n .. size-1: token 0 at position 0,
    table    its blocks, then the reserved  context 1, every entry the reserved block,
             block up to max_blocks         its key and value written at that block's slot 0

The grid of a kernel is part of the graph: the bucket's batch says ``max_context_len`` =
max_blocks x block_size, so the split count covers any context; a split past a sequence's end
reads nothing. Each bucket attends through its own backend instance, so the scratch its kernels
were captured with (split partials, tickets) is its own and never reallocated by another call.

Without ``capture`` (CPU, where no graph exists) the same buffers and padding run eagerly: what
tests check on CPU; the capture itself needs a CUDA device (tests/engine/test_decode_graphs.py
compares replay with the eager step there).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.attention.backends import AttentionBackend
from kvserve.attention.paged import AttentionMetadata, PagedChunks
from kvserve.kv.storage import KVStorage
from kvserve.kv.storage.base import StepWrites
from kvserve.kv.storage.layout import PagedBatch
from kvserve.model.decoder import Decoder

WARMUP_PASSES = 2       # eager passes before a capture: kernels compiled, scratch sized
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


def unfit_reason(device: torch.device, backend: AttentionBackend, storage: KVStorage, num_groups: int) -> str | None:
    """Why decode steps of an engine so built could never be captured (None: they can)."""
    if device.type != "cuda":
        return f"CUDA graphs need a CUDA device, the engine is on {device}"
    if not backend.reads_in_place:
        return f"the {backend.name} attention backend builds each decode step's shapes on the host; use triton"
    if storage.residual.num_rows:
        return ("this KV format keeps open blocks in residual rows and encodes a block when one fills: a step's "
                "writes change shape, so no decode step could replay a graph")
    if num_groups > 1:
        return "a model with sliding-window layer groups keeps a block table per group (not captured)"
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


class DecodeGraphs(StepGraphs):
    """The buckets of one engine's decode steps (module docstring). ``run`` takes a built step and
    returns its hidden states, or None for a step that does not fit (the caller runs it eagerly)."""

    def __init__(self, model: Decoder, cache: KVStorage, backend: AttentionBackend, reserved_block: int,
                 max_blocks: int, batch_sizes: Sequence[int], capture: bool) -> None:
        """``reserved_block``: the block padded rows read and write (``KVCacheManager.reserve_block``);
        ``max_blocks``: the most blocks one sequence's table holds; ``capture``: record CUDA graphs
        (else run the buckets' buffers eagerly)."""
        if capture and model.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the model is on {model.device}")
        self.model, self.cache, self.capture = model, cache, capture
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_blocks = max_blocks
        self.stats = GraphStats()
        dev, size, bs = model.device, self.batch_sizes[-1], cache.block_size
        self._reserved_slot = reserved_block * bs
        self._reserved_block = reserved_block
        self._ids = torch.zeros(size, dtype=torch.long, device=dev)
        self._positions = torch.zeros(size, dtype=torch.long, device=dev)
        self._slots = torch.full((size,), self._reserved_slot, dtype=torch.long, device=dev)
        self._tables = torch.full((size, max_blocks), reserved_block, dtype=torch.int32, device=dev)
        self._lens = torch.ones(size, dtype=torch.int32, device=dev)
        self._open_rows = torch.full((size,), -1, dtype=torch.int32, device=dev)
        starts = torch.arange(size + 1, dtype=torch.int32, device=dev)
        none = torch.empty(0, dtype=torch.long, device=dev)
        self._pool: Any = torch.cuda.graph_pool_handle() if capture else None
        self._buckets: dict[int, _Bucket] = {}
        for b in self.batch_sizes:
            batch = PagedBatch(block_tables=self._tables[:b], context_lens=self._lens[:b],
                               query_starts=starts[:b + 1], open_rows=self._open_rows[:b], block_size=bs,
                               max_query_len=1, max_context_len=max_blocks * bs)
            paged = PagedChunks(torch.arange(b, dtype=torch.long, device=dev), batch, is_whole_batch=True)
            # a backend of its own: its scratch stays the one its kernels were captured with
            meta = AttentionMetadata(write=StepWrites(self._slots[:b], none, none), decode=None, prefills=(),
                                     paged=paged, backend=type(backend)())
            self._buckets[b] = _Bucket(b, meta)

    def bucket_for(self, ids: torch.Tensor, meta: AttentionMetadata) -> int | None:
        """The bucket a built step pads to, or None where it does not fit (module docstring)."""
        paged, w, n = meta.paged, meta.write, ids.shape[0]
        if (paged is None or not paged.is_whole_batch or meta.groups is not None or meta.supplied is not None
                or meta.budgeted or meta.prefills or meta.decode is not None or paged.scores is not None
                or paged.layer_batches is not None):
            return None
        batch = paged.batch
        if (batch.max_query_len != 1 or batch.num_seqs != n or batch.query_positions is not None
                or batch.window is not None or batch.block_tables.shape[1] > self.max_blocks):
            return None
        if (w.residual_slots is not None or w.encode_rows.numel() or w.refine_rows is not None
                or w.kept_block_ids or w.slots.shape[0] != n):
            return None
        return next((b for b in self.batch_sizes if b >= n), None)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """Through the step's bucket (valid until the next call); None when it does not fit
        (nothing done)."""
        size = self.bucket_for(ids, meta)
        if size is None:
            self.stats.eager_steps += 1
            return None
        assert meta.paged is not None
        bucket = self._buckets[size]
        if self.capture and bucket.graph is None:
            self._capture(bucket)           # before the step's rows go in: it runs on padding
        self._fill(ids, positions, meta.write.slots, meta.paged.batch, size)
        if self.capture:
            bucket.graph.replay()
            hidden = bucket.hidden
        else:
            hidden = self._forward(bucket)
        self.stats.replayed_steps += 1
        assert hidden is not None
        return hidden[:ids.shape[0]]

    def _fill(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, batch: PagedBatch,
              size: int) -> None:
        """The step's rows first, padding after (module docstring's table)."""
        n, nb = ids.shape[0], batch.block_tables.shape[1]
        self._ids[:n].copy_(ids)
        self._positions[:n].copy_(positions)
        self._slots[:n].copy_(slots)
        self._tables[:n, :nb].copy_(batch.block_tables)
        self._tables[:n, nb:].fill_(self._reserved_block)
        self._lens[:n].copy_(batch.context_lens)
        self._open_rows[:n].copy_(batch.open_rows)
        self._pad(n, size)

    def _pad(self, n: int, size: int) -> None:
        """Rows ``n .. size - 1`` made padding."""
        if n < size:
            self._ids[n:size].zero_()
            self._positions[n:size].zero_()
            self._slots[n:size].fill_(self._reserved_slot)
            self._tables[n:size].fill_(self._reserved_block)
            self._lens[n:size].fill_(1)
            self._open_rows[n:size].fill_(-1)

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


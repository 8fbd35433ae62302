"""Turns a scheduled step into tensors, runs the model, returns logits.

It owns the device: the model, the KV storage, and the per-step batch
(input ids, positions, where new K/V go, attention metadata), which is built
fresh each step and travels with the call, never through global state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.attention.backends import AttentionBackend, TorchBackend
from kvserve.attention.paged import AttentionMetadata, BudgetedChunk, DecodeGroup, PagedChunks, PrefillChunk
from kvserve.kv.budget.budgets import Budgets, BudgetStep
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.storage import KVStorage
from kvserve.kv.storage.layout import PagedBatch
from kvserve.model.llama import LlamaModel
from kvserve.request import Request, TokenLogprob
from kvserve.sampling.sampler import top_logprobs
from kvserve.scheduler.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepResult:
    sample_requests: list[Request]          # requests whose sequence is complete: sample
    drafts: list[tuple[int, ...]]           # each one's drafted tokens (kvserve/spec/; mostly empty)
    logits: torch.Tensor                    # float32 on CPU: 1 + len(draft) rows per sample request, in order
    prompt_logprobs: dict[str, list[TokenLogprob]]  # request id -> logprobs of prompt tokens this step


class _StepBuilder:
    """Accumulates one step's batch, chunk by chunk (CPU lists, then tensors). Where the
    new keys and values go, and how open blocks are read, is the storage's plan."""

    def __init__(self, runner: ModelRunner) -> None:
        self.r = runner
        self.writes = runner.cache.planner()
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.decode_idx: list[int] = []
        self.decode_tables: list[list[int]] = []
        self.decode_lens: list[int] = []
        self.prefills: list[PrefillChunk] = []
        self.budgeted: list[BudgetedChunk] = []
        # sequences a backend reads in place: (flat start, new tokens, context length, block ids)
        self.paged: list[tuple[int, int, int, list[int]]] = []

    def add(self, req: Request, n: int, draft: tuple[int, ...] = ()) -> None:
        """``n`` new tokens of ``req`` from its first not computed, the last ``len(draft)`` of
        them drafted: they take the next positions and slots like known tokens."""
        r, bs = self.r, self.r.block_size
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        block_ids = r.kv.block_ids(req.request_id)
        flat_start = len(self.input_ids)
        self.input_ids.extend(req.all_token_ids[start:end - len(draft)])
        self.input_ids.extend(draft)
        self.positions.extend(range(start, end))
        step = r.budgets.begin_step(req, n)
        slot_start = start if step is None else step.slot_start
        self.writes.add(block_ids, slot_start, n)
        if step is not None:
            self._add_budgeted(step, flat_start, start, n, block_ids)
            if step.is_compacted:
                return      # attended on its own (attention/paged.py)
        num_blocks = -(-end // bs)
        fresh = start == 0 and r.cache.reads_as_written     # attends to its own new keys and values
        # a backend that reads in place takes first chunks too: every query is then attended
        # by one kernel whose result depends on nothing but its own context (batch-invariant)
        if r.backend.reads_in_place:
            self.paged.append((flat_start, n, end, block_ids[:num_blocks]))
        elif n == 1:
            self.decode_idx.append(flat_start)
            self.decode_tables.append(block_ids[:num_blocks])
            self.decode_lens.append(end)
        elif fresh:
            self.prefills.append(PrefillChunk(flat_start, flat_start + n, 0, None, None))
        else:
            dev = r.device
            table = torch.tensor([block_ids[:num_blocks]], dtype=torch.long, device=dev)
            key_pos = torch.arange(num_blocks * bs, device=dev)
            query_pos = torch.arange(start, end, device=dev)
            mask = key_pos[None, :] <= query_pos[:, None]
            overlay = self.writes.overlay([(num_blocks - 1, block_ids[num_blocks - 1])])
            self.prefills.append(PrefillChunk(flat_start, flat_start + n, start, table, mask, overlay))

    def _add_budgeted(self, step: BudgetStep, flat_start: int, start: int, n: int, block_ids: list[int]) -> None:
        if not step.is_observed:
            return
        ids = block_ids[:-(-(step.slot_start + n) // self.r.block_size)]
        self.budgeted.append(BudgetedChunk(
            flat_start, flat_start + n, step.slot_start, start, ids,
            torch.tensor([ids], dtype=torch.long, device=self.r.device), step.state, step.is_compacted,
            step.observe_from))

    def build(self) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev = self.r.device
        decode = self._decode_group() if self.decode_idx else None
        paged = self._paged_chunks() if self.paged else None
        meta = AttentionMetadata(write=self.writes.build(), decode=decode, prefills=tuple(self.prefills),
                                 budgeted=tuple(self.budgeted), paged=paged, backend=self.r.backend)
        ids = torch.tensor(self.input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(self.positions, dtype=torch.long, device=dev)
        return ids, pos, meta

    def _paged_chunks(self) -> PagedChunks:
        dev = self.r.device
        max_blocks = max(len(ids) for _, _, _, ids in self.paged)
        tables = [ids + [ids[-1]] * (max_blocks - len(ids)) for _, _, _, ids in self.paged]
        starts = [0]
        for _, n, _, _ in self.paged:
            starts.append(starts[-1] + n)
        token_idx = [i for flat, n, _, _ in self.paged for i in range(flat, flat + n)]

        def int32(values: list[int] | list[list[int]]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32, device=dev)

        batch = PagedBatch(
            block_tables=int32(tables), context_lens=int32([end for _, _, end, _ in self.paged]),
            query_starts=int32(starts), open_rows=int32(self.writes.open_rows([ids[-1] for *_, ids in self.paged])),
            block_size=self.r.block_size, max_query_len=max(n for _, n, _, _ in self.paged),
            max_context_len=max(end for _, _, end, _ in self.paged))
        return PagedChunks(torch.tensor(token_idx, dtype=torch.long, device=dev), batch,
                           is_whole_batch=len(token_idx) == len(self.input_ids) and not self.budgeted)

    def _decode_group(self) -> DecodeGroup:
        bs, dev = self.r.block_size, self.r.device
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


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVStorage, kv: KVCacheManager, budgets: Budgets,
                 backend: AttentionBackend | None = None) -> None:
        """``budgets``: where a budgeted request's new entries go and which it observes."""
        self.model = model
        self.cache = cache
        self.kv = kv
        self.budgets = budgets
        self.backend = backend if backend is not None else TorchBackend()
        self.device = model.device
        self.block_size = cache.block_size

    def build_metadata(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        builder = _StepBuilder(self)
        for chunk in out.chunks:
            builder.add(chunk.request, chunk.num_new_tokens, chunk.draft)
        return builder.build()

    def execute(self, out: SchedulerOutput) -> StepResult:
        ids, pos, meta = self.build_metadata(out)
        hidden = self.model.forward(ids, pos, self.cache, meta)
        self.cache.finish_step(meta.write)
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        drafts: list[tuple[int, ...]] = []
        prompt_logprobs: dict[str, list[TokenLogprob]] = {}
        flat = 0
        for chunk in out.chunks:
            req, n = chunk.request, chunk.num_new_tokens
            if req.wants_prompt_logprobs and req.num_computed_tokens < req.num_prompt_tokens:
                prompt_logprobs[req.request_id] = self._prompt_logprobs(hidden[flat:flat + n], req, n)
            if chunk.completes_sequence:
                sample_rows.extend(range(flat + n - 1 - len(chunk.draft), flat + n))
                sample_requests.append(req)
                drafts.append(chunk.draft)
            flat += n
        if sample_rows:
            rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden[rows]).cpu()
        else:
            logits = torch.empty(0, 0)
        return StepResult(sample_requests, drafts, logits, prompt_logprobs)

    def _prompt_logprobs(self, hidden: torch.Tensor, req: Request, n: int) -> list[TokenLogprob]:
        # hidden row i (position start+i) predicts prompt token start+i+1
        start = req.num_computed_tokens
        last = min(start + n, req.num_prompt_tokens - 1)   # exclusive bound on predicting rows
        if last <= start:
            return []
        logits = self.model.compute_logits(hidden[:last - start]).cpu()
        targets = req.prompt_token_ids[start + 1:last + 1]
        k = req.params.prompt_logprobs or 0
        return top_logprobs(torch.log_softmax(logits, dim=-1), targets, k)

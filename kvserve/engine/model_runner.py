"""Turns a scheduled step into tensors, runs the model, returns logits.

It owns the device: the model, the paged KV cache, and the per-step batch
(input ids, positions, where new K/V go, attention metadata), which is built
fresh each step and travels with the call, never through global state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kv.budget.state import BudgetState
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.quantized_cache import Overlay, ResidualWrite
from kvserve.model.attention import AttentionMetadata, BudgetedChunk, DecodeGroup, KVCache, PrefillChunk
from kvserve.model.llama import LlamaModel
from kvserve.request import Request, TokenLogprob
from kvserve.sampling.sampler import top_logprobs
from kvserve.scheduler.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepResult:
    sample_requests: list[Request]          # requests whose sequence is complete: sample one token
    logits: torch.Tensor                    # [len(sample_requests), vocab] float32 on CPU
    prompt_logprobs: dict[str, list[TokenLogprob]]  # request id -> logprobs of prompt tokens this step


class _StepBuilder:
    """Accumulates one step's batch, chunk by chunk (CPU lists, then tensors)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.r = runner
        self.input_ids: list[int] = []
        self.positions: list[int] = []
        self.slots: list[int] = []           # cache slots (native) or residual slots (quantized)
        self.encode_rows: list[int] = []
        self.encode_blocks: list[int] = []
        self.decode_idx: list[int] = []
        self.decode_tables: list[list[int]] = []
        self.decode_lens: list[int] = []
        self.decode_open: list[int | None] = []   # residual row of each decode's open block
        self.prefills: list[PrefillChunk] = []
        self.budgeted: list[BudgetedChunk] = []

    def add(self, req: Request, n: int) -> None:
        r, bs = self.r, self.r.block_size
        start, end = req.num_computed_tokens, req.num_computed_tokens + n
        block_ids = r.kv.block_ids(req.request_id)
        flat_start = len(self.input_ids)
        self.input_ids.extend(req.all_token_ids[start:end])
        self.positions.extend(range(start, end))
        state = r.kv.budgets.get(req.request_id)
        shift = 0 if state is None else state.num_evicted      # slot = position - shift
        open_row = None
        if r.cache.is_lossless:
            self.slots.extend(block_ids[s // bs] * bs + s % bs for s in range(start - shift, end - shift))
        if state is not None:
            self._add_budgeted(req, state, flat_start, start - shift, n, block_ids)
            if state.is_compacted:
                return      # attended on its own (model/attention.py)
        if not r.cache.is_lossless:
            rows = {i: r.kv.residual.assign(block_ids[i]) for i in range(start // bs, (end - 1) // bs + 1)}
            self.slots.extend(rows[p // bs] * bs + p % bs for p in range(start, end))
            for i, row in rows.items():
                if (i + 1) * bs <= end:
                    self.encode_rows.append(row)
                    self.encode_blocks.append(block_ids[i])
            open_row = rows.get(end // bs) if end % bs else None
        num_blocks = -(-end // bs)
        if n == 1:
            self.decode_idx.append(flat_start)
            self.decode_tables.append(block_ids[:num_blocks])
            self.decode_lens.append(end)
            self.decode_open.append(open_row)
        elif start == 0 and r.cache.is_lossless:
            self.prefills.append(PrefillChunk(flat_start, flat_start + n, 0, None, None))
        else:
            dev = r.device
            table = torch.tensor([block_ids[:num_blocks]], dtype=torch.long, device=dev)
            key_pos = torch.arange(num_blocks * bs, device=dev)
            query_pos = torch.arange(start, end, device=dev)
            mask = key_pos[None, :] <= query_pos[:, None]
            overlay = None if open_row is None else _overlay([num_blocks - 1], [open_row], dev)
            self.prefills.append(PrefillChunk(flat_start, flat_start + n, start, table, mask, overlay))

    def _add_budgeted(self, req: Request, state: BudgetState, flat_start: int, slot_start: int, n: int,
                      block_ids: list[int]) -> None:
        start = req.num_computed_tokens
        state.prepare(slot_start, start, n)
        observe_from = state.observe_from(req.num_tokens)
        if not (state.is_compacted or observe_from < start + n or state.policy.is_paged):
            return
        ids = block_ids[:-(-(slot_start + n) // self.r.block_size)]
        self.budgeted.append(BudgetedChunk(
            flat_start, flat_start + n, slot_start, start, ids,
            torch.tensor([ids], dtype=torch.long, device=self.r.device), state, state.is_compacted, observe_from))

    def build(self) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        dev = self.r.device
        slots = torch.tensor(self.slots, dtype=torch.long, device=dev)
        write: torch.Tensor | ResidualWrite = slots
        if not self.r.cache.is_lossless:
            write = ResidualWrite(slots, torch.tensor(self.encode_rows, dtype=torch.long, device=dev),
                                  torch.tensor(self.encode_blocks, dtype=torch.long, device=dev))
        decode = self._decode_group() if self.decode_idx else None
        meta = AttentionMetadata(write=write, decode=decode, prefills=tuple(self.prefills),
                                 budgeted=tuple(self.budgeted))
        ids = torch.tensor(self.input_ids, dtype=torch.long, device=dev)
        pos = torch.tensor(self.positions, dtype=torch.long, device=dev)
        return ids, pos, meta

    def _decode_group(self) -> DecodeGroup:
        bs, dev = self.r.block_size, self.r.device
        max_blocks = max(len(t) for t in self.decode_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in self.decode_tables]
        lengths = torch.tensor(self.decode_lens, device=dev)
        mask = torch.arange(max_blocks * bs, device=dev)[None, :] < lengths[:, None]
        opens = [(i * max_blocks + len(t) - 1, row)
                 for i, (t, row) in enumerate(zip(self.decode_tables, self.decode_open)) if row is not None]
        overlay = _overlay([p for p, _ in opens], [row for _, row in opens], dev) if opens else None
        return DecodeGroup(
            token_idx=torch.tensor(self.decode_idx, dtype=torch.long, device=dev),
            block_table=torch.tensor(padded, dtype=torch.long, device=dev), mask=mask[:, None, None, :],
            is_whole_batch=len(self.decode_idx) == len(self.input_ids) and not self.budgeted,
            overlay=overlay)


def _overlay(positions: list[int], rows: list[int], device: torch.device) -> Overlay:
    return Overlay(torch.tensor(positions, dtype=torch.long, device=device),
                   torch.tensor(rows, dtype=torch.long, device=device))


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: KVCache, kv: KVCacheManager) -> None:
        self.model = model
        self.cache = cache
        self.kv = kv
        self.device = model.device
        self.block_size = cache.block_size

    def build_metadata(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        builder = _StepBuilder(self)
        for chunk in out.chunks:
            builder.add(chunk.request, chunk.num_new_tokens)
        return builder.build()

    def execute(self, out: SchedulerOutput) -> StepResult:
        ids, pos, meta = self.build_metadata(out)
        hidden = self.model.forward(ids, pos, self.cache, meta)
        if isinstance(meta.write, ResidualWrite):
            # the blocks filled this step are encoded now: their rows are free again
            self.kv.residual.release(meta.write.encode_block_ids.tolist())
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        prompt_logprobs: dict[str, list[TokenLogprob]] = {}
        flat = 0
        for chunk in out.chunks:
            req, n = chunk.request, chunk.num_new_tokens
            if req.wants_prompt_logprobs and req.num_computed_tokens < req.num_prompt_tokens:
                prompt_logprobs[req.request_id] = self._prompt_logprobs(hidden[flat:flat + n], req, n)
            if chunk.completes_sequence:
                sample_rows.append(flat + n - 1)
                sample_requests.append(req)
            flat += n
        if sample_rows:
            rows = torch.tensor(sample_rows, dtype=torch.long, device=self.device)
            logits = self.model.compute_logits(hidden[rows]).cpu()
        else:
            logits = torch.empty(0, 0)
        return StepResult(sample_requests, logits, prompt_logprobs)

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

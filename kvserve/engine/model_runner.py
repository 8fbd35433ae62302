"""Turns a scheduled step into tensors, runs the model, returns logits.

It owns the device: the model, the paged KV cache, and the per-step batch
(input ids, positions, slot mapping, attention metadata), which is built fresh
each step and travels with the call, never through global state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvserve.kv.manager import KVCacheManager
from kvserve.kv.paged_cache import PagedKVCache
from kvserve.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk
from kvserve.model.llama import LlamaModel
from kvserve.request import Request, TokenLogprob
from kvserve.sampling.sampler import top_logprobs
from kvserve.scheduler.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepResult:
    sample_requests: list[Request]          # requests whose sequence is complete: sample one token
    logits: torch.Tensor                    # [len(sample_requests), vocab] float32 on CPU
    prompt_logprobs: dict[str, list[TokenLogprob]]  # request id -> logprobs of prompt tokens this step


class ModelRunner:
    def __init__(self, model: LlamaModel, cache: PagedKVCache, kv: KVCacheManager) -> None:
        self.model = model
        self.cache = cache
        self.kv = kv
        self.device = model.device
        self.block_size = cache.block_size

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def build_metadata(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        decode_idx: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for chunk in out.chunks:
            req, n = chunk.request, chunk.num_new_tokens
            start_pos = req.num_computed_tokens
            end_pos = start_pos + n
            block_ids = self.kv.block_ids(req.request_id)
            flat_start = len(input_ids)
            input_ids.extend(req.all_token_ids[start_pos:end_pos])
            positions.extend(range(start_pos, end_pos))
            slot_mapping.extend(self._slots(block_ids, start_pos, end_pos))
            if n == 1:
                decode_idx.append(flat_start)
                decode_tables.append(block_ids)
                decode_lens.append(end_pos)
            elif start_pos == 0:
                prefills.append(PrefillChunk(flat_start, flat_start + n, 0, None, None))
            else:
                num_blocks = -(-end_pos // self.block_size)
                table = torch.tensor([block_ids[:num_blocks]], dtype=torch.long, device=self.device)
                key_pos = torch.arange(end_pos, device=self.device)
                query_pos = torch.arange(start_pos, end_pos, device=self.device)
                mask = key_pos[None, :] <= query_pos[:, None]
                prefills.append(PrefillChunk(flat_start, flat_start + n, start_pos, table, mask))
        decode = None
        if decode_idx:
            decode = self._decode_group(decode_idx, decode_tables, decode_lens,
                                        is_whole_batch=len(decode_idx) == len(input_ids))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=self.device),
            decode=decode, prefills=tuple(prefills))
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        return ids, pos, meta

    def _decode_group(self, token_idx: list[int], tables: list[list[int]], lens: list[int],
                      is_whole_batch: bool) -> DecodeGroup:
        bs = self.block_size
        max_len = max(lens)
        max_blocks = -(-max_len // bs)
        padded = [t[:max_blocks] + [0] * (max_blocks - len(t[:max_blocks])) for t in tables]
        table = torch.tensor(padded, dtype=torch.long, device=self.device)
        lengths = torch.tensor(lens, device=self.device)
        mask = torch.arange(max_blocks * bs, device=self.device)[None, :] < lengths[:, None]
        return DecodeGroup(
            token_idx=torch.tensor(token_idx, dtype=torch.long, device=self.device),
            block_table=table, mask=mask[:, None, None, :], is_whole_batch=is_whole_batch)

    def execute(self, out: SchedulerOutput) -> StepResult:
        ids, pos, meta = self.build_metadata(out)
        hidden = self.model.forward(ids, pos, self.cache, meta)
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

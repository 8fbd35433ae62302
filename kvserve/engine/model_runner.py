"""Turns a scheduled step into tensors, runs the model, returns logits.

It owns the device: the model, the KV storage, and the per-step batch
(input ids, positions, where new K/V go, attention metadata), which is built
fresh each step and travels with the call, never through global state.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kvserve.attention.backends import AttentionBackend, TorchBackend
from kvserve.attention.batch import BatchBuilder
from kvserve.attention.paged import AttentionMetadata, write_layer
from kvserve.engine.graphs import StepGraphs
from kvserve.kv.budget.budgets import Budgets
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.storage import KVStorage
from kvserve.model.decoder import Decoder
from kvserve.request import Request, TokenLogprob
from kvserve.sampling.sampler import top_logprobs
from kvserve.scheduler.scheduler import SchedulerOutput


@dataclass(frozen=True)
class StepResult:
    sample_requests: list[Request]          # requests whose sequence is complete: sample
    drafts: list[tuple[int, ...]]           # each one's drafted tokens (kvserve/speculative/; mostly empty)
    logits: torch.Tensor                    # float32 on CPU: 1 + len(draft) rows per sample request, in order
    prompt_logprobs: dict[str, list[TokenLogprob]]  # request id -> logprobs of prompt tokens this step


class ModelRunner:
    def __init__(self, model: Decoder, cache: KVStorage, kv: KVCacheManager, budgets: Budgets,
                 backend: AttentionBackend | None = None, graphs: StepGraphs | None = None) -> None:
        """``budgets``: where a budgeted request's new entries go and which it observes; ``graphs``:
        decode steps replayed from CUDA graphs where they fit (engine/graphs.py; default none)."""
        self.model = model
        self.cache = cache
        self.kv = kv
        self.budgets = budgets
        self.backend = backend if backend is not None else TorchBackend()
        self.graphs = graphs if graphs is not None else StepGraphs()
        self.device = model.device
        self.block_size = cache.block_size
        group_of = {layer: g.index for g in kv.groups for layer in g.layers}
        self.group_of_layer = tuple(group_of[layer] for layer in range(model.config.num_layers)) \
            if len(kv.groups) > 1 else ()

    def build_metadata(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's batch; with several layer groups, each group's metadata from its tables
        (the tokens and positions are the same in every group)."""
        built = [self._build(out, g) for g in range(len(self.kv.groups))]
        ids, pos, meta = built[0]
        if len(built) == 1:
            return ids, pos, meta
        return ids, pos, replace(meta, groups=tuple(m for _, _, m in built), group_of_layer=self.group_of_layer)

    def _build(self, out: SchedulerOutput, group: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        builder = BatchBuilder(self.cache, self.backend, self.device)
        for chunk in out.chunks:
            req = chunk.request
            if req.blend_rows is not None:
                builder.add_blend(req, chunk.num_new_tokens, self.kv.block_ids(req.request_id, group))
                continue
            builder.add(req, chunk.num_new_tokens, self.kv.block_ids(req.request_id, group), self.budgets,
                        chunk.draft)
        return builder.build()

    def execute(self, out: SchedulerOutput) -> StepResult:
        ids, pos, meta = self.build_metadata(out)
        if ids.numel():
            hidden = self.graphs.run(ids, pos, meta)
            if hidden is None:
                hidden = self.model.forward(ids, pos, self.cache, meta)
        else:
            hidden = self._write_only(meta)
        for writes in meta.all_writes:
            self.cache.finish_step(writes)
        sample_rows: list[int] = []
        sample_requests: list[Request] = []
        drafts: list[tuple[int, ...]] = []
        prompt_logprobs: dict[str, list[TokenLogprob]] = {}
        flat = 0
        for chunk in out.chunks:
            req, n = chunk.request, chunk.num_computed_rows
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

    def _write_only(self, meta: AttentionMetadata) -> torch.Tensor:
        """A step that computes no row, only writes a blend's supplied keys and values (a stretch
        of them longer than a step's writes); no hidden states."""
        cfg = self.model.config
        none = torch.empty((0, cfg.num_kv_heads, cfg.head_dim), dtype=self.model.dtype, device=self.device)
        assert meta.supplied is not None
        for layer in range(cfg.num_layers):
            write_layer(none, none, layer, self.cache, meta)
        return torch.empty((0, cfg.hidden_size), dtype=self.model.dtype, device=self.device)

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

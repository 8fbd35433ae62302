"""The engine: the step loop (schedule, run, sample, post-process)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from collections.abc import Sequence

import torch

from kvserve.attention.backends import make_attention_backend
from kvserve.blend.blender import Blender
from kvserve.blend.prompt import SegmentedPrompt
from kvserve.cache_control import DEFAULT_PIN_TTL_S, NO_CACHE_CONTROL, CacheControl, PrefixPin
from kvserve.config import EngineConfig
from kvserve.engine.model_card import ModelCard
from kvserve.engine.model_runner import ModelRunner
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.stats import EngineStats
from kvserve.kv.block_io import BlockMover
from kvserve.kv.block_pool import BlockPool
from kvserve.kv.budget.budgets import Budgets, KVBudgets, NoBudgets
from kvserve.kv.budget.host_store import HostBlockStore
from kvserve.kv.budget.policies import check_budget, get_policy
from kvserve.kv.codecs import parse_kv_format
from kvserve.kv.manager import KVCacheManager
from kvserve.kv.pins import Clock, PinInfo, Pins
from kvserve.kv.prefix import make_extra_key
from kvserve.kv.storage import KVStorage
from kvserve.kv.storage.factory import make_storage
from kvserve.kv.tiering import make_tiering
from kvserve.model.formats.build import make_products
from kvserve.model.formats.spec import parse_weight_format
from kvserve.model.linear import make_linear
from kvserve.model.llama import LlamaModel
from kvserve.model.loader import LoadedModel, load_model
from kvserve.offload.base import Transport
from kvserve.offload.tiered import open_transports
from kvserve.request import BlendSpec, FinishReason, Request
from kvserve.sampling.sampler import Sampler, top_logprobs
from kvserve.sampling.structured import GrammarCompiler
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.policies import policy_class
from kvserve.scheduler.scheduler import Scheduler, SchedulerOutput

log = logging.getLogger("kvserve")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {name!r} asked for, but torch sees no CUDA device")
    return device


def resolve_dtype(name: str, device: torch.device, model_dtype: str) -> torch.dtype:
    if name == "auto":
        # fp32 on CPU: measured ~4.7x faster than bf16 there; the model's dtype on GPUs
        name = "float32" if device.type == "cpu" else model_dtype
        if name == "float32" and device.type == "cuda":
            name = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return getattr(torch, name)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 tiers: Sequence[Transport] | None = None, clock: Clock = time.monotonic) -> None:
        """``tiers``: transports to use as the offload tiers, in lookup order, instead of
        those ``config.tiers`` configure (tests, embedders with their own storage).
        ``clock``: seconds, for the pins' retention times (tests step a fake one)."""
        config = config if config is not None else EngineConfig()
        self._check_names(config)
        self.config = config
        loaded = loaded if loaded is not None else load_model(config.model)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, loaded.config.torch_dtype)
        mc = loaded.config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        products = make_products(config.weight_format, loaded, self.device, self.dtype,
                                 make_linear(config.linear_backend, self.device, self.dtype))
        self.model = LlamaModel(mc, loaded.weights, self.device, self.dtype, products)
        self.weight_format = products.name
        # the weights' format is part of the model's identity: KV computed with other weights never matches
        self.fingerprint = f"{loaded.fingerprint}:weights={products.name}"
        self.attention = make_attention_backend(config.attention_backend, self.device)

        cc = config.cache
        self.kv_format = parse_kv_format(cc.kv_format, mc.num_layers, self.dtype, head_dim=mc.head_dim)
        self.kv_cache = self._make_cache(config)
        num_blocks = self.kv_cache.num_blocks
        self.pool = BlockPool(num_blocks, cc.block_size)
        extra_key = make_extra_key(self.fingerprint, f"{self.kv_format.spec}:{self.dtype}", cc.cache_salt)
        # what a front end needs to parse requests for this engine (a cluster's ingress gets it over the wire)
        self.model_card = ModelCard(self.tokenizer, mc.vocab_size, self.max_model_len, cc.block_size, extra_key)
        # the engine owns the mover; the tiering copies blocks through it. Redis keys are
        # namespaced by the extra key (model, format, dtype, salt), as blocks are tagged by it
        self.block_mover = BlockMover(self.kv_cache.block_tensors())
        transports = list(tiers) if tiers is not None else open_transports(config.tiers, extra_key.hex()[:32])
        self.tiering = make_tiering(transports, self.block_mover, extra_key, cc.block_size, config.write_through)
        self.budgets = self._make_budgets(config)
        self.pins = Pins(self.pool, int(cc.max_pinned_fraction * num_blocks), cc.max_pin_ttl_s, clock)
        self.kv = KVCacheManager(self.pool, extra_key, cc.enable_prefix_caching, self.kv_cache.residual,
                                 self.tiering, self.budgets, self.pins)
        self.scheduler = Scheduler(config.scheduler, self.kv, self.tiering)
        self.runner = ModelRunner(self.model, self.kv_cache, self.kv, self.attention)
        self.blender = Blender(self.model, self.kv_cache, self.kv, cc.blend_select_layer, cc.blend_cost_model)
        self._blend_waiting: list[Request] = []     # requests with segments, before their first admission
        self.eos_token_ids = frozenset(mc.eos_token_ids)
        self.sampler = Sampler(config.seed, sorted(self.eos_token_ids))
        self.grammars = GrammarCompiler(self.tokenizer.to_tokenizer_json() if self.tokenizer is not None else None,
                                        mc.vocab_size, sorted(self.eos_token_ids))
        self._requests: dict[str, Request] = {}
        self._seq = itertools.count()
        self.num_steps = 0
        log.info("engine ready: %s on %s/%s, weights %s (%.1f MiB), KV format %s, %d blocks of %d tokens (%.1f MiB), attention %s, "
                 "offload tiers: %s", loaded.source, self.device, self.dtype, products.name,
                 self.model.weight_nbytes / 2**20, self.kv_format.spec, num_blocks,
                 cc.block_size, self.kv_cache.nbytes / 2**20, self.attention.name,
                 ", ".join(self.tiering.tier_names) or "none")

    @staticmethod
    def _check_names(config: EngineConfig) -> None:
        """Raise ValueError for a policy name no registry knows (or a default budget its policy
        cannot run), before a model is loaded or a tier opened."""
        policy_class(config.scheduler.policy)
        parse_weight_format(config.weight_format)
        cc = config.cache
        budget_policy = get_policy(cc.kv_policy)
        if cc.kv_budget is not None:
            check_budget(cc.kv_budget, budget_policy, cc.block_size)

    def _make_cache(self, config: EngineConfig) -> KVStorage:
        return make_storage(self.model_config, self.kv_format, config.cache, config.scheduler, self.dtype,
                            self.device)

    def _make_budgets(self, config: EngineConfig) -> Budgets:
        cc = config.cache
        if not self.kv_cache.supports_budgets:
            if cc.kv_budget is not None:
                raise ValueError(f"a KV budget needs the native KV format (compaction rewrites full-precision "
                                 f"entries); got --kv-format {self.kv_format.spec}")
            return NoBudgets(f"KV format {self.kv_format.spec} is quantized; budgets need the native format")
        return KVBudgets(self.kv_cache, self.model_config.num_kv_heads, cc.kv_budget, cc.kv_policy,
                         HostBlockStore(cc.budget_host_bytes))

    # -- requests ----------------------------------------------------------
    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt, with a clear error for anything unusable (ModelCard.encode_prompt)."""
        return self.model_card.encode_prompt(prompt)

    def check_params(self, params: SamplingParams) -> None:
        """Raise ValueError for parameters this engine cannot run (an unknown KV budget policy, a
        KV budget it cannot apply, a token id outside the vocabulary, a grammar that does not compile)."""
        if params.kv_policy is not None:
            get_policy(params.kv_policy)
        self.budgets.check(params)
        vocab = self.model_config.vocab_size
        for token_id, _ in params.logit_bias:
            if token_id >= vocab:
                raise ValueError(f"logit_bias: token id {token_id} is out of range for a vocabulary of {vocab}")
        if params.structured is not None:
            self.grammars.check(params.structured)

    def add_request(self, prompt: str | Sequence[int] | SegmentedPrompt, params: SamplingParams | None = None,
                    request_id: str | None = None, priority: int = 0, cache: CacheControl | None = None) -> str:
        """Validate and queue a request; raises ValueError, changing nothing, on bad input.

        ``prompt`` as a ``SegmentedPrompt``: its segments' KV is reused by blending (lossy;
        kvserve/blend/). ``cache``: its retention class and the prefixes of its prompt to pin
        (pinned at once, so later requests find them pinned too; a pin over the limit raises
        PinLimitError)."""
        params = params if params is not None else SamplingParams()
        cache = cache if cache is not None else NO_CACHE_CONTROL
        if not isinstance(cache, CacheControl):
            raise TypeError(f"cache must be CacheControl, got {type(cache).__name__}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        ids, blend = self.encode_any_prompt(prompt)
        self.check_params(params)
        if blend is not None:
            self.check_blendable(params, len(ids))
        seq = next(self._seq)
        rid = request_id if request_id is not None else str(seq)
        if rid in self._requests:
            raise ValueError(f"request id {rid!r} is already in use")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        num_blocks = self.kv.num_blocks_needed(len(ids) + max_tokens)
        budgeted = self.budgets.max_blocks(params, len(ids))
        num_blocks = num_blocks if budgeted is None else min(num_blocks, budgeted)
        if num_blocks > self.pool.num_blocks:
            raise ValueError(
                f"request needs up to {num_blocks} KV blocks ({len(ids)} prompt + {max_tokens} new tokens) "
                f"but the cache has {self.pool.num_blocks}; lower max_tokens or give the KV cache more memory")
        self._pin_request_prefixes(ids, cache)
        req = Request(rid, ids, params, arrival_seq=seq, priority=priority, max_tokens=max_tokens,
                      retention_class=cache.retention_class, blend=blend)
        if params.structured is not None:
            req.constraint = self.grammars.matcher(params.structured)
        self._requests[rid] = req
        if blend is not None:
            self._blend_waiting.append(req)
        else:
            self.scheduler.add(req)
        return rid

    def encode_any_prompt(self, prompt: str | Sequence[int] | SegmentedPrompt) -> tuple[list[int], BlendSpec | None]:
        """Token ids, and the segments' spans of a segmented prompt (ValueError as encode_prompt)."""
        if isinstance(prompt, SegmentedPrompt):
            ids, spec = prompt.encode(self.tokenizer)
            return self.encode_prompt(ids), spec
        return self.encode_prompt(prompt), None

    def check_blendable(self, params: SamplingParams, num_prompt_tokens: int) -> None:
        """Raise ValueError for parameters a segmented prompt cannot run with."""
        if params.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs need every prompt token computed; a segmented prompt reuses "
                             "its segments' KV (send it as plain text instead)")
        if self.budgets.max_blocks(params, num_prompt_tokens) is not None:
            raise ValueError("a KV budget and a segmented prompt do not mix: budgets compact a full-precision "
                             "cache computed token by token")

    def cache_segments(self, segments: Sequence[str | Sequence[int]]) -> int:
        """Compute each segment standalone and store it (device pool, then tiers as blocks are
        evicted) unless it is stored already; returns the tokens newly stored. Only whole
        blocks are stored. Runs between steps (call it from the engine's thread)."""
        encoded = [self.encode_prompt(segment) for segment in segments]
        return sum(self.blender.store(ids) for ids in encoded)

    def abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            if req in self._blend_waiting:
                self._blend_waiting.remove(req)
            self.scheduler.finish(req, FinishReason.ABORT)

    def _pin_request_prefixes(self, ids: list[int], cache: CacheControl) -> None:
        """A request's pins; a prefix shorter than one block pins nothing (as a prompt too short
        to cache is not cached)."""
        for p in cache.pins:
            if p.num_tokens is not None and p.num_tokens > len(ids):
                raise ValueError(f"a pin covers {p.num_tokens} tokens, but the prompt has {len(ids)}")
        prefixes = [(p.num_tokens, p.ttl_s) for p in cache.pins
                    if (len(ids) if p.num_tokens is None else p.num_tokens) >= self.pool.block_size]
        if prefixes:
            self.kv.pin(ids, prefixes)

    # -- pins --------------------------------------------------------------
    def pin(self, prompt: str | Sequence[int], ttl_s: float | None = None, num_tokens: int | None = None) -> PinInfo:
        """Pin the full blocks of the prompt's first ``num_tokens`` tokens (all by default) for
        ``ttl_s`` seconds (default 300), whether they are cached yet or not: on the device they
        are evicted after every unpinned block. Pinning a pinned prefix again extends it.
        ValueError (PinLimitError past the limit) for a prefix shorter than one block, a ttl over
        ``max_pin_ttl_s``; nothing is pinned then."""
        ids = self.encode_prompt(prompt)
        spec = PrefixPin(num_tokens, DEFAULT_PIN_TTL_S if ttl_s is None else ttl_s)
        n = len(ids) if num_tokens is None else num_tokens
        if n > len(ids):
            raise ValueError(f"num_tokens {n} is more than the prompt's {len(ids)} tokens")
        if n < self.pool.block_size:
            raise ValueError(f"nothing to pin: the prefix has {n} tokens, fewer than one block of "
                             f"{self.pool.block_size}")
        return self.kv.pin(ids, [(n, spec.ttl_s)])[0]

    def unpin(self, prompt: str | Sequence[int], num_tokens: int | None = None) -> PinInfo:
        """Remove the pin over exactly the full blocks of the prompt's first ``num_tokens``
        tokens (all by default); PinNotFoundError if no pin covers exactly those."""
        return self.kv.unpin(self.encode_prompt(prompt)[:num_tokens])

    def unpin_all(self) -> list[PinInfo]:
        """Remove every pin; returns them."""
        return self.pins.unpin_all()

    def list_pins(self) -> list[PinInfo]:
        """Every pin, soonest to expire first."""
        self.pins.expire()
        return self.pins.infos()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or bool(self._blend_waiting)

    def reset_prefix_cache(self) -> int:
        """Forget the device prefix cache (the offload tiers keep their blocks)."""
        return self.kv.reset_prefix_cache()

    def close(self) -> None:
        """Finish pending demotions and release the offload tiers (the disk directory's
        lock, Redis connections). Blocks still on the device are not written out."""
        self.tiering.close()

    # -- the step ----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit segmented requests (their prompts blended), then run one batch; return an
        output for each request that got a token."""
        self.pins.expire()
        blended = self._admit_blended() if self._blend_waiting else []
        return blended + self._run_batch(wait=not blended)

    def _admit_blended(self) -> list[RequestOutput]:
        """First admissions of segmented requests, in arrival order, while seats and blocks
        last: blended outside the batch (kvserve/blend/blender.py), or sent to the scheduler
        for a full prefill when the cost model says blending does not pay."""
        outputs: list[RequestOutput] = []
        while self._blend_waiting and self.scheduler.has_free_seat:
            req = self._blend_waiting[0]
            try:
                match = self.kv.match_prefix(req)
                num_known = match.num_device_blocks * self.pool.block_size
                if not self.kv.try_allocate(req, req.num_tokens - num_known, match):
                    break       # blocks free up as running requests finish
                self._blend_waiting.pop(0)
                plan = self.blender.choose(req, num_known)
                if plan is None:
                    self.kv.free(req)
                    self.scheduler.add(req)
                    continue
                self.kv.mark_lossy(req)
                outcome = self.blender.run(req, plan, self.kv.block_ids(req.request_id))
            except Exception as e:
                log.exception("blending request %s failed", req.request_id)
                if req in self._blend_waiting:
                    self._blend_waiting.remove(req)
                # failing it retires it: the scheduler's finish frees whatever blocks it holds
                outputs.append(self._fail(req, f"blending failed: {type(e).__name__}: {e}"))
                continue
            req.num_reused_tokens = outcome.num_reused_tokens
            req.num_recomputed_tokens = outcome.num_recomputed_tokens
            self.scheduler.add_computed(req, num_known)
            outputs.extend(self._sample(outcome.logits, [req]))
        return outputs

    def _run_batch(self, wait: bool) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if out.is_empty:
            # nothing to run: the only work left may be loads from slow tiers
            if wait:
                self.scheduler.wait_for_loads(timeout=0.05)
            return []
        self.num_steps += 1
        start = time.perf_counter()
        try:
            result = self.runner.execute(out)
        except Exception as e:
            # not attributable to one request: fail the step's requests, keep the engine going
            log.exception("step %d failed; failing its %d requests", self.num_steps, len(out.chunks))
            return [self._fail(c.request, f"the model step failed: {type(e).__name__}: {e}") for c in out.chunks]
        self._observe_step(out, time.perf_counter() - start)
        self.scheduler.update(out)
        for rid, lps in result.prompt_logprobs.items():
            req = self._requests[rid]
            if not req.prompt_logprobs:
                req.prompt_logprobs.append(None)
            req.prompt_logprobs.extend(lps)
        if not result.sample_requests:
            return []
        return self._sample(result.logits, result.sample_requests)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> list[RequestOutput]:
        """Draw a token for each request and apply it. A failure that belongs to one request
        (its row could give no token, its grammar rejected the token) fails that request only."""
        try:
            token_ids, errors = self.sampler.sample(logits, requests)
        except Exception as e:
            log.exception("sampling failed; failing its %d requests", len(requests))
            return [self._fail(r, f"sampling failed: {type(e).__name__}: {e}") for r in requests]
        # logprobs are the model's own (before penalties, bias and grammar), as in vLLM
        wanted = [i for i, t in enumerate(token_ids) if t is not None and requests[i].params.logprobs is not None]
        logprob_row = {i: k for k, i in enumerate(wanted)}
        logprobs = torch.log_softmax(logits[wanted], dim=-1) if wanted else None
        outputs = []
        for i, (req, token_id) in enumerate(zip(requests, token_ids)):
            if token_id is None:
                outputs.append(self._fail(req, errors[i]))
                continue
            try:
                if logprobs is not None and i in logprob_row:
                    k = logprob_row[i]
                    req.output_logprobs.extend(top_logprobs(logprobs[k:k + 1], [token_id], req.params.logprobs or 0))
                if req.constraint is not None:
                    req.constraint.accept(token_id)
                req.append_token(token_id)
                reason = self._check_stop(req, token_id)
            except Exception as e:
                log.exception("request %s failed after sampling", req.request_id)
                outputs.append(self._fail(req, f"{type(e).__name__}: {e}"))
                continue
            if reason is not None:
                self._retire(req, reason)
            outputs.append(self.make_output(req))
        return outputs

    def _retire(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason)
        req.finish_time = time.monotonic()
        del self._requests[req.request_id]

    def _fail(self, req: Request, error: str) -> RequestOutput:
        """Finish ``req`` with FinishReason.ERROR (its blocks freed), as an output naming ``error``."""
        req.error = error
        self._retire(req, FinishReason.ERROR)
        return self.make_output(req)

    def _observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """Feed the load-or-recompute cost model with steps that are mostly prefill."""
        num_prefill = sum(c.num_new_tokens for c in out.chunks if c.num_new_tokens > 1)
        if 2 * num_prefill >= out.num_batched_tokens:
            self.tiering.observe_prefill(out.num_batched_tokens, seconds)

    def _check_stop(self, req: Request, token_id: int) -> FinishReason | None:
        p = req.params
        if req.constraint is not None and req.constraint.is_finished:
            return FinishReason.STOP   # the grammar allows nothing more
        can_stop = req.num_output_tokens >= p.min_tokens
        if can_stop and not p.ignore_eos and token_id in self.eos_token_ids:
            return FinishReason.STOP
        if can_stop and token_id in p.stop_token_ids:
            req.stop_reason = token_id
            return FinishReason.STOP
        if can_stop and p.stop and self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=p.skip_special_tokens)
            # only the tail can hold a new match
            tail_from = max(0, len(req.output_text) - max(len(s) for s in p.stop))
            req.output_text = text
            for s in p.stop:
                at = text.find(s, tail_from)
                if at >= 0:
                    req.output_text = text[:at + len(s)] if p.include_stop_str_in_output else text[:at]
                    req.stop_reason = s
                    return FinishReason.STOP
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def make_output(self, req: Request) -> RequestOutput:
        finished = req.is_finished
        if isinstance(req.stop_reason, str):
            text = req.output_text   # cut at the stop string
        elif self.tokenizer is not None:
            text = self.tokenizer.decode(req.output_token_ids, skip_special_tokens=req.params.skip_special_tokens)
        else:
            text = ""
        ttft = None if req.first_token_time is None else req.first_token_time - req.arrival_time
        e2e = None if req.finish_time is None else req.finish_time - req.arrival_time
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids, text=text,
            token_ids=list(req.output_token_ids), num_cached_tokens=req.num_cached_tokens or 0,
            finished=finished, finish_reason=req.finish_reason.value if req.finish_reason else None,
            stop_reason=req.stop_reason,
            logprobs=list(req.output_logprobs) if req.params.logprobs is not None else None,
            prompt_logprobs=list(req.prompt_logprobs) if req.params.prompt_logprobs is not None else None,
            ttft=ttft, e2e_latency=e2e, num_preemptions=req.num_preemptions, error=req.error,
            num_reused_tokens=req.num_reused_tokens, num_recomputed_tokens=req.num_recomputed_tokens)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_steps=self.num_steps, num_waiting=len(self.scheduler.waiting), num_loading=len(self.scheduler.loading),
            num_running=len(self.scheduler.running), num_preemptions=self.scheduler.num_preemptions,
            kv_num_blocks=self.pool.num_blocks, kv_num_free_blocks=self.pool.num_free_blocks,
            kv_num_cached_blocks=self.pool.num_cached_blocks, kv_usage=self.pool.usage,
            prefix_query_tokens=self.scheduler.num_prefix_query_tokens,
            prefix_hit_tokens=self.scheduler.num_prefix_hit_tokens,
            num_evicted_blocks=self.pool.num_evicted_blocks, tiers=self.tiering.metrics(),
            cost=self.tiering.cost_snapshot(), num_swapped_blocks=self.scheduler.num_swapped_blocks,
            budgets=self.budgets.stats(), pins=self.pins.stats(), pin_hit_tokens=self.scheduler.num_pin_hit_tokens,
            blend=dataclasses.replace(self.blender.stats))

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        self.tiering.check_integrity()
        self.scheduler.check_integrity()

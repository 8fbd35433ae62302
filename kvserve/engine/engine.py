"""The engine: the step loop (schedule, run, sample, post-process).

Its parts are built in engine/build.py; segmented prompts wait in blend/admission.py until
they are blended; stop checks and detokenizing are engine/output_processor.py's.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

from kvserve.blend.admission import Blended
from kvserve.cache_control import DEFAULT_PIN_TTL_S, NO_CACHE_CONTROL, CacheControl, PrefixPin
from kvserve.config import EngineConfig
from kvserve.engine.build import build_parts, check_names
from kvserve.engine.model_card import Prompt
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.stats import EngineStats, take_stats
from kvserve.engine.tokens import TokenStage
from kvserve.kv.pins import Clock, PinInfo
from kvserve.model.loader import LoadedModel, load_model
from kvserve.offload.base import Transport
from kvserve.request import EncodedPrompt, FinishReason, Request, Resumed
from kvserve.sampling.sampler import Sampler
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import SchedulerOutput

log = logging.getLogger("kvserve")


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 tiers: Sequence[Transport] | None = None, clock: Clock = time.monotonic,
                 draft: LoadedModel | None = None, timer: Clock = time.perf_counter,
                 sampler: Sampler | None = None) -> None:
        """``tiers``: transports to use as the offload tiers, in lookup order, instead of
        those ``config.tiers`` configure (tests, embedders with their own storage).
        ``clock``: seconds, for the pins' retention times (tests step a fake one).
        ``draft``: the speculative ``draft`` method's model, loaded (instead of its config's
        ``model``). ``timer``: seconds, for the durations the load-or-recompute cost model
        learns from (the model steps, the tiers' reads; tests tick a fake one). ``sampler``: draws
        the tokens instead of the engine's own (eval's forced decoding, kvserve/eval/budget.py)."""
        config = config if config is not None else EngineConfig()
        weights = check_names(config, draft)
        loaded = loaded if loaded is not None else load_model(config.model)
        parts = build_parts(config, weights, loaded, tiers, clock, draft, timer)
        self._timer = timer
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.model_config = parts.model_config
        self.device, self.dtype, self.max_model_len = parts.device, parts.dtype, parts.max_model_len
        self.model, self.weight_format, self.fingerprint = parts.model, parts.weight_format, parts.fingerprint
        self.kv_format, self.model_card = parts.kv_format, parts.model_card
        self.kv, self.scheduler, self.runner = parts.kv, parts.scheduler, parts.runner
        self.sampler = sampler if sampler is not None else parts.sampler
        self.grammars, self.speculator = parts.grammars, parts.speculator
        self.checks, self.blending, self.outputs = parts.checks, parts.blending, parts.outputs
        self.tokens = TokenStage(self.sampler, self.scheduler, self.outputs, self.speculator)
        self._seq = itertools.count()
        self.num_steps = 0

    # -- requests ----------------------------------------------------------
    def encode(self, prompt: Prompt) -> EncodedPrompt:
        """A prompt in any form as token ids and segment spans (ModelCard.encode; ValueError)."""
        return self.model_card.encode(prompt)

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        """Token ids of a prompt, with a clear error for anything unusable (ModelCard.encode_prompt)."""
        return self.model_card.encode_prompt(prompt)

    def add_request(self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, cache: CacheControl | None = None, resume: Resumed | None = None) -> str:
        """Validate and queue a request; raises ValueError, changing nothing, on bad input.

        ``prompt``: text, token ids, a ``SegmentedPrompt`` or an ``EncodedPrompt`` with segment
        spans (their KV reused by blending; lossy; kvserve/blend/). ``cache``: its retention
        class and the prefixes of its prompt to pin (pinned at once, so later requests find
        them pinned too; a pin over the limit raises PinLimitError). ``resume``: output it
        already produced elsewhere; it goes on from there (its text, stop checks, penalties,
        grammar and ``max_tokens`` count those tokens; their KV is found in the cache or
        computed with the prompt's)."""
        params = params if params is not None else SamplingParams()
        cache = cache if cache is not None else NO_CACHE_CONTROL
        if not isinstance(cache, CacheControl):
            raise TypeError(f"cache must be CacheControl, got {type(cache).__name__}")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        encoded = self.encode(prompt)
        ids = encoded.token_ids
        self.checks.check_request(encoded, params)
        seq = next(self._seq)
        rid = request_id if request_id is not None else str(seq)
        if rid in self.tokens.requests:
            raise ValueError(f"request id {rid!r} is already in use")
        room = self.max_model_len - len(ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        self.kv.check_fits(params, len(ids), max_tokens)
        req = Request(rid, ids, params, arrival_seq=seq, priority=priority, max_tokens=max_tokens,
                      retention_class=cache.retention_class, cache_salt=cache.salt, tenant=cache.tenant,
                      blend=encoded.blend)
        if params.structured is not None:
            req.constraint = self.grammars.matcher(params.structured)
        if resume is not None and resume.token_ids:
            if req.blend is not None:
                raise ValueError("resume: a resumed request is computed exactly; give it without segments")
            self.tokens.resume(req, resume, self.model_config.vocab_size)
        try:
            self.kv.pin_prefixes(ids, cache.pins, skip_short=True, salt=cache.salt, tenant=cache.tenant)
        except Exception:
            self.outputs.remove(rid)
            raise
        self.tokens.requests[rid] = req
        if req.blend is not None:
            self.blending.wait(req)
        else:
            self.scheduler.add(req)
        return rid

    def cache_segments(self, segments: Sequence[str | Sequence[int]], salt: str = "") -> int:
        """Compute each segment standalone and store it (device pool, then tiers as blocks are
        evicted) under cache salt ``salt`` unless it is stored already; returns the tokens newly
        stored. Only whole blocks are stored. Runs between steps (from the engine's thread)."""
        encoded = [self.encode_prompt(segment) for segment in segments]
        return self.blending.store(encoded, salt)

    def abort(self, request_id: str) -> None:
        req = self.tokens.requests.pop(request_id, None)
        if req is not None:
            self.blending.remove(req)
            self.scheduler.finish(req, FinishReason.ABORT)
            self.tokens.forget(request_id)

    # -- pins --------------------------------------------------------------
    def pin(self, prompt: str | Sequence[int], ttl_s: float | None = None, num_tokens: int | None = None,
            salt: str = "", tenant: str = "") -> PinInfo:
        """Pin the full blocks of the prompt's first ``num_tokens`` tokens (all by default) for
        ``ttl_s`` seconds (default 300) in cache namespace (``tenant``, ``salt``), cached yet or not
        (``LLM.pin`` says what a pin does); ValueError (PinLimitError past the limit) pins nothing."""
        spec = PrefixPin(num_tokens, DEFAULT_PIN_TTL_S if ttl_s is None else ttl_s)
        return self.kv.pin_prefixes(self.encode_prompt(prompt), [spec], skip_short=False, salt=salt,
                                    tenant=tenant)[0]

    def unpin(self, prompt: str | Sequence[int], num_tokens: int | None = None, salt: str = "",
              tenant: str = "") -> PinInfo:
        """Remove the pin over exactly the full blocks of the prompt's first ``num_tokens``
        tokens (all by default) in cache namespace (``tenant``, ``salt``); PinNotFoundError if none."""
        return self.kv.unpin(self.encode_prompt(prompt)[:num_tokens], salt, tenant)

    def unpin_all(self, tenant: str | None = None) -> list[PinInfo]:
        """Remove every pin of ``tenant`` (any salt; None: every pin); returns them."""
        return self.kv.unpin_all(tenant)

    def list_pins(self, tenant: str | None = None) -> list[PinInfo]:
        """Every live pin of ``tenant`` (None: all), soonest to expire first."""
        return self.kv.list_pins(tenant)

    def cached_keys(self) -> list[bytes]:
        """The content keys of the blocks cached on the device (what a KV-aware router learns)."""
        return self.kv.cached_keys()

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self.blending.has_work

    def reset_prefix_cache(self, tenant: str | None = None) -> int:
        """Forget the device prefix cache, or only the blocks of ``tenant``'s namespaces (every
        salt of it; "" the engine's own); blocks running requests hold and the offload tiers'
        blocks stay, and so do the pins. Returns the blocks dropped."""
        return self.kv.reset_prefix_cache(tenant)

    def close(self) -> None:
        """Finish pending demotions and release the offload tiers (the disk directory's
        lock, Redis connections). Blocks still on the device are not written out."""
        self.kv.close()

    # -- the step ----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit segmented requests (their prompts blended), then run one batch; return an
        output for each request that got a token."""
        self.kv.expire_pins()
        outputs: list[RequestOutput] = []
        if self.blending.has_work:
            for r in self.blending.admit():
                outputs += self.tokens.sample(r.logits, [r.request]) if isinstance(r, Blended) else \
                    [self.tokens.fail(r.request, r.error)]
        return outputs + self._run_batch(wait=not outputs and not self.blending.has_work)

    def _run_batch(self, wait: bool) -> list[RequestOutput]:
        drafts = self.speculator.propose(self.scheduler.running)
        out = self.scheduler.schedule(drafts)
        if out.is_empty:
            # nothing to run: the only work left may be loads from slow tiers
            if wait:
                self.scheduler.wait_for_loads(timeout=0.05)
            return []
        self.num_steps += 1
        try:
            self.speculator.fill(out)       # a proposer that drafts in a pass, into the scheduled chunks
            start = self._timer()
            result = self.runner.execute(out)
        except Exception as e:
            # not attributable to one request: fail the step's requests, keep the engine going
            log.exception("step %d failed; failing its %d requests", self.num_steps, len(out.chunks))
            return [self.tokens.fail(c.request, f"the model step failed: {type(e).__name__}: {e}") for c in out.chunks]
        self._observe_step(out, self._timer() - start)
        self.scheduler.update(out)
        for rid, lps in result.prompt_logprobs.items():
            req = self.tokens.requests[rid]
            req.prompt_logprobs.extend([None, *lps] if not req.prompt_logprobs else lps)
        if not result.sample_requests:
            return []
        return self.tokens.sample(result.logits, result.sample_requests, result.drafts)

    def _observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """Feed the step's time to the cost models: the tiers' load-or-recompute (steps mostly
        prefill), speculation's (steps that only decode, drafts besides)."""
        num_prefill = sum(n for c in out.chunks if (n := c.num_computed_rows - len(c.draft)) > 1)
        if not out.num_batched_tokens:
            return      # a step that only wrote a blend's supplied keys and values
        if 2 * num_prefill >= out.num_batched_tokens:
            self.kv.observe_prefill(out.num_batched_tokens, seconds)
        elif num_prefill == 0:
            self.speculator.observe_step(out.num_batched_tokens, seconds)

    def stats(self) -> EngineStats:
        return take_stats(self.num_steps, self.scheduler, self.kv.stats(), self.blending.stats,
                          self.speculator.stats)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        self.speculator.check_integrity()
        self.scheduler.check_integrity()
        self.tokens.check_integrity()

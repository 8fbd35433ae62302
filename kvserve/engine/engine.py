"""The engine: the step loop (schedule, run, sample, post-process).

Its parts are built in engine/build.py; segmented prompts wait in blend/admission.py until
they are blended; stop checks and detokenizing are engine/output_processor.py's.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence

import torch

from kvserve.blend.admission import Blended
from kvserve.cache_control import DEFAULT_PIN_TTL_S, NO_CACHE_CONTROL, CacheControl, PrefixPin
from kvserve.config import EngineConfig
from kvserve.engine.build import build_parts, check_names
from kvserve.engine.model_card import Prompt
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.stats import EngineStats, take_stats
from kvserve.kv.pins import Clock, PinInfo
from kvserve.model.loader import LoadedModel, load_model
from kvserve.offload.base import Transport
from kvserve.request import ConstraintError, EncodedPrompt, ErrorKind, FinishReason, Request, Resumed, TokenLogprob
from kvserve.sampling.rows import RowRequest, drafted_rows
from kvserve.sampling_params import SamplingParams
from kvserve.scheduler.scheduler import SchedulerOutput

log = logging.getLogger("kvserve")


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None,
                 tiers: Sequence[Transport] | None = None, clock: Clock = time.monotonic,
                 draft: LoadedModel | None = None, timer: Clock = time.perf_counter) -> None:
        """``tiers``: transports to use as the offload tiers, in lookup order, instead of
        those ``config.tiers`` configure (tests, embedders with their own storage).
        ``clock``: seconds, for the pins' retention times (tests step a fake one).
        ``draft``: the speculative ``draft`` method's model, loaded (instead of its config's
        ``model``). ``timer``: seconds, for the durations the load-or-recompute cost model
        learns from (the model steps, the tiers' reads; tests tick a fake one)."""
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
        self.sampler, self.grammars, self.speculator = parts.sampler, parts.grammars, parts.speculator
        self.checks, self.blending, self.outputs = parts.checks, parts.blending, parts.outputs
        self._requests: dict[str, Request] = {}
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
        if rid in self._requests:
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
            self._resume(req, resume)
        try:
            self.kv.pin_prefixes(ids, cache.pins, skip_short=True, salt=cache.salt, tenant=cache.tenant)
        except Exception:
            self.outputs.remove(rid)
            raise
        self._requests[rid] = req
        if req.blend is not None:
            self.blending.wait(req)
        else:
            self.scheduler.add(req)
        return rid

    def _resume(self, req: Request, resume: Resumed) -> None:
        """Append ``resume``'s tokens to ``req`` (not yet queued) as its own output; ValueError
        when they cannot be its output (out of range, beyond its length, rejected by its grammar,
        or ending it already), the request then never having existed."""
        tokens = resume.token_ids
        if len(tokens) >= req.max_tokens:
            raise ValueError(f"resume: {len(tokens)} tokens already reach the request's {req.max_tokens}")
        if any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.model_config.vocab_size
               for t in tokens):
            raise ValueError(f"resume: token ids must be integers in [0, {self.model_config.vocab_size})")
        want = len(tokens) if req.params.logprobs is not None else 0
        if len(resume.logprobs) != want:
            raise ValueError(f"resume: {len(resume.logprobs)} logprobs for {len(tokens)} tokens; the request "
                             f"{'asks' if want else 'does not ask'} for logprobs ({want} expected)")
        try:
            reason = self._apply(req, list(tokens), list(resume.logprobs) or [None] * len(tokens))
            if reason is not None:
                raise ValueError(f"resume: the request already ended ({reason.value}) at token "
                                 f"{req.num_output_tokens} of {len(tokens)}")
        except Exception:
            self.outputs.remove(req.request_id)
            raise

    def cache_segments(self, segments: Sequence[str | Sequence[int]], salt: str = "") -> int:
        """Compute each segment standalone and store it (device pool, then tiers as blocks are
        evicted) under cache salt ``salt`` unless it is stored already; returns the tokens newly
        stored. Only whole blocks are stored. Runs between steps (from the engine's thread)."""
        encoded = [self.encode_prompt(segment) for segment in segments]
        return sum(self.blending.blender.store(ids, salt) for ids in encoded)

    def abort(self, request_id: str) -> None:
        req = self._requests.pop(request_id, None)
        if req is not None:
            self.blending.remove(req)
            self.scheduler.finish(req, FinishReason.ABORT)
            self._forget(request_id)

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
        self.kv.tiering.close()

    # -- the step ----------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Admit segmented requests (their prompts blended), then run one batch; return an
        output for each request that got a token."""
        self.kv.pins.expire()
        outputs: list[RequestOutput] = []
        if self.blending.has_work:
            for r in self.blending.admit():
                outputs += self._sample(r.logits, [r.request]) if isinstance(r, Blended) else \
                    [self._fail(r.request, r.error)]
        return outputs + self._run_batch(wait=not outputs and not self.blending.has_work)

    def _run_batch(self, wait: bool) -> list[RequestOutput]:
        drafts = self.speculator.propose(self.scheduler.running) if self.speculator is not None else {}
        out = self.scheduler.schedule(drafts)
        if out.is_empty:
            # nothing to run: the only work left may be loads from slow tiers
            if wait:
                self.scheduler.wait_for_loads(timeout=0.05)
            return []
        self.num_steps += 1
        try:
            if drafts and self.speculator is not None:
                self.speculator.fill(out)       # a model proposer drafts into the scheduled chunks
            start = self._timer()
            result = self.runner.execute(out)
        except Exception as e:
            # not attributable to one request: fail the step's requests, keep the engine going
            log.exception("step %d failed; failing its %d requests", self.num_steps, len(out.chunks))
            return [self._fail(c.request, f"the model step failed: {type(e).__name__}: {e}") for c in out.chunks]
        self._observe_step(out, self._timer() - start)
        self.scheduler.update(out)
        for rid, lps in result.prompt_logprobs.items():
            req = self._requests[rid]
            req.prompt_logprobs.extend([None, *lps] if not req.prompt_logprobs else lps)
        if not result.sample_requests:
            return []
        return self._sample(result.logits, result.sample_requests, result.drafts)

    def _sample(self, logits: torch.Tensor, requests: list[Request],
                drafts: Sequence[tuple[int, ...]] | None = None) -> list[RequestOutput]:
        """Draw a token for each row and apply them: one row per request, or 1 + k for a request
        with k drafted tokens (row i as if the first i were appended: kvserve/sampling/rows.py),
        of which the run the target agrees with is accepted, then the target's own token
        (kvserve/speculative/speculator.py). A failure that belongs to one request (a row that gives no
        token, a grammar that rejects the token) fails that request only."""
        drafts = drafts if drafts is not None else [()] * len(requests)
        rows: list[RowRequest] = []
        undrawn: set[int] = set()     # a sampled request's drafted rows: speculative sampling draws them
        try:
            for req, draft in zip(requests, drafts):
                if draft and not req.params.is_greedy:
                    undrawn.update(range(len(rows), len(rows) + len(draft) + 1))
                rows += drafted_rows(req, draft, logits.shape[-1]) if draft else [req]
            sampled = self.sampler.sample(logits, rows, undrawn)
        except Exception as e:
            log.exception("sampling failed; failing its %d requests", len(requests))
            return [self._fail(r, f"sampling failed: {type(e).__name__}: {e}") for r in requests]
        outputs, first = [], 0
        for req, draft in zip(requests, drafts):
            own = range(first, first + len(draft) + 1)
            first += len(draft) + 1
            row_tokens = sampled.token_ids[own.start:own.stop]
            if row_tokens[0] is None:
                error = sampled.errors[own.start]
                outputs.append(self._fail(req, error.message, error.by_constraint))
                continue
            # a drafted row with no token (its grammar state failed, or another row error) is cut
            # off with the rows after it: the rows verified are the ones before it (if the run
            # reaches it, the next step meets the same failure, as plain decoding would)
            cut = next((j for j, t in enumerate(row_tokens) if t is None), None)
            checked = draft if cut is None else draft[:cut - 1]
            tokens = [t for t in row_tokens[:len(checked) + 1] if t is not None]
            try:
                emitted = (self.speculator.verify(sampled.logits[own.start:own.start + len(checked) + 1], req,
                                                  checked, tokens, self.sampler)
                           if checked and self.speculator is not None else tokens)
                logprobs = self.sampler.logprobs(logits[own.start:own.start + len(emitted)],
                                                 rows[own.start:own.start + len(emitted)], list(emitted))
                reason = self._apply(req, emitted, [logprobs.get(j) for j in range(len(emitted))])
            except ConstraintError as e:       # its grammar failed on the token: the request's own input
                outputs.append(self._fail(req, str(e), by_constraint=True))
                continue
            except Exception as e:
                log.exception("request %s failed after sampling", req.request_id)
                outputs.append(self._fail(req, f"{type(e).__name__}: {e}"))
                continue
            if reason is not None:
                self._retire(req, reason)
            elif draft:
                self.scheduler.accept_draft(req, len(emitted) - 1)
            outputs.append(self._output(req))
        return outputs

    def _apply(self, req: Request, token_ids: list[int], logprobs: list[TokenLogprob | None]) -> FinishReason | None:
        """Append the tokens in order until one ends the request; its finish reason, if any."""
        for token_id, logprob in zip(token_ids, logprobs):
            if logprob is not None:
                req.output_logprobs.append(logprob)
            if req.constraint is not None:
                req.constraint.accept(token_id)
            req.append_token(token_id)
            reason = self.outputs.process(req, token_id)
            if reason is not None:
                return reason
        return None

    def _retire(self, req: Request, reason: FinishReason) -> None:
        self.scheduler.finish(req, reason)
        req.finish_time = time.monotonic()
        del self._requests[req.request_id]

    def _fail(self, req: Request, error: str, by_constraint: bool = False) -> RequestOutput:
        """Finish ``req`` with FinishReason.ERROR (its blocks freed), as an output naming ``error``
        (its ``error_kind``: its output constraint's failure, or the engine's)."""
        req.error = error
        req.error_kind = ErrorKind.CONSTRAINT if by_constraint else ErrorKind.ENGINE
        self._retire(req, FinishReason.ERROR)
        return self._output(req)

    def _output(self, req: Request) -> RequestOutput:
        out = self.outputs.make_output(req)
        if req.is_finished:
            self._forget(req.request_id)
        return out

    def _forget(self, request_id: str) -> None:
        self.outputs.remove(request_id)
        if self.speculator is not None:
            self.speculator.forget(request_id)

    def _observe_step(self, out: SchedulerOutput, seconds: float) -> None:
        """Feed the step's time to the cost models: the tiers' load-or-recompute (steps mostly
        prefill), speculation's (steps that only decode, drafts besides)."""
        num_prefill = sum(n for c in out.chunks if (n := c.num_computed_rows - len(c.draft)) > 1)
        if not out.num_batched_tokens:
            return      # a step that only wrote a blend's supplied keys and values
        if 2 * num_prefill >= out.num_batched_tokens:
            self.kv.tiering.observe_prefill(out.num_batched_tokens, seconds)
        elif num_prefill == 0 and self.speculator is not None:
            self.speculator.observe_step(out.num_batched_tokens, seconds)

    def stats(self) -> EngineStats:
        spec = None if self.speculator is None else self.speculator.stats
        return take_stats(self.num_steps, self.scheduler, self.kv, self.blending.blender.stats, spec)

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        self.kv.tiering.check_integrity()
        self.scheduler.check_integrity()
        self.outputs.check_integrity(self._requests)

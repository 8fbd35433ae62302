"""``POST /v1/completions``: prompts (text or token ids), echo, logprobs, streaming.

With ``echo`` and ``logprobs`` the prompt's tokens come first in ``logprobs`` (the first
has no logprob: nothing precedes it), as evaluation harnesses (lm-eval's
``local-completions``) expect; ``max_tokens=0`` with ``echo`` scores the prompt only.
Choice ``i * n + j`` is sample ``j`` of prompt ``i``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvserve.blend.prompt import SegmentedPrompt
from kvserve.engine.outputs import RequestOutput
from kvserve.request import TokenLogprob
from kvserve.server.async_engine import RequestSpec, RequestStream, StreamItem
from kvserve.server.cache_api import completion_cache
from kvserve.server.protocol import MAX_BATCH_REQUESTS, CompletionRequest, bad_request
from kvserve.server.serving import DeltaText, ServingContext, now_s, response_id, sse_stream, usage

LogprobEntry = tuple[int, TokenLogprob | None]   # token id, its logprob (None for the first prompt token)


@dataclass(frozen=True)
class _Plan:
    """A validated completions call: what to run and how to present it."""

    req: CompletionRequest
    prompt_texts: list[str]
    prompt_ids: list[list[int]]
    specs: list[RequestSpec]
    score_only: bool              # max_tokens=0 with echo: run one token, show none

    def prompt_of(self, choice: int) -> int:
        return choice // self.req.n


async def plan_completion(ctx: ServingContext, request: Request) -> _Plan:
    req = await ctx.read_request(CompletionRequest, request)
    req.stop_strings()   # a bad stop list is reported before the prompt is looked at
    prompts: Sequence[str | list[int]] = req.prompts()
    if len(prompts) * req.n > MAX_BATCH_REQUESTS:
        raise bad_request(f"{len(prompts)} prompts x n={req.n} is more than {MAX_BATCH_REQUESTS} completions "
                          "in one request", "n")
    segmented = [_segmented(req, p) for p in prompts]
    encoded = [await ctx.encode(p if s is None else s, "prompt") for p, s in zip(prompts, segmented)]
    prompt_ids = [e.token_ids for e in encoded]
    for ids in prompt_ids:
        ctx.check_room(len(ids), req.max_tokens)
    texts = [p if isinstance(p, str) else ctx.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    score_only = req.max_tokens == 0
    max_tokens = 1 if score_only else req.max_tokens
    prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
    structured, param = req.structured()
    cache = completion_cache(req, request.state.tenant)
    specs = [RequestSpec(e.token_ids, req.sampling_params(j, max_tokens, req.logprobs, prompt_logprobs, structured),
                         cache, e.blend)
             for e in encoded for j in range(req.n)]
    await ctx.check_params(specs[0].params, param)
    return _Plan(req, texts, prompt_ids, specs, score_only)


def _segmented(req: CompletionRequest, prompt: str | list[int]) -> SegmentedPrompt | None:
    if req.segments is not None:
        if not isinstance(prompt, str):
            raise bad_request("segments are found in a text prompt; this prompt is token ids", "segments")
        if req.echo and req.logprobs is not None:
            raise bad_request("echo with logprobs scores every prompt token; segments reuse their KV instead",
                              "segments")
    return req.segmented(prompt, "prompt") if isinstance(prompt, str) else req.segmented("", "prompt")


async def create_completion(ctx: ServingContext, request: Request) -> Response:
    plan = await plan_completion(ctx, request)
    stream = await ctx.submit(plan.specs, "cmpl")
    rid, created = response_id("cmpl"), now_s()
    if plan.req.stream:
        return StreamingResponse(_stream(ctx, plan, stream, rid, created), media_type="text/event-stream")
    outs = await ctx.collect(stream, request)
    choices = [_choice(ctx, plan, i, out) for i, out in enumerate(outs)]
    return JSONResponse({"id": rid, "object": "text_completion", "created": created,
                         "model": ctx.settings.model_name, "choices": choices, "usage": _usage(plan, outs)})


def _choice(ctx: ServingContext, plan: _Plan, index: int, out: RequestOutput) -> dict[str, Any]:
    p = plan.prompt_of(index)
    text = "" if plan.score_only else out.text
    return {"index": index, "text": (plan.prompt_texts[p] if plan.req.echo else "") + text,
            "logprobs": _logprobs(ctx, plan, p, out, with_prompt=plan.req.echo, num_done=0),
            "finish_reason": "length" if plan.score_only else out.finish_reason, "stop_reason": out.stop_reason}


def _logprobs(ctx: ServingContext, plan: _Plan, p: int, out: RequestOutput, with_prompt: bool,
              num_done: int) -> dict[str, Any] | None:
    """Logprobs of the prompt (with echo) and of generated tokens from ``num_done`` on."""
    if plan.req.logprobs is None:
        return None
    entries: list[LogprobEntry] = []
    if with_prompt:
        entries += zip(plan.prompt_ids[p], out.prompt_logprobs or [])
    if not plan.score_only:
        entries += [(lp.token_id, lp) for lp in (out.logprobs or [])[num_done:]]
    offset = 0 if plan.req.echo else len(plan.prompt_texts[p])
    return completion_logprobs(ctx, entries, offset)


def completion_logprobs(ctx: ServingContext, entries: list[LogprobEntry], text_offset: int) -> dict[str, Any]:
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for token_id, lp in entries:
        text = ctx.token_text(token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(lp.logprob)
        top: dict[str, float] = {}
        for alt_id, alt_lp in lp.top:
            top.setdefault(ctx.token_text(alt_id), alt_lp)
        top.setdefault(text, lp.logprob)   # the chosen token is always there, as in the OpenAI API
        top_logprobs.append(top)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def _usage(plan: _Plan, outs: list[RequestOutput]) -> dict[str, Any]:
    n = plan.req.n
    completion = 0 if plan.score_only else sum(len(o.token_ids) for o in outs)
    return usage(sum(len(ids) for ids in plan.prompt_ids), completion,
                 sum(o.num_cached_tokens for o in outs[::n]))


def _stream(ctx: ServingContext, plan: _Plan, stream: RequestStream, rid: str, created: int) -> AsyncIterator[str]:
    deltas = [DeltaText() for spec in plan.specs]
    num_logprobs_sent = [0] * len(plan.specs)
    last: dict[int, RequestOutput] = {}

    def chunk(item: StreamItem) -> dict[str, Any] | None:
        i, out = item.choice, item.output
        p, first = plan.prompt_of(i), i not in last
        last[i] = out
        text = deltas[i].next(out.text)
        if plan.score_only:
            text = ""
        if first and plan.req.echo:
            text = plan.prompt_texts[p] + text
        logprobs = _logprobs(ctx, plan, p, out, with_prompt=first and plan.req.echo, num_done=num_logprobs_sent[i])
        num_logprobs_sent[i] = len(out.logprobs or [])
        if not text and not out.finished and not (logprobs and logprobs["tokens"]):
            return None
        finish = ("length" if plan.score_only else out.finish_reason) if out.finished else None
        return _chunk(ctx, rid, created, [{"index": i, "text": text, "logprobs": logprobs,
                                           "finish_reason": finish}])

    def tail() -> list[dict[str, Any]]:
        if not plan.req.include_usage:
            return []
        outs = [last[i] for i in sorted(last)]
        return [_chunk(ctx, rid, created, [], _usage(plan, outs))]

    return sse_stream(stream, [], chunk, tail, on_error=ctx.metrics.on_error)


def _chunk(ctx: ServingContext, rid: str, created: int, choices: list[dict[str, Any]],
           usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": ctx.settings.model_name,
            "choices": choices, "usage": usage_}

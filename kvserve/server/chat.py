"""``POST /v1/chat/completions``: messages through the model's chat template, streaming, logprobs."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.outputs import RequestOutput
from kvserve.request import TokenLogprob
from kvserve.server.async_engine import RequestSpec, RequestStream, StreamItem
from kvserve.server.cache_api import chat_cache
from kvserve.server.protocol import ChatCompletionRequest, bad_request, parse_body
from kvserve.server.serving import DeltaText, ServingContext, now_s, response_id, sse_stream, usage


@dataclass(frozen=True)
class _Plan:
    req: ChatCompletionRequest
    prompt_ids: list[int]
    specs: list[RequestSpec]


async def plan_chat(ctx: ServingContext, request: Request) -> _Plan:
    req = parse_body(ChatCompletionRequest, await ctx.read_body(request))
    ctx.check_model(req.model)
    req.check_unsupported()
    req.stop_strings()   # a bad stop list is reported before the prompt is looked at
    try:
        prompt = ctx.tokenizer.apply_chat_template([m.as_template_dict() for m in req.messages],
                                                   add_generation_prompt=True)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    ids = await ctx.encode(prompt, "messages")
    ctx.check_room(len(ids), req.max_new_tokens,
                   "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    cache = await chat_cache(ctx, req, ids)
    specs = [RequestSpec(ids, req.sampling_params(j, req.max_new_tokens, logprobs), cache) for j in range(req.n)]
    return _Plan(req, ids, specs)


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    plan = await plan_chat(ctx, request)
    stream = await ctx.submit(plan.specs, "chat")
    rid, created = response_id("chatcmpl"), now_s()
    if plan.req.stream:
        return StreamingResponse(_stream(ctx, plan, stream, rid, created), media_type="text/event-stream")
    outs = await ctx.collect(stream, request)
    choices = [{"index": i, "message": {"role": "assistant", "content": out.text},
                "logprobs": _logprobs(ctx, plan, out.logprobs or []), "finish_reason": out.finish_reason,
                "stop_reason": out.stop_reason}
               for i, out in enumerate(outs)]
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created,
                         "model": ctx.settings.model_name, "choices": choices, "usage": _usage(plan, outs)})


def _logprobs(ctx: ServingContext, plan: _Plan, entries: list[TokenLogprob]) -> dict[str, Any] | None:
    if not plan.req.logprobs:
        return None
    return {"content": [{**_token(ctx, lp.token_id, lp.logprob),
                         "top_logprobs": [_token(ctx, t, v) for t, v in lp.top]} for lp in entries],
            "refusal": None}


def _token(ctx: ServingContext, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": ctx.token_text(token_id), "logprob": logprob, "bytes": ctx.token_bytes(token_id)}


def _usage(plan: _Plan, outs: list[RequestOutput]) -> dict[str, Any]:
    cached = outs[0].num_cached_tokens if outs else 0
    return usage(len(plan.prompt_ids), sum(len(o.token_ids) for o in outs), cached)


def _stream(ctx: ServingContext, plan: _Plan, stream: RequestStream, rid: str, created: int) -> AsyncIterator[str]:
    deltas = [DeltaText(spec.params.stop) for spec in plan.specs]
    num_logprobs_sent = [0] * len(plan.specs)
    last: dict[int, RequestOutput] = {}

    def chunk(item: StreamItem) -> dict[str, Any] | None:
        i, out = item.choice, item.output
        last[i] = out
        text = deltas[i].next(out.text, out.finished)
        new_logprobs = (out.logprobs or [])[num_logprobs_sent[i]:]
        num_logprobs_sent[i] += len(new_logprobs)
        if not text and not out.finished and not (plan.req.logprobs and new_logprobs):
            return None
        delta = {"content": text} if text else {}
        return _chunk(ctx, rid, created, [{"index": i, "delta": delta,
                                           "logprobs": _logprobs(ctx, plan, new_logprobs),
                                           "finish_reason": out.finish_reason if out.finished else None}])

    def tail() -> list[dict[str, Any]]:
        if not plan.req.include_usage:
            return []
        return [_chunk(ctx, rid, created, [], _usage(plan, [last[i] for i in sorted(last)]))]

    # the role comes first, at once: the client sees the response start before the first token
    head = [_chunk(ctx, rid, created, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]) for i in range(plan.req.n)]
    return sse_stream(stream, head, chunk, tail)


def _chunk(ctx: ServingContext, rid: str, created: int, choices: list[dict[str, Any]],
           usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.settings.model_name,
            "choices": choices, "usage": usage_}

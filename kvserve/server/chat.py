"""``POST /v1/chat/completions``: messages through the model's chat template, streaming, logprobs,
structured outputs and tool calls (kvserve/server/tools.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.outputs import RequestOutput
from kvserve.request import TokenLogprob
from kvserve.sampling_params import StructuredOutputs
from kvserve.server.async_engine import RequestSpec, RequestStream, StreamItem
from kvserve.server.cache_api import chat_cache
from kvserve.server.protocol import ChatCompletionRequest, ChatMessage, GenerationFields, bad_request
from kvserve.server.serving import DeltaText, ServingContext, now_s, response_id, sse_stream, usage
from kvserve.server.tools import ToolPlan, parse_calls, plan_tools, template_messages


@dataclass(frozen=True)
class _Plan:
    req: ChatCompletionRequest
    prompt_ids: list[int]
    specs: list[RequestSpec]
    tools: ToolPlan


@dataclass(frozen=True)
class Conversation:
    """Messages to run through the chat template, and the fields that govern the reply (named
    as the request's endpoint names them, for its errors)."""

    messages: list[ChatMessage]
    param: str                                    # the body field holding the messages
    max_tokens: int | None
    max_tokens_param: str
    structured: StructuredOutputs | None
    structured_param: str | None
    template_tools: list[dict[str, Any]] | None = None
    n: int = 1
    logprobs: int | None = None


async def plan_conversation(ctx: ServingContext, req: GenerationFields, conv: Conversation,
                            tenant: str) -> tuple[list[int], list[RequestSpec]]:
    """The prompt's token ids and a request per choice: chat's planning, which ``/v1/responses``
    shares. 400 naming the field for a conversation the template refuses, a prompt too long,
    a constraint that does not compile."""
    try:
        prompt = ctx.tokenizer.apply_chat_template(template_messages(conv.messages), add_generation_prompt=True,
                                                   tools=conv.template_tools)
    except ValueError as e:
        raise bad_request(str(e), conv.param) from None
    segmented = req.segmented(prompt, conv.param)
    ids, blend = await ctx.encode(prompt if segmented is None else segmented, conv.param)
    ctx.check_room(len(ids), conv.max_tokens, conv.max_tokens_param)
    cache = await chat_cache(ctx, req, conv.messages, ids, tenant)
    specs = [RequestSpec(ids, req.sampling_params(j, conv.max_tokens, conv.logprobs, structured=conv.structured),
                         cache, blend) for j in range(conv.n)]
    await ctx.check_params(specs[0].params, conv.structured_param)
    return ids, specs


async def plan_chat(ctx: ServingContext, request: Request) -> _Plan:
    req = await ctx.read_request(ChatCompletionRequest, request)
    req.stop_strings()   # a bad stop list is reported before the prompt is looked at
    tools = plan_tools(req, ctx.tokenizer.template_declares_tools)
    structured, param = req.structured()
    if tools.makes_calls:
        if structured is not None:
            raise bad_request(f"tool_choice {tools.mode} constrains the output; drop {param}", param)
        structured, param = tools.structured, "tools"
    max_tokens_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    conv = Conversation(req.messages, "messages", req.max_new_tokens, max_tokens_param, structured, param,
                        tools.template_tools, req.n, (req.top_logprobs or 0) if req.logprobs else None)
    ids, specs = await plan_conversation(ctx, req, conv, request.state.tenant)
    return _Plan(req, ids, specs, tools)


async def create_chat_completion(ctx: ServingContext, request: Request) -> Response:
    plan = await plan_chat(ctx, request)
    stream = await ctx.submit(plan.specs, "chat")
    rid, created = response_id("chatcmpl"), now_s()
    if plan.req.stream:
        return StreamingResponse(_stream(ctx, plan, stream, rid, created), media_type="text/event-stream")
    outs = await ctx.collect(stream, request)
    choices = []
    for i, out in enumerate(outs):
        message, finish_reason = _message(plan, out)
        choices.append({"index": i, "message": message, "logprobs": _logprobs(ctx, plan, out.logprobs or []),
                        "finish_reason": finish_reason, "stop_reason": out.stop_reason})
    return JSONResponse({"id": rid, "object": "chat.completion", "created": created,
                         "model": ctx.settings.model_name, "choices": choices, "usage": _usage(plan, outs)})


def _message(plan: _Plan, out: RequestOutput) -> tuple[dict[str, Any], str | None]:
    """The assistant message and finish reason: tool calls when the output holds them."""
    complete = out.finish_reason not in ("length", "error")
    parsed = parse_calls(plan.tools, out.text) if plan.tools.reads_calls and complete else None
    if parsed is None:
        return {"role": "assistant", "content": out.text}, out.finish_reason
    content, calls = parsed
    return {"role": "assistant", "content": content, "tool_calls": calls}, "tool_calls"


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
    deltas = [DeltaText() for spec in plan.specs]
    num_logprobs_sent = [0] * len(plan.specs)
    last: dict[int, RequestOutput] = {}

    def chunk(item: StreamItem) -> dict[str, Any] | None:
        i, out = item.choice, item.output
        last[i] = out
        if plan.tools.reads_calls:
            return _tool_chunk(i, out)
        text = deltas[i].next(out.text)
        new_logprobs = (out.logprobs or [])[num_logprobs_sent[i]:]
        num_logprobs_sent[i] += len(new_logprobs)
        if not text and not out.finished and not (plan.req.logprobs and new_logprobs):
            return None
        delta = {"content": text} if text else {}
        return _chunk(ctx, rid, created, [{"index": i, "delta": delta,
                                           "logprobs": _logprobs(ctx, plan, new_logprobs),
                                           "finish_reason": out.finish_reason if out.finished else None}])

    def _tool_chunk(i: int, out: RequestOutput) -> dict[str, Any] | None:
        # a reply that may hold calls is sent whole, as one delta, once it is complete
        if not out.finished:
            return None
        message, finish_reason = _message(plan, out)
        delta: dict[str, Any] = {"content": message["content"]} if message["content"] else {}
        if "tool_calls" in message:
            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
        logprobs = _logprobs(ctx, plan, out.logprobs or [])
        return _chunk(ctx, rid, created, [{"index": i, "delta": delta, "logprobs": logprobs,
                                           "finish_reason": finish_reason}])

    def tail() -> list[dict[str, Any]]:
        if not plan.req.include_usage:
            return []
        return [_chunk(ctx, rid, created, [], _usage(plan, [last[i] for i in sorted(last)]))]

    # the role comes first, at once: the client sees the response start before the first token
    head = [_chunk(ctx, rid, created, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}]) for i in range(plan.req.n)]
    return sse_stream(stream, head, chunk, tail, on_error=ctx.metrics.on_error)


def _chunk(ctx: ServingContext, rid: str, created: int, choices: list[dict[str, Any]],
           usage_: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": ctx.settings.model_name,
            "choices": choices, "usage": usage_}

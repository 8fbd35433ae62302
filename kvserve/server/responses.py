"""``POST /v1/responses``: OpenAI's Responses API over chat's engine path.

``instructions`` (a leading system message) and ``input`` (a string, one user message, or
message items) become chat messages and are planned exactly as ``/v1/chat/completions``
plans them (``chat.plan_conversation``: the chat template, ``text.format`` as a structured
output, cache salts and tenants). The reply is one assistant message with one
``output_text`` part; its status is ``incomplete`` (reason ``max_output_tokens``) when the
token limit, or the context window, cut it.

A stream is server-sent events named by their type (``event: <type>``), each payload with
the next ``sequence_number``: ``response.created``, ``response.in_progress``, the output
item and its text part added, a ``response.output_text.delta`` per new piece of text, the
text, part and item done, then ``response.completed`` (``response.incomplete`` when cut);
no ``[DONE]``. A failure mid-stream ends it with an ``error`` event.

Nothing is stored, and there are no tools: the options that need either are refused
(``protocol.RESPONSES_REFUSED``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from kvserve.engine.outputs import RequestOutput
from kvserve.server.async_engine import RequestStream, StreamItem
from kvserve.server.chat import Conversation, plan_conversation
from kvserve.server.protocol import APIError, ResponsesRequest
from kvserve.server.serving import DeltaText, ServingContext, now_s, response_id, sse, sse_stream


async def create_response(ctx: ServingContext, request: Request) -> Response:
    req = await ctx.read_request(ResponsesRequest, request)
    structured, param = req.structured()
    conv = Conversation(req.messages(), "input", req.max_output_tokens, "max_output_tokens", structured, param)
    prompt_ids, specs = await plan_conversation(ctx, req, conv, request.state.tenant)
    stream = await ctx.submit(specs, "resp")
    reply = _Reply(ctx, req, len(prompt_ids))
    if req.stream:
        return StreamingResponse(_stream(reply, stream, ctx.metrics.on_error), media_type="text/event-stream")
    (out,) = await ctx.collect(stream, request)
    return JSONResponse(reply.response(out))


def _status(out: RequestOutput | None) -> str:
    if out is None:
        return "in_progress"
    return "incomplete" if out.finish_reason == "length" else "completed"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


@dataclass(frozen=True)
class _Reply:
    """What a response's objects are built from: the request, and the ids and time it got."""

    ctx: ServingContext
    req: ResponsesRequest
    num_prompt_tokens: int
    id: str = field(default_factory=lambda: response_id("resp", "_"))
    item_id: str = field(default_factory=lambda: response_id("msg", "_"))
    created_at: int = field(default_factory=now_s)

    def response(self, out: RequestOutput | None) -> dict[str, Any]:
        """The response object: in progress (``out`` None: no output yet) or finished with ``out``."""
        req, status = self.req, _status(out)
        fmt = req.text_format
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "completed_at": None if out is None else now_s(), "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": self.ctx.settings.model_name, "output": [] if out is None else [self.message(out)],
            "usage": None if out is None else self.usage(out),
            # the request's settings, as they were applied
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.effective_temperature, "top_p": req.effective_top_p,
            "text": {"format": {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)},
            "tools": [], "tool_choice": req.tool_choice or "none", "parallel_tool_calls": bool(req.parallel_tool_calls),
            "truncation": "disabled", "store": False, "background": False, "metadata": req.metadata or {},
            "user": req.user,
        }

    def message(self, out: RequestOutput | None) -> dict[str, Any]:
        """The output message: empty while in progress, else ``out``'s text."""
        return {"type": "message", "id": self.item_id, "status": _status(out), "role": "assistant",
                "content": [] if out is None else [_text_part(out.text)]}

    def usage(self, out: RequestOutput) -> dict[str, Any]:
        num_output = len(out.token_ids)
        return {"input_tokens": self.num_prompt_tokens, "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
                "output_tokens": num_output, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": self.num_prompt_tokens + num_output}


class _EventWriter:
    """Writes each event as ``event: <type>`` and its payload, numbered in the order written."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, payload: dict[str, Any]) -> str:
        payload["sequence_number"] = self.sequence_number
        self.sequence_number += 1
        return f"event: {payload['type']}\n{sse(payload)}"


def _error_event(error: APIError) -> dict[str, Any]:
    return {"type": "error", "code": error.code or error.type, "message": error.message, "param": error.param}


def _stream(reply: _Reply, stream: RequestStream, on_error: Callable[[int], None]) -> AsyncIterator[str]:
    delta = DeltaText()
    last: list[RequestOutput] = []
    where: dict[str, Any] = {"item_id": reply.item_id, "output_index": 0, "content_index": 0}

    def chunk(item: StreamItem) -> dict[str, Any] | None:
        last[:] = [item.output]
        text = delta.next(item.output.text)
        return {"type": "response.output_text.delta", **where, "delta": text, "logprobs": []} if text else None

    def tail() -> list[dict[str, Any]]:
        (out,) = last
        done = "response.completed" if _status(out) == "completed" else "response.incomplete"
        return [{"type": "response.output_text.done", **where, "text": out.text, "logprobs": []},
                {"type": "response.content_part.done", **where, "part": _text_part(out.text)},
                {"type": "response.output_item.done", "output_index": 0, "item": reply.message(out)},
                {"type": done, "response": reply.response(out)}]

    # the response, its message and the text part are announced at once, before the first token
    head: list[dict[str, Any]] = [
        {"type": "response.created", "response": reply.response(None)},
        {"type": "response.in_progress", "response": reply.response(None)},
        {"type": "response.output_item.added", "output_index": 0, "item": reply.message(None)},
        {"type": "response.content_part.added", **where, "part": _text_part("")}]
    return sse_stream(stream, head, chunk, tail, write=_EventWriter(), error=_error_event, done=False,
                      on_error=on_error)

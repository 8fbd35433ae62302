"""What the generation endpoints share: settings, input checks, running requests, text deltas, events."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from starlette.requests import Request

from kvserve.blend.prompt import SegmentedPrompt
from kvserve.cache_control import MAX_TENANT_CHARS
from kvserve.engine.engine import LLMEngine
from kvserve.engine.model_card import ModelCard
from kvserve.engine.outputs import RequestOutput
from kvserve.model.tokenizer import Tokenizer
from kvserve.request import EncodedPrompt
from kvserve.sampling_params import SamplingParams
from kvserve.server.async_engine import (
    ConstraintFailed,
    EngineError,
    RequestFailed,
    RequestSpec,
    RequestStream,
    StreamItem,
)
from kvserve.server.metrics import ServerMetrics
from kvserve.server.protocol import APIError, GenerationFields, bad_request, parse_body

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
CONSTRAINT_FAILED = "constraint_failed"
T = TypeVar("T")
Body = TypeVar("Body", bound=GenerationFields)


@dataclass(frozen=True)
class ServerSettings:
    """``api_key``: the server key (the engine's own cache namespace, and the operator's rights
    over every tenant's cache state); ``tenant_keys``: key -> tenant name, each tenant's requests
    in cache namespaces of its own (docs/server.md "Tenants")."""

    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20
    tenant_keys: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.model_name:
            raise ValueError("the served model name must be non-empty")
        if self.api_key is not None and not self.api_key:
            raise ValueError("the API key must be non-empty when set")
        for key, tenant in self.tenant_keys.items():
            if not key or not tenant or len(tenant) > MAX_TENANT_CHARS or key == self.api_key:
                raise ValueError(f"tenant {tenant!r}: a tenant needs a name of 1..{MAX_TENANT_CHARS} characters "
                                 "and a key of its own")
        if self.max_body_bytes < 1024:
            raise ValueError(f"the request body limit must be at least 1024 bytes, got {self.max_body_bytes}")

    @property
    def requires_key(self) -> bool:
        return self.api_key is not None or bool(self.tenant_keys)

    @property
    def tenants(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.tenant_keys.values())))

    def tenant_of(self, key: str) -> str | None:
        """The tenant a key authenticates ("" for ``api_key``), None for an unknown key."""
        if self.api_key is not None and hmac.compare_digest(key.encode(), self.api_key.encode()):
            return ""
        found = None
        for candidate, tenant in self.tenant_keys.items():   # compare with every key: no early exit
            if hmac.compare_digest(key.encode(), candidate.encode()):
                found = tenant
        return found


class ClientGone(Exception):
    """The client disconnected before its response was ready."""


class EngineClient(Protocol):
    """What the handlers run requests through: ``AsyncEngine`` (the engine in this process) or
    a cluster's client (engine replicas behind a router, kvserve/cluster/client.py)."""

    @property
    def model_card(self) -> ModelCard: ...

    @property
    def is_running(self) -> bool: ...

    async def submit(self, specs: list[RequestSpec], prefix: str = "req") -> RequestStream: ...

    async def call(self, fn: Callable[[LLMEngine], T]) -> T: ...

    def abort(self, request_ids: list[str]) -> None: ...


class ServingContext:
    """The state every handler reads. The model card (tokenizer, limits) never changes after
    construction, so handlers read it directly; everything that mutates goes through
    ``engine``."""

    def __init__(self, engine: EngineClient, settings: ServerSettings, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.settings = settings
        self.metrics = metrics
        card = engine.model_card
        if card.tokenizer is None:
            raise ValueError("the server needs a model with a tokenizer")
        self.tokenizer: Tokenizer = card.tokenizer
        self.max_model_len = card.max_model_len
        self.block_size = card.block_size
        self._encode = card.encode   # reads only the tokenizer and limits
        self._token_text: dict[int, str] = {}

    # -- input -------------------------------------------------------------
    async def read_body(self, request: Request) -> bytes:
        """The body, or 413 past the limit (checked on the header and while reading), then 415
        unless it is declared JSON: a web page can send text/plain to a local server without
        the browser asking first (no CORS preflight), but not application/json."""
        limit = self.settings.max_body_bytes
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise _too_large(limit)
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(limit)
            chunks.append(chunk)
        media = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if media != "application/json" and not media.endswith("+json"):
            raise APIError(415, f"the request body must be JSON, sent as Content-Type: application/json "
                                f"(got {media or 'none'})", code="unsupported_media_type")
        return b"".join(chunks)

    async def read_request(self, model: type[Body], request: Request) -> Body:
        """The body validated as ``model``, for the model served, with what it refuses refused."""
        req: Body = parse_body(model, await self.read_body(request))
        self.check_model(req.model)
        req.check_unsupported()
        return req

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.settings.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves "
                                f"{self.settings.model_name!r}", param="model", code="model_not_found")

    async def encode(self, prompt: str | list[int] | SegmentedPrompt, param: str) -> EncodedPrompt:
        """Token ids and segment spans, tokenized once, here (off the event loop: a 1 MiB
        prompt takes a while); 400 on bad prompts."""
        try:
            return await asyncio.to_thread(self._encode, prompt)
        except ValueError as e:
            code = CONTEXT_LENGTH_EXCEEDED if "context window" in str(e) else None
            raise APIError(400, str(e), param=param, code=code) from None

    def check_room(self, num_prompt_tokens: int, max_tokens: int | None, param: str = "max_tokens") -> None:
        if max_tokens is not None and num_prompt_tokens + max_tokens > self.max_model_len:
            raise APIError(400, f"this model's context window is {self.max_model_len} tokens, but "
                                f"{num_prompt_tokens + max_tokens} were requested ({num_prompt_tokens} in the "
                                f"prompt, {param} {max_tokens}); shorten the prompt or lower {param}",
                           param=param, code=CONTEXT_LENGTH_EXCEEDED)

    async def check_params(self, params: SamplingParams, structured_param: str | None) -> None:
        """What only the engine can check (token ids in ``logit_bias``, whether a schema,
        regex or grammar compiles), on the engine thread; 400 naming the field."""
        if params.structured is None and not params.logit_bias:
            return
        try:
            await self.engine.call(lambda engine: engine.checks.check_params(params))
        except ValueError as e:
            message = str(e)
            if message.startswith("logit_bias"):
                raise bad_request(message, "logit_bias") from None
            raise bad_request(f"{structured_param}: {message}", structured_param) from None

    # -- running -----------------------------------------------------------
    async def submit(self, specs: list[RequestSpec], prefix: str) -> RequestStream:
        try:
            stream = await self.engine.submit(specs, prefix)
        except ValueError as e:
            raise bad_request(str(e)) from None
        tenant = specs[0].cache.tenant if specs and specs[0].cache is not None else ""
        self.metrics.on_submitted(tenant, len(specs), sum(len(s.prompt_token_ids) for s in specs))
        return stream

    async def collect(self, stream: RequestStream, request: Request) -> list[RequestOutput]:
        """Every request's final output; aborts them all if the client goes away first."""
        finals: list[RequestOutput | None] = [None] * len(stream.request_ids)

        async def consume() -> None:
            async for item in stream:
                if item.output.finished:
                    finals[item.choice] = item.output

        work = asyncio.ensure_future(consume())
        gone = asyncio.ensure_future(_wait_disconnect(request))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                raise ClientGone()
            work.result()   # re-raise an engine failure
        finally:
            work.cancel()
            gone.cancel()
            stream.close()
        return [f for f in finals if f is not None]

    # -- output ------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def token_bytes(self, token_id: int) -> list[int]:
        """The token's exact bytes (a token may hold part of a character: Tokenizer.token_bytes)."""
        return list(self.tokenizer.token_bytes(token_id))


async def _wait_disconnect(request: Request) -> None:
    # the body is fully read, so the next ASGI message is the disconnect
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes",
                    code="request_too_large")


class DeltaText:
    """Turns the text so far into the new part to stream: what follows the characters sent.

    The engine's running texts already hold back a stop string it may cut and a character
    whose bytes are still arriving, and each is a prefix of the next and of the final text
    (engine/output_processor.py), so nothing is held back here.
    """

    def __init__(self) -> None:
        self.num_sent_chars = 0

    def next(self, text: str) -> str:
        """The part of ``text`` not sent yet ("" when none)."""
        delta = text[self.num_sent_chars:]
        self.num_sent_chars += len(delta)
        return delta


def constraint_error(exc: Exception) -> APIError:
    """A request whose output constraint failed mid-answer: the client's input, found late (400)."""
    return APIError(400, f"the output constraint failed while generating: {exc}", code=CONSTRAINT_FAILED)


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def sse_stream(stream: RequestStream, head: list[dict[str, Any]],
                     chunk: Callable[[StreamItem], dict[str, Any] | None],
                     tail: Callable[[], list[dict[str, Any]]],
                     write: Callable[[dict[str, Any]], str] = sse,
                     error: Callable[[APIError], dict[str, Any]] = APIError.body,
                     done: bool = True, on_error: Callable[[int], None] = lambda status: None) -> AsyncIterator[str]:
    """Server-sent events: ``head``, a chunk per output (None skips it), ``tail``, then
    ``[DONE]`` (unless ``done`` is false), each event written by ``write``.

    A failure mid-stream ends it with ``error``'s event (its status counted by ``on_error``):
    400 ``constraint_failed`` when this request's output constraint failed (after the chunk of
    its last output, ``finish_reason`` "error"), 500 ``server_error`` when it failed otherwise
    (the other requests go on), 503 when the engine did. The ``finally`` runs when the client
    disconnects too (the response task is cancelled), aborting what is left.
    """
    failure: APIError | None = None
    try:
        for c in head:
            yield write(c)
        async for item in stream:
            event = chunk(item)
            if event is not None:
                yield write(event)
        for c in tail():
            yield write(c)
        if done:
            yield SSE_DONE
    except ConstraintFailed as e:
        last = chunk(e.item)
        if last is not None:
            yield write(last)
        failure = constraint_error(e)
    except RequestFailed as e:
        failure = APIError(500, str(e), type="server_error")
    except EngineError as e:
        failure = APIError(503, str(e), type="server_error")
    finally:
        stream.close()
    if failure is not None:
        on_error(failure.status)
        yield write(error(failure))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def response_id(prefix: str, sep: str = "-") -> str:
    return f"{prefix}{sep}{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())

"""Cache control over HTTP: the request fields (``cache_priority``, ``cache_control``) and the
``/v1/cache/pin``, ``/v1/cache/unpin``, ``/v1/cache/pins`` and ``/v1/cache/reset`` routes.

A breakpoint on a chat message pins the conversation up to the end of that message: the
messages up to it are rendered without the generation prompt and tokenized, and the pin
covers the full blocks of the tokens that rendering shares with the whole prompt.

Scope: every request of a tenant is in its namespaces (its name and the request's salt,
``CacheControl``); the routes that enumerate or drop cache state (``pins``, ``unpin`` with
``all``, ``reset``) see only the caller's tenant. The server key's scope is the engine: every
tenant's state. Each of those answers says which (``scope``: ``tenant`` or ``engine``).
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import Field
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvserve.cache_control import DEFAULT_PIN_TTL_S, MAX_PINS_PER_REQUEST, MAX_SALT_CHARS, CacheControl, PrefixPin
from kvserve.kv.pins import PinInfo, PinLimitError, PinNotFoundError
from kvserve.kv.prefix import common_prefix_len
from kvserve.sampling_params import SamplingParams
from kvserve.server.async_engine import RequestSpec
from kvserve.server.protocol import (
    APIError,
    ChatMessage,
    CompletionRequest,
    GenerationFields,
    _Body,
    answers,
    bad_request,
    json_body,
    parse_body,
)
from kvserve.server.serving import ServingContext
from kvserve.server.tools import template_messages

PIN_LIMIT_EXCEEDED = "pin_limit_exceeded"

# the answers' schemas (OpenAPI: what the fuzz test checks every 200 against)
_SCOPE: dict[str, Any] = {"scope": {"enum": ["engine", "tenant"]}, "tenant": {"type": "string"}}
PIN_ANSWER: dict[str, Any] = {
    "type": "object", "required": ["object", "pinned", "num_tokens", "block_keys", "expires_in", "device_tokens",
                                   "tenant"],
    "properties": {"object": {"const": "cache.pin"}, "pinned": {"type": "boolean"},
                   "num_tokens": {"type": "integer", "minimum": 0},
                   "block_keys": {"type": "array", "items": {"type": "string"}},
                   "expires_in": {"type": "number", "minimum": 0}, "device_tokens": {"type": "integer", "minimum": 0},
                   "tenant": {"type": ["string", "null"]}}}
LIST_ANSWER: dict[str, Any] = {
    "type": "object", "required": ["object", "scope", "data"],
    "properties": {"object": {"const": "list"}, **_SCOPE, "data": {"type": "array", "items": PIN_ANSWER}}}
RESET_ANSWER: dict[str, Any] = {
    "type": "object", "required": ["reset", "num_dropped_blocks", "scope"],
    "properties": {"reset": {"const": True}, "num_dropped_blocks": {"type": "integer", "minimum": 0}, **_SCOPE}}


# -- the request fields -----------------------------------------------------------
def completion_cache(req: CompletionRequest, tenant: str) -> CacheControl | None:
    """The retention class, pin and cache salt of every prompt of a completions call."""
    pins: tuple[PrefixPin, ...] = ()
    if req.cache_control is not None:
        pins = (_prefix_pin(req.cache_control.num_tokens, req.cache_control.ttl, "cache_control"),)
    return _cache_control(req.cache_priority, pins, req.cache_salt, tenant)


async def chat_cache(ctx: ServingContext, req: GenerationFields, messages: list[ChatMessage], prompt_ids: list[int],
                     tenant: str) -> CacheControl | None:
    """The retention class, the pins (a breakpoint per marked message) and the cache salt of a
    conversation (chat's ``messages``, a response's ``input``)."""
    marked = [i for i, m in enumerate(messages) if m.cache_control is not None]
    if len(marked) > MAX_PINS_PER_REQUEST:
        raise bad_request(f"at most {MAX_PINS_PER_REQUEST} messages may carry cache_control, got {len(marked)}",
                          "messages")
    pins = []
    for i in marked:
        ids = await _encode_messages(ctx, messages[:i + 1], f"messages.{i}.cache_control")
        n = common_prefix_len(ids, prompt_ids)
        cache_pin = messages[i].cache_control
        assert cache_pin is not None
        if n:
            pins.append(_prefix_pin(n, cache_pin.ttl, f"messages.{i}.cache_control"))
    return _cache_control(req.cache_priority, tuple(pins), req.cache_salt, tenant)


def _cache_control(priority: str | None, pins: tuple[PrefixPin, ...], salt: str | None,
                   tenant: str) -> CacheControl | None:
    if priority is None and not pins and not salt and not tenant:
        return None
    return CacheControl(priority=priority or "normal", pins=pins, salt=salt or "", tenant=tenant)


def _prefix_pin(num_tokens: int | None, ttl: float | None, param: str) -> PrefixPin:
    try:
        return PrefixPin(num_tokens, DEFAULT_PIN_TTL_S if ttl is None else ttl)
    except ValueError as e:
        raise bad_request(str(e), param) from None


async def _encode_messages(ctx: ServingContext, messages: list[ChatMessage], param: str) -> list[int]:
    """Token ids of ``messages`` rendered without the generation prompt (a conversation prefix)."""
    try:
        text = ctx.tokenizer.apply_chat_template(template_messages(messages), add_generation_prompt=False)
    except ValueError as e:
        raise bad_request(str(e), "messages") from None
    return (await ctx.encode(text, param)).token_ids


# -- the routes ---------------------------------------------------------------------
class _PrefixBody(_Body):
    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    num_tokens: int | None = Field(None, ge=1)
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_SALT_CHARS)   # the requests' salt


class PinBody(_PrefixBody):
    ttl: float | None = Field(None, gt=0)
    warm: bool = True            # compute the blocks that are not cached yet


class UnpinBody(_PrefixBody):
    all: bool = False            # every pin, instead of the one over the prefix given


def cache_router(ctx: ServingContext) -> APIRouter:
    """``/cache/pin``, ``/cache/unpin``, ``/cache/pins``, ``/cache/reset`` (mounted under ``/v1``)."""
    router = APIRouter()
    block_size = ctx.block_size

    @router.post("/cache/pin", openapi_extra=json_body(PinBody.__name__, PIN_ANSWER))
    async def pin(request: Request) -> Response:
        body = parse_body(PinBody, await ctx.read_body(request))
        ids = await _prefix_ids(ctx, body)
        cache = CacheControl(salt=body.cache_salt or "", tenant=request.state.tenant)
        info = await _pin(ctx, ids, body, cache)
        if body.warm and info.num_device_blocks < len(info.block_keys) and info.num_tokens < ctx.max_model_len:
            # a one-token request over the pinned blocks computes (and so caches) them
            warm = RequestSpec(ids[:info.num_tokens], SamplingParams(max_tokens=1, temperature=0.0), cache)
            await ctx.collect(await ctx.submit([warm], "pin"), request)
            info = await _pin(ctx, ids, body, cache)   # the same pin again: its blocks on the device now
        return JSONResponse(_pin_body(info, block_size, pinned=True))

    @router.post("/cache/unpin", openapi_extra=json_body(UnpinBody.__name__, {"anyOf": [PIN_ANSWER, LIST_ANSWER]}))
    async def unpin(request: Request) -> Response:
        body = parse_body(UnpinBody, await ctx.read_body(request))
        if body.all:
            if body.prompt is not None or body.messages is not None or body.num_tokens is not None:
                raise bad_request("all: true unpins every pin; give no prompt, messages or num_tokens with it", "all")
            scope = _scope(request)     # computed here: the call may be pickled to replicas
            infos = await ctx.engine.call(lambda engine: engine.unpin_all(scope))
            return JSONResponse(_list_body(request, [_pin_body(i, block_size, pinned=False) for i in infos]))
        ids = await _prefix_ids(ctx, body)
        salt, tenant = body.cache_salt or "", request.state.tenant
        try:
            info = await ctx.engine.call(lambda engine: engine.unpin(ids, body.num_tokens, salt, tenant))
        except PinNotFoundError as e:
            raise APIError(404, str(e), type="not_found_error", code="pin_not_found") from None
        return JSONResponse(_pin_body(info, block_size, pinned=False))

    @router.get("/cache/pins", openapi_extra=answers(LIST_ANSWER))
    async def list_pins(request: Request) -> Response:
        scope = _scope(request)
        infos = await ctx.engine.call(lambda engine: engine.list_pins(scope))
        return JSONResponse(_list_body(request, [_pin_body(i, block_size, pinned=True) for i in infos]))

    @router.post("/cache/reset", openapi_extra=answers(RESET_ANSWER))
    async def reset_cache(request: Request) -> Response:
        scope = _scope(request)
        num_blocks = await ctx.engine.call(lambda engine: engine.reset_prefix_cache(scope))
        ctx.metrics.on_cache_reset(request.state.tenant)
        return JSONResponse({"reset": True, "num_dropped_blocks": num_blocks, **_scope_fields(request)})

    return router


async def _prefix_ids(ctx: ServingContext, body: _PrefixBody) -> list[int]:
    ctx.check_model(body.model)
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt (text or token ids) and messages", "prompt")
    if body.messages is not None:
        if not body.messages:
            raise bad_request("messages must hold at least one message", "messages")
        return await _encode_messages(ctx, body.messages, "messages")
    assert body.prompt is not None
    return (await ctx.encode(body.prompt, "prompt")).token_ids


def _scope(request: Request) -> str | None:
    """Whose cache state the caller's listings and resets reach: its tenant's, or every tenant's
    (None) for the server key (and for every caller of a server without tenants)."""
    return request.state.tenant or None


def _scope_fields(request: Request) -> dict[str, str]:
    tenant = request.state.tenant
    return {"scope": "tenant", "tenant": tenant} if tenant else {"scope": "engine"}


def _list_body(request: Request, data: list[dict[str, Any]]) -> dict[str, Any]:
    return {"object": "list", **_scope_fields(request), "data": data}


async def _pin(ctx: ServingContext, ids: list[int], body: PinBody, cache: CacheControl) -> PinInfo:
    salt, tenant = cache.salt, cache.tenant
    try:
        return await ctx.engine.call(lambda engine: engine.pin(ids, body.ttl, body.num_tokens, salt, tenant))
    except PinLimitError as e:
        raise APIError(400, str(e), code=PIN_LIMIT_EXCEEDED) from None
    except ValueError as e:
        raise bad_request(str(e), "ttl" if "ttl" in str(e) else "prompt") from None


def _pin_body(info: PinInfo, block_size: int, pinned: bool) -> dict[str, Any]:
    return {"object": "cache.pin", "pinned": pinned, "num_tokens": info.num_tokens,
            "block_keys": [k.hex() for k in info.block_keys], "expires_in": round(info.expires_in_s, 3),
            "device_tokens": info.num_device_blocks * block_size, "tenant": info.tenant or None}


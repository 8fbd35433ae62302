"""Cache control over HTTP: the request fields (``cache_priority``, ``cache_control``) and the
``/v1/cache/pin``, ``/v1/cache/unpin`` and ``/v1/cache/pins`` routes.

A breakpoint on a chat message pins the conversation up to the end of that message: the
messages up to it are rendered without the generation prompt and tokenized, and the pin
covers the full blocks of the tokens that rendering shares with the whole prompt.
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
    bad_request,
    json_body,
    parse_body,
)
from kvserve.server.serving import ServingContext, tenant_salt
from kvserve.server.tools import template_messages

PIN_LIMIT_EXCEEDED = "pin_limit_exceeded"


# -- the request fields -----------------------------------------------------------
def completion_cache(req: CompletionRequest, tenant: str) -> CacheControl | None:
    """The retention class, pin and cache salt of every prompt of a completions call."""
    pins: tuple[PrefixPin, ...] = ()
    if req.cache_control is not None:
        pins = (_prefix_pin(req.cache_control.num_tokens, req.cache_control.ttl, "cache_control"),)
    return _cache_control(req.cache_priority, pins, tenant_salt(tenant, req.cache_salt))


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
    return _cache_control(req.cache_priority, tuple(pins), tenant_salt(tenant, req.cache_salt))


def _cache_control(priority: str | None, pins: tuple[PrefixPin, ...], salt: str) -> CacheControl | None:
    if priority is None and not pins and not salt:
        return None
    return CacheControl(priority=priority or "normal", pins=pins, salt=salt)


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
    """``/cache/pin``, ``/cache/unpin``, ``/cache/pins`` (mounted under ``/v1``)."""
    router = APIRouter()
    block_size = ctx.block_size

    @router.post("/cache/pin", openapi_extra=json_body(PinBody.__name__))
    async def pin(request: Request) -> Response:
        body = parse_body(PinBody, await ctx.read_body(request))
        ids = await _prefix_ids(ctx, body)
        salt = tenant_salt(request.state.tenant, body.cache_salt)
        info = await _pin(ctx, ids, body, salt)
        if body.warm and info.num_device_blocks < len(info.block_keys) and info.num_tokens < ctx.max_model_len:
            # a one-token request over the pinned blocks computes (and so caches) them
            warm = RequestSpec(ids[:info.num_tokens], SamplingParams(max_tokens=1, temperature=0.0),
                               CacheControl(salt=salt))
            await ctx.collect(await ctx.submit([warm], "pin"), request)
            info = await _pin(ctx, ids, body, salt)   # the same pin again: its blocks on the device now
        return JSONResponse(_pin_body(info, block_size, pinned=True))

    @router.post("/cache/unpin", openapi_extra=json_body(UnpinBody.__name__))
    async def unpin(request: Request) -> Response:
        body = parse_body(UnpinBody, await ctx.read_body(request))
        if body.all:
            if body.prompt is not None or body.messages is not None or body.num_tokens is not None:
                raise bad_request("all: true unpins every pin; give no prompt, messages or num_tokens with it", "all")
            namespace = _namespace(request)     # computed here: the call may be pickled to replicas
            infos = await ctx.engine.call(lambda engine: engine.kv.unpin_all(namespace))
            return JSONResponse({"object": "list", "data": [_pin_body(i, block_size, pinned=False) for i in infos]})
        ids = await _prefix_ids(ctx, body)
        try:
            salt = tenant_salt(request.state.tenant, body.cache_salt)
            info = await ctx.engine.call(lambda engine: engine.unpin(ids, body.num_tokens, salt))
        except PinNotFoundError as e:
            raise APIError(404, str(e), type="not_found_error", code="pin_not_found") from None
        return JSONResponse(_pin_body(info, block_size, pinned=False))

    @router.get("/cache/pins")
    async def list_pins(request: Request) -> Response:
        namespace = _namespace(request)
        infos = await ctx.engine.call(lambda engine: engine.kv.list_pins(namespace))
        return JSONResponse({"object": "list", "data": [_pin_body(i, block_size, pinned=True) for i in infos]})

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


def _namespace(request: Request) -> str:
    """The salt prefix of the caller's pins: its tenant's ("" without tenants: every pin)."""
    return tenant_salt(request.state.tenant, None)


async def _pin(ctx: ServingContext, ids: list[int], body: PinBody, salt: str) -> PinInfo:
    try:
        return await ctx.engine.call(lambda engine: engine.pin(ids, body.ttl, body.num_tokens, salt))
    except PinLimitError as e:
        raise APIError(400, str(e), code=PIN_LIMIT_EXCEEDED) from None
    except ValueError as e:
        raise bad_request(str(e), "ttl" if "ttl" in str(e) else "prompt") from None


def _pin_body(info: PinInfo, block_size: int, pinned: bool) -> dict[str, Any]:
    return {"object": "cache.pin", "pinned": pinned, "num_tokens": info.num_tokens,
            "block_keys": [k.hex() for k in info.block_keys], "expires_in": round(info.expires_in_s, 3),
            "device_tokens": info.num_device_blocks * block_size}


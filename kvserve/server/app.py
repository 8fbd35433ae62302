"""The HTTP application: routes, authentication, and errors in the OpenAI shape.

Every failure leaves as ``{"error": {"message", "type", "param", "code"}}``: bad input as
a 4xx naming the problem, an engine failure as 503, anything unexpected as 500 (and
logged). ``/health``, ``/metrics`` and ``/openapi.json`` stay open; everything under ``/v1``
(the cache routes included) needs a key when one is set: the server key, or a tenant's.

Handlers read and validate their bodies themselves (a size limit while reading, strict
models, errors naming the field), so the OpenAPI schema gets the request models from
``_openapi``, not from FastAPI's signature inspection.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, Depends, FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kvserve.engine.engine import LLMEngine
from kvserve.server.async_engine import AsyncEngine, ConstraintFailed, EngineError, RequestFailed
from kvserve.server.cache_api import PinBody, UnpinBody, cache_router
from kvserve.server.chat import create_chat_completion
from kvserve.server.completions import create_completion
from kvserve.server.metrics import CONTENT_TYPE, ServerMetrics
from kvserve.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, ResponsesRequest, json_body
from kvserve.server.responses import create_response
from kvserve.server.serving import ClientGone, ServerSettings, ServingContext, constraint_error, now_s

log = logging.getLogger("kvserve.server")
CLIENT_CLOSED_REQUEST = 499   # nginx's status for a client that left; never seen by that client


def create_app(llm_engine: LLMEngine, settings: ServerSettings) -> FastAPI:
    """The app serving ``llm_engine``; its lifespan starts the engine thread and stops it at
    shutdown. ``app.state.ctx`` is the ``ServingContext`` (tests reach the engine through it)."""
    metrics = ServerMetrics(settings.tenants)
    # the KV figures from start-up: a first snapshot, taken before the engine thread owns the engine
    metrics.on_step(llm_engine.stats(), [], time.monotonic())
    engine = AsyncEngine(llm_engine, metrics)
    return build_app(ServingContext(engine, settings, metrics), engine.start, engine.stop)


def build_app(ctx: ServingContext, start: Callable[[], None], stop: Callable[[], None]) -> FastAPI:
    """The routes, authentication and errors over ``ctx``, whatever engine client it holds (the
    cluster's ingress uses this too); ``start`` and ``stop`` run in the app's lifespan."""
    metrics = ctx.metrics

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        start()
        try:
            yield
        finally:
            stop()

    app = FastAPI(title="kvserve", summary="OpenAI-compatible LLM server with a prefix-cached, tiered KV cache",
                  lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.openapi = lambda: _openapi(app)  # type: ignore[method-assign]
    app.state.ctx = ctx
    _add_error_handlers(app, metrics)

    @app.get("/health")
    async def health() -> Response:
        if not ctx.engine.is_running:
            raise APIError(503, "the engine is not running", type="server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    # HEAD answers as GET does, without the body (load balancers probe with it)
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/metrics", prometheus, methods=["HEAD"], include_in_schema=False)

    app.include_router(_v1_router(ctx))
    return app


def _v1_router(ctx: ServingContext) -> APIRouter:
    async def check_api_key(request: Request) -> None:
        """The caller's tenant in ``request.state.tenant`` ("": the server's own namespace)."""
        request.state.tenant = ""
        if not ctx.settings.requires_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        tenant = ctx.settings.tenant_of(token.strip()) if scheme.lower() == "bearer" else None
        if tenant is None:
            raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           type="authentication_error", code="invalid_api_key")
        request.state.tenant = tenant

    router = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)])
    name = ctx.settings.model_name

    def model_card() -> dict[str, object]:
        return {"id": name, "object": "model", "created": now_s(), "owned_by": "kvserve",
                "max_model_len": ctx.max_model_len}

    @router.get("/models")
    async def list_models() -> Response:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @router.get("/models/{model:path}")
    async def get_model(model: str) -> Response:
        ctx.check_model(model)
        return JSONResponse(model_card())

    @router.post("/completions", openapi_extra=json_body(CompletionRequest.__name__))
    async def completions(request: Request) -> Response:
        return await create_completion(ctx, request)

    @router.post("/chat/completions", openapi_extra=json_body(ChatCompletionRequest.__name__))
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(ctx, request)

    @router.post("/responses", openapi_extra=json_body(ResponsesRequest.__name__))
    async def responses(request: Request) -> Response:
        return await create_response(ctx, request)

    router.include_router(cache_router(ctx))   # /cache/pin, /cache/unpin, /cache/pins, /cache/reset
    return router


_BODY_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest, ResponsesRequest, PinBody,
                                             UnpinBody)
_REF = "#/components/schemas/{model}"


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema of the routes, with the request models (and the models they use)
    added to its components; built once."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version="1", summary=app.summary, routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in _BODY_MODELS], ref_template=_REF)
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        app.openapi_schema = schema
    return app.openapi_schema


def _add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def reply(error: APIError) -> Response:
        metrics.on_error(error.status)
        return JSONResponse(error.body(), status_code=error.status)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return reply(exc)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return reply(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type=kind))

    async def validation_error(request: Request, exc: Exception) -> Response:
        return reply(APIError(400, f"invalid request: {exc}"))

    async def engine_error(request: Request, exc: Exception) -> Response:
        return reply(APIError(503, str(exc), type="server_error"))

    async def request_failed(request: Request, exc: Exception) -> Response:
        return reply(APIError(500, str(exc), type="server_error"))

    async def constraint_failed(request: Request, exc: Exception) -> Response:
        return reply(constraint_error(exc))

    async def client_gone(request: Request, exc: Exception) -> Response:
        return reply(APIError(CLIENT_CLOSED_REQUEST, "the client closed the connection"))

    async def internal_error(request: Request, exc: Exception) -> Response:
        log.exception("unhandled error in %s %s", request.method, request.url.path, exc_info=exc)
        return reply(APIError(500, f"internal server error: {type(exc).__name__}", type="internal_error"))

    app.add_exception_handler(APIError, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(EngineError, engine_error)
    app.add_exception_handler(RequestFailed, request_failed)
    app.add_exception_handler(ConstraintFailed, constraint_failed)
    app.add_exception_handler(ClientGone, client_gone)
    app.add_exception_handler(Exception, internal_error)

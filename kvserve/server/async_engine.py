r"""An asynchronous front on ``LLMEngine``: one thread owns the engine, asyncio tasks talk to it.

```
 event loop (HTTP handlers)                 engine thread (owns LLMEngine)
 submit() --- _Add ----\                    loop: drain commands (block when idle)
 abort()  --- _Abort ---+--> SimpleQueue -->       apply them (add / abort / call)
 call(fn) --- _Call ----/                          step() while there is work
 RequestStream <-- call_soon_threadsafe <--        publish outputs, observer.on_step(stats)
```

``LLMEngine`` is not thread-safe, so nothing but the engine thread touches it; the rest
of the server holds a ``RequestStream`` (an asyncio queue of outputs) per HTTP request.
Requests of every connection share one engine and so batch together continuously.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol, TypeVar

from kvserve.cache_control import CacheControl
from kvserve.engine.engine import LLMEngine
from kvserve.engine.model_card import ModelCard
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.stats import EngineStats
from kvserve.request import BlendSpec, EncodedPrompt, ErrorKind, Resumed
from kvserve.sampling_params import SamplingParams

log = logging.getLogger("kvserve.server")
T = TypeVar("T")
IDLE_POLL_S = 0.005   # wait when the engine has requests but could schedule none this step


class EngineError(RuntimeError):
    """The engine failed (or stopped) while running a request; not the client's fault."""


class RequestFailed(RuntimeError):
    """One request failed while generating (``RequestOutput.error``); the engine and the
    other requests go on. Not the client's fault."""


class ConstraintFailed(RequestFailed):
    """One request's output constraint failed while generating (``error_kind`` "constraint":
    the grammar it brought hit a limit, or rejected its tokens): the client's input, found late.
    ``item`` is that request's last output (``finish_reason`` "error")."""

    def __init__(self, item: StreamItem) -> None:
        out = item.output
        super().__init__(f"{out.error}; the request ended after {len(out.token_ids)} generated tokens "
                         f"(finish_reason \"error\")")
        self.item = item


class EngineObserver(Protocol):
    """Called on the engine thread only, once per step (and after a batch of commands
    when the engine is idle). Must be quick: it delays the next step."""

    def on_step(self, stats: EngineStats, outputs: list[RequestOutput], now: float) -> None: ...

    def on_abort(self, request_id: str) -> None: ...


class NullObserver:
    def on_step(self, stats: EngineStats, outputs: list[RequestOutput], now: float) -> None:
        pass

    def on_abort(self, request_id: str) -> None:
        pass


class Aborter(Protocol):
    """Whoever runs a stream's requests: ``abort`` is thread-safe and ignores finished ids."""

    def abort(self, request_ids: list[str]) -> None: ...


class RequestSpec(NamedTuple):
    prompt_token_ids: list[int]
    params: SamplingParams
    cache: CacheControl | None = None      # retention class and pinned prefixes
    blend: BlendSpec | None = None         # the prompt's segments, reused by blending (kvserve/blend/)
    resume: Resumed | None = None          # output already streamed (a replica died: kvserve/cluster/)

    @property
    def prompt(self) -> EncodedPrompt:
        return EncodedPrompt(self.prompt_token_ids, self.blend)


class StreamItem(NamedTuple):
    choice: int             # which of the HTTP request's engine requests (choice order)
    output: RequestOutput


@dataclass
class _Route:
    """Where an engine request's outputs go (owned by the engine thread)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StreamItem | BaseException]
    choice: int


@dataclass
class _Add:
    request_ids: list[str]
    specs: list[RequestSpec]
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[StreamItem | BaseException]
    accepted: asyncio.Future[None]


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    fn: Callable[[LLMEngine], Any]
    done: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop


_STOP = object()


def _settle(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[Any],
            result: Any = None, error: BaseException | None = None) -> None:
    def settle() -> None:
        if fut.done():   # the awaiting handler was cancelled
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    try:
        loop.call_soon_threadsafe(settle)
    except RuntimeError:   # the loop is closed: nobody waits any more
        pass


@dataclass
class RequestStream:
    """The outputs of one HTTP request's engine requests, in arrival order.

    Iterate it for ``StreamItem``s until every request has finished; ``close()`` (always,
    in a ``finally``) aborts those that have not, e.g. when the client went away.
    """

    engine: Aborter            # the AsyncEngine, or a cluster's client (kvserve/cluster/client.py)
    request_ids: list[str]
    queue: asyncio.Queue[StreamItem | BaseException]
    finished: set[int] = field(default_factory=set)

    async def __aiter__(self) -> AsyncIterator[StreamItem]:
        async for item in self.outputs():
            if item.output.finished and item.output.error is not None:
                if item.output.error_kind == ErrorKind.CONSTRAINT.value:
                    raise ConstraintFailed(item)
                raise RequestFailed(f"the request failed while generating: {item.output.error}")
            yield item

    async def outputs(self) -> AsyncIterator[StreamItem]:
        """Every item, a failed request's last output (``error`` set) included: what an
        engine replica forwards, so that the ingress's stream fails that request alone."""
        while len(self.finished) < len(self.request_ids):
            batch = [await self.queue.get()]
            while not self.queue.empty():
                batch.append(self.queue.get_nowait())
            # an output holds everything earlier ones did (full text, tokens, logprobs), so a
            # reader that fell behind skips to the latest output of each request
            latest: dict[int, StreamItem] = {}
            for item in batch:
                if isinstance(item, BaseException):
                    raise item
                latest[item.choice] = item
            for item in latest.values():
                if item.output.finished:
                    self.finished.add(item.choice)
                yield item

    def close(self) -> None:
        pending = [rid for i, rid in enumerate(self.request_ids) if i not in self.finished]
        if pending:
            self.engine.abort(pending)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, observer: EngineObserver | None = None) -> None:
        self.engine = engine
        self._observer: EngineObserver = observer if observer is not None else NullObserver()
        self._commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._routes: dict[str, _Route] = {}     # engine thread only
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the engine thread is already running")
        self._thread = threading.Thread(target=self._run, name="kvserve-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Fail what is in flight with EngineError and end the thread."""
        if self._thread is None:
            return
        self._commands.put(_STOP)
        self._thread.join(timeout_s)
        self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def model_card(self) -> ModelCard:
        return self.engine.model_card

    # -- verbs for the event loop ------------------------------------------
    async def submit(self, specs: list[RequestSpec], prefix: str = "req") -> RequestStream:
        """Queue requests that succeed or fail together. Raises ValueError (engine
        untouched) for input the engine rejects; the caller should validate first, so
        this is a last line of defence."""
        if not self.is_running:
            raise EngineError("the engine is not running")
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[StreamItem | BaseException] = asyncio.Queue()
        base = next(self._ids)
        ids = [f"{prefix}-{base}-{i}" for i in range(len(specs))]
        accepted: asyncio.Future[None] = loop.create_future()
        self._commands.put(_Add(ids, specs, loop, q, accepted))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(ids)   # accepted or not: make sure nothing runs for nobody
            raise
        return RequestStream(self, ids, q)

    def abort(self, request_ids: list[str]) -> None:
        """Thread-safe; aborting a finished or unknown request does nothing."""
        self._commands.put(_Abort(list(request_ids)))

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run ``fn(engine)`` on the engine thread between steps; its result or exception."""
        if not self.is_running:
            raise EngineError("the engine is not running")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[T] = loop.create_future()
        self._commands.put(_Call(fn, done, loop))
        return await done

    # -- the engine thread -------------------------------------------------
    def _run(self) -> None:
        while True:
            try:
                if not self._run_once():
                    return
            except Exception as e:   # a bug: fail the requests in flight, keep serving
                log.exception("engine failed; failing %d requests", len(self._routes))
                self._fail_all(EngineError(f"the engine failed: {type(e).__name__}: {e}"))

    def _run_once(self) -> bool:
        """Apply the pending commands, then one step if there is work; False on stop."""
        engine = self.engine
        commands = self._drain(block=not engine.has_unfinished)
        for cmd in commands:
            if cmd is _STOP:
                self._fail_all(EngineError("the server is shutting down"))
                return False
            self._apply(cmd)
        if not engine.has_unfinished:
            if commands:
                self._observe([])
            return True
        steps = engine.num_steps
        outputs = engine.step()
        self._publish(outputs)
        self._observe(outputs)
        if engine.num_steps == steps and not outputs:
            time.sleep(IDLE_POLL_S)   # nothing could be scheduled: do not spin
        return True

    def _drain(self, block: bool) -> list[Any]:
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, cmd: Any) -> None:
        if isinstance(cmd, _Abort):
            for rid in cmd.request_ids:
                if self._routes.pop(rid, None) is not None:
                    self.engine.abort(rid)
                    self._observer.on_abort(rid)
        elif isinstance(cmd, _Add):
            self._add(cmd)
        elif isinstance(cmd, _Call):
            try:
                _settle(cmd.loop, cmd.done, cmd.fn(self.engine))
            except Exception as e:  # noqa: BLE001 - handed to the awaiting caller
                _settle(cmd.loop, cmd.done, error=e)

    def _add(self, cmd: _Add) -> None:
        added: list[str] = []
        try:
            for rid, spec in zip(cmd.request_ids, cmd.specs):
                self.engine.add_request(spec.prompt, spec.params, request_id=rid, cache=spec.cache,
                                        resume=spec.resume)
                added.append(rid)
        except Exception as e:
            for rid in added:
                self.engine.abort(rid)
            bad_input = isinstance(e, (ValueError, TypeError))
            if not bad_input:
                log.exception("add_request failed")
            _settle(cmd.loop, cmd.accepted,
                    error=ValueError(str(e)) if bad_input else EngineError(f"the engine failed: {e}"))
            return
        for i, rid in enumerate(added):
            self._routes[rid] = _Route(cmd.loop, cmd.queue, i)
        _settle(cmd.loop, cmd.accepted)

    def _publish(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Route, StreamItem | BaseException]]] = {}
        for out in outputs:
            route = self._routes.pop(out.request_id) if out.finished else self._routes.get(out.request_id)
            if route is not None:
                by_loop.setdefault(route.loop, []).append((route, StreamItem(route.choice, out)))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass   # the loop is closed

    def _fail_all(self, error: BaseException) -> None:
        routes, self._routes = self._routes, {}
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Route, StreamItem | BaseException]]] = {}
        for rid, route in routes.items():
            try:
                self.engine.abort(rid)
                self._observer.on_abort(rid)
            except Exception:   # the engine is broken already; the error is logged
                log.exception("abort of %s failed", rid)
            by_loop.setdefault(route.loop, []).append((route, error))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver, items)
            except RuntimeError:
                pass
        self._observe([])

    def _observe(self, outputs: list[RequestOutput]) -> None:
        try:
            self._observer.on_step(self.engine.stats(), outputs, time.monotonic())
        except Exception:   # metrics must never take the engine down
            log.exception("engine observer failed")


def _deliver(items: list[tuple[_Route, StreamItem | BaseException]]) -> None:
    for route, item in items:
        route.queue.put_nowait(item)

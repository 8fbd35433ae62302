"""``ReplicaClient``: the ingress's engine client; kvserve/server's handlers run through it.

```
 handler --submit(specs)--> route (RouteHint: the prompt's and its segments' block digests) via the handle
            |                 KVAwareRouter picks a replica; its stream answers Accepted
            |                 or Rejected (-> ValueError, a 400) before submit returns
            `--> RequestStream <-- a task moves the replica's StreamItems into its queue
 replica dies: the task sends the requests not finished again, to another replica (the
   dead one excluded), at most ``max_attempts`` times in all; one that had streamed goes
   with the tokens (and logprobs) it streamed (``RequestSpec.resume``), and continues from
   there: its KV is found in the shared tier (write-through) or computed with the prompt's,
   and the client reads one stream (the same greedy tokens: prefix hits are exact). A
   request that cannot go on fails with EngineError (503 / an error event), counted as
   ``error``
 abort(ids) (client gone) --> cancel the task --> Serve cancels the replica's stream --> abort
```
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from ray.exceptions import ActorUnavailableError, RayActorError, RayTaskError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator

from kvserve.cluster.metrics import FleetMetrics
from kvserve.cluster.wire import Accepted, Rejected, RouteHint, key_tag, route_hint
from kvserve.engine.engine import LLMEngine
from kvserve.engine.model_card import ModelCard
from kvserve.engine.outputs import RequestOutput
from kvserve.request import Resumed
from kvserve.server.async_engine import EngineError, RequestSpec, RequestStream, StreamItem

log = logging.getLogger("kvserve.cluster")
T = TypeVar("T")
REPLICA_GONE = (RayActorError, ActorUnavailableError, ReplicaUnavailableError)


class ReplicaClient:
    def __init__(self, handle: DeploymentHandle, card: ModelCard, fleet: FleetMetrics, max_attempts: int = 3) -> None:
        self._handle = handle
        self._generate = handle.options(method_name="generate", stream=True)
        self._card = card
        self._tag = key_tag(card.extra_key)
        self.fleet = fleet
        self.max_attempts = max_attempts
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._running = False

    @property
    def model_card(self) -> ModelCard:
        return self._card

    @property
    def is_running(self) -> bool:
        return self._running

    def start(self) -> None:
        self._running = True
        self.fleet.start(self._handle)

    def stop(self) -> None:
        self._running = False
        self.fleet.stop()
        for task in list(self._tasks.values()):
            task.cancel()

    async def submit(self, specs: list[RequestSpec], prefix: str = "req") -> RequestStream:
        if not self._running:
            raise EngineError("the cluster client is not running")
        prefix = f"{prefix}-{uuid.uuid4().hex[:12]}"     # engine ids unique across replicas
        ids = [f"{prefix}-{i}" for i in range(len(specs))]    # the ids its outputs carry here, whatever replica
        hint = route_hint(self._card, self._tag, specs[0])
        queue: asyncio.Queue[StreamItem | BaseException] = asyncio.Queue()
        accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.ensure_future(self._run(hint, specs, prefix, ids, queue, accepted))
        for rid in ids:
            self._tasks[rid] = task

        def forget(_: asyncio.Task[None]) -> None:
            for rid in ids:
                self._tasks.pop(rid, None)
        task.add_done_callback(forget)
        try:
            await accepted
        except BaseException:
            task.cancel()
            raise
        return RequestStream(self, ids, queue)

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            task = self._tasks.pop(rid, None)
            if task is not None and not task.done():    # a done task's requests ended (counted there)
                task.cancel()
                self.fleet.server.on_abort(rid)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """``fn(engine)`` on every replica (pins, resets, checks: the fleet stays alike). An int
        answer (a count of blocks) is summed over the fleet; any other is the first replica's.
        An error ``fn`` raises is raised here as itself, not as Ray's wrapper."""
        try:
            results = await self._handle.broadcast("call", fn).results_async()
        except RayTaskError as e:        # fn's own error (a ValueError is the client's 400), unwrapped
            if isinstance(e.cause, Exception):
                raise e.cause from None
            raise
        if not results:
            raise EngineError("no engine replica is running")
        if all(isinstance(r, int) and not isinstance(r, bool) for r in results):
            return sum(results)
        return results[0]

    async def _run(self, hint: RouteHint, specs: list[RequestSpec], prefix: str, ids: list[str],
                   queue: asyncio.Queue[StreamItem | BaseException], accepted: asyncio.Future[None]) -> None:
        start = time.monotonic()
        finished: set[int] = set()
        last: dict[int, RequestOutput] = {}         # each choice's latest output relayed
        started = False
        todo = list(range(len(specs)))              # the choices the attempt's specs stand for
        attempt_specs = specs

        def fail(error: Exception) -> None:
            """End the stream with ``error``; requests it ends unfinished count as ``error``."""
            was_accepted = accepted.done()
            _fail(accepted, queue, error)
            if was_accepted:
                for choice in range(len(specs)):
                    if choice not in finished:
                        self.fleet.server.on_failed(ids[choice])

        for attempt in range(1, self.max_attempts + 1):
            replica: str | None = None
            stream: DeploymentResponseGenerator[object] = self._generate.remote(hint, attempt_specs, prefix)  # type: ignore[assignment]
            try:
                async for item in stream:
                    if isinstance(item, Rejected):
                        fail(ValueError(item.message) if not accepted.done()
                             else EngineError(f"a retry was refused: {item.message}"))
                        return
                    if isinstance(item, Accepted):
                        replica = item.replica
                        _settle(accepted)
                        continue
                    assert isinstance(item, StreamItem)
                    choice = todo[item.choice]
                    # one id per request here, whichever replica (and attempt) produced the output
                    output = replace(item.output, request_id=ids[choice])
                    if not started:
                        started = True
                        self.fleet.on_first_output(hint, replica, time.monotonic() - start)
                    self.fleet.server.observe_outputs([output], time.monotonic())
                    last[choice] = output
                    queue.put_nowait(StreamItem(choice, output))
                    if output.finished:
                        finished.add(choice)
                if len(finished) < len(specs):   # the stream ended early: nothing more will come
                    fail(EngineError(f"engine replica {replica} ended the stream early"))
                return
            except asyncio.CancelledError:
                stream.cancel()
                raise
            except REPLICA_GONE as e:
                failed = replica or hint.routed_to
                self.fleet.on_replica_failure(failed, retried=attempt < self.max_attempts, resumed=started)
                if attempt == self.max_attempts:
                    fail(EngineError(f"engine replica {failed} failed: {type(e).__name__}"))
                    return
                log.warning("engine replica %s failed on %s (%s); sending %s elsewhere", failed, prefix,
                            type(e).__name__, "what it had not finished" if started else "it")
                if failed is not None:
                    hint.exclude = hint.exclude | {failed}
                hint.holder, hint.routed_to = None, None
                todo = [c for c in range(len(specs)) if c not in finished]
                attempt_specs = [_resumed(specs[c], last.get(c)) for c in todo]
            except DeploymentUnavailableError as e:
                fail(EngineError(f"no engine replica is available: {e}"))
                return
            except Exception as e:
                log.exception("engine replica %s failed on %s", replica, prefix)
                fail(EngineError(f"the engine failed: {type(e).__name__}: {e}"))
                return


def _resumed(spec: RequestSpec, output: RequestOutput | None) -> RequestSpec:
    """``spec`` to send again, going on from ``output`` (what it streamed) when there is one."""
    if output is None or not output.token_ids:
        return spec
    return spec._replace(blend=None, resume=Resumed(tuple(output.token_ids), tuple(output.logprobs or ())))


def _settle(fut: asyncio.Future[None], error: BaseException | None = None) -> None:
    if fut.done():
        return
    if error is None:
        fut.set_result(None)
    else:
        fut.set_exception(error)


def _fail(accepted: asyncio.Future[None], queue: asyncio.Queue[StreamItem | BaseException],
          error: Exception) -> None:
    if accepted.done():
        queue.put_nowait(error)
    else:
        accepted.set_exception(error)



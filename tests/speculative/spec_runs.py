"""Running a batch of requests to the end through an engine, checked after every step (the
speculative decoding tests share it)."""

from __future__ import annotations

from collections.abc import Callable

from kvserve.engine.engine import LLMEngine
from kvserve.engine.outputs import RequestOutput
from kvserve.sampling_params import SamplingParams


def run_all(engine: LLMEngine, work: list[tuple[list[int], SamplingParams]], abort_at: dict[int, str] | None = None,
            check: Callable[[LLMEngine], None] | None = None) -> dict[str, RequestOutput]:
    """Requests ``r0, r1, ...`` to the end; after every step the engine's integrity and
    ``check(engine)``; ``abort_at``: step -> the request id to abort then. Finished outputs by id."""
    ids = [engine.add_request(p, sp, request_id=f"r{i}") for i, (p, sp) in enumerate(work)]
    done: dict[str, RequestOutput] = {}
    step = 0
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        engine.check_integrity()
        if check is not None:
            check(engine)
        step += 1
        if abort_at and step in abort_at:
            engine.abort(abort_at[step])
    assert set(done) | set((abort_at or {}).values()) == set(ids)
    return done

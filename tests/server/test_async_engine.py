"""The engine thread and its asyncio front, without HTTP."""

from __future__ import annotations

import asyncio

import pytest

from kvserve.engine.engine import LLMEngine
from kvserve.llm import engine_config
from kvserve.sampling_params import SamplingParams
from kvserve.server.async_engine import AsyncEngine, EngineError, RequestSpec
from kvserve.server.metrics import ServerMetrics

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(default_model):
    metrics = ServerMetrics()
    e = AsyncEngine(LLMEngine(engine_config(None, num_kv_blocks=16, max_model_len=512), default_model), metrics)
    e.start()
    yield e
    e.stop()


def spec(engine: AsyncEngine, text: str, params: SamplingParams = GREEDY) -> RequestSpec:
    return RequestSpec(engine.engine.encode_prompt(text), params)


async def drain(engine: AsyncEngine, specs: list[RequestSpec]):
    stream = await engine.submit(specs)
    try:
        return [item async for item in stream]
    finally:
        stream.close()


def test_requests_stream_their_outputs_and_finish(engine):
    items = asyncio.run(drain(engine, [spec(engine, "Hello there"), spec(engine, "One, two,")]))
    for choice in (0, 1):
        outs = [i.output for i in items if i.choice == choice]
        lengths = [len(o.token_ids) for o in outs]
        assert lengths == sorted(set(lengths)) and lengths[-1] == 3   # a slow reader may skip outputs
        assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert asyncio.run(engine.call(lambda e: e.has_unfinished)) is False


def test_rejected_input_raises_value_error_and_adds_nothing(engine):
    too_big = RequestSpec(list(range(10, 310)), SamplingParams(max_tokens=1))   # > 16 blocks of 16
    with pytest.raises(ValueError, match="KV blocks"):
        asyncio.run(drain(engine, [spec(engine, "fine"), too_big]))
    assert asyncio.run(engine.call(lambda e: (e.has_unfinished, e.kv.num_free_blocks))) == (False, 16)


def test_a_failing_step_fails_its_requests_and_the_engine_keeps_serving(engine, monkeypatch):
    real_step = engine.engine.step
    calls = {"n": 0}

    def flaky_step():
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("boom")
        return real_step()

    monkeypatch.setattr(engine.engine, "step", flaky_step)
    with pytest.raises(EngineError, match="boom"):
        asyncio.run(drain(engine, [spec(engine, "Hello")]))
    items = asyncio.run(drain(engine, [spec(engine, "Hello again")]))
    assert items[-1].output.finished
    asyncio.run(engine.call(lambda e: e.check_integrity()))


def test_call_returns_results_and_raises_errors(engine):
    assert asyncio.run(engine.call(lambda e: e.kv.num_blocks)) == 16
    with pytest.raises(ZeroDivisionError):
        asyncio.run(engine.call(lambda e: 1 / 0))


def test_stop_fails_requests_in_flight(default_model):
    engine = AsyncEngine(LLMEngine(engine_config(None, num_kv_blocks=16, max_model_len=512), default_model))
    engine.start()

    async def run() -> None:
        stream = await engine.submit([spec(engine, "Hi", SamplingParams(max_tokens=200, ignore_eos=True))])
        async for _ in stream:
            engine.stop()   # from the loop thread: joins the engine thread, which fails the stream first

    with pytest.raises(EngineError, match="shutting down"):
        asyncio.run(run())
    assert not engine.is_running

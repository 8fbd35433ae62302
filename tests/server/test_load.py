"""A scaled-down ``kvserve bench serve``: 32 streaming clients at once, every response checked."""

from __future__ import annotations

import asyncio

import pytest
from live_server import MODEL, running_server

from kvserve.bench.common import find_text
from kvserve.bench.serve import make_jobs, run_load


@pytest.fixture(scope="module")
def server(default_model):
    with running_server(default_model, num_kv_blocks=256, max_model_len=1024) as s:
        yield s


def test_32_concurrent_streaming_clients_no_errors(server, default_model):
    jobs = make_jobs(default_model.tokenizer, find_text(), num_requests=64, max_tokens=4, model=MODEL,
                     doc_words=(20, 60, 120))
    result = asyncio.run(run_load(server.url, jobs, concurrency=32, deadline_s=90))
    assert result.errors == [] and result.num_ok == 64
    assert result.cached_tokens > 0                                        # shared documents hit
    assert server.metric("kvserve_engine_steps_total") < 64 * 4            # requests shared steps
    server.wait_idle()
    server.ctx.engine.engine.check_integrity()

"""A real server for the tests: uvicorn in a background thread on a free loopback port."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

from kvserve.engine.engine import LLMEngine
from kvserve.llm import engine_config
from kvserve.model.loader import DEFAULT_MODEL, LoadedModel
from kvserve.server.app import create_app
from kvserve.server.serving import ServerSettings, ServingContext

MODEL = DEFAULT_MODEL
# small enough to start fast, big enough for every test's prompts
ENGINE_OPTIONS: dict[str, Any] = {"num_kv_blocks": 64, "max_model_len": 512}


@dataclass(frozen=True)
class Server:
    url: str            # http://127.0.0.1:PORT
    app: FastAPI

    @property
    def ctx(self) -> ServingContext:
        return self.app.state.ctx

    def metric(self, name: str) -> float:
        """One sample of /metrics by its full name with labels, e.g. 'kvserve_requests_total{finish_reason="abort"}'."""
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        return 0.0

    def wait_idle(self, timeout_s: float = 10.0) -> None:
        """Until the engine runs nothing and no KV block is referenced."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (self.metric("kvserve_num_requests_running") == 0 and self.metric("kvserve_num_requests_waiting") == 0
                    and self.metric("kvserve_kv_cache_usage_ratio") == 0):
                return
            time.sleep(0.05)
        raise AssertionError("the engine did not become idle")


@contextmanager
def running_server(loaded: LoadedModel, api_key: str | None = None, clock: Callable[[], float] | None = None,
                   tenant_keys: dict[str, str] | None = None, **options: Any) -> Iterator[Server]:
    """``clock``: the engine's, for pin retention times (default: monotonic); ``tenant_keys``:
    key -> tenant (ServerSettings)."""
    config = engine_config(None, **{**ENGINE_OPTIONS, **options})
    engine = LLMEngine(config, loaded) if clock is None else LLMEngine(config, loaded, clock=clock)
    app = create_app(engine, ServerSettings(model_name=MODEL, api_key=api_key, tenant_keys=tenant_keys or {}))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))   # a free port, chosen now, never exposed beyond loopback
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the test server did not start")
        time.sleep(0.02)
    try:
        yield Server(f"http://127.0.0.1:{sock.getsockname()[1]}", app)
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()

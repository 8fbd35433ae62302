"""Session-wide fixtures shared by every test folder."""

from __future__ import annotations

import os

# Under pytest-xdist (the README's `-n 2`) the workers share the machine's cores: each gets its
# share of OpenMP threads, set before torch loads its OpenMP runtime (which reads it once).
# Two workers at two threads each on two cores spin against each other and run slower than
# one process (measured on the 2-core host: 44% of the tests in 15 min, where one process runs
# them all in 14.3; at one thread each, all in 9 min).
if workers := os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // int(workers))))

from collections.abc import Iterator
from typing import Any, NamedTuple

import pytest
from offload.redis_server import RedisServer

from kvserve.model.loader import LoadedModel, default_model_path, load_model


class HFReference(NamedTuple):
    """transformers' own load of the default GGUF, the reference our loader is checked against."""

    model: Any  # transformers LlamaForCausalLM, float32, eval mode
    tokenizer: Any  # transformers tokenizer built from the same GGUF


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """The default SmolLM2 GGUF through our loader. Uses the user cache dir
    (``$KVSERVE_CACHE_DIR`` or ``~/.cache/kvserve``), so only the first run ever pays the
    conversion (~8 s); later runs load in well under a second."""
    return load_model()


@pytest.fixture(scope="session")
def hf_gguf_reference() -> HFReference:
    """transformers' GGUF load of the default model (~25 s on 2 cores, hence session scope)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return HFReference(model=model.eval(), tokenizer=tokenizer)


@pytest.fixture
def redis_server(tmp_path) -> Iterator[RedisServer]:
    """A throwaway redis-server on a free loopback port (skips when none is installed): the
    offload tests' Redis tier and the cluster's shared one."""
    srv = RedisServer(tmp_path)
    srv.start()
    yield srv
    srv.stop()

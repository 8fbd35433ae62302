"""Real keys and values of the default model (SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from kvserve import LLM, SamplingParams

BOTCHAN = Path(__file__).resolve().parents[3] / "kvserve" / "data" / "botchan.txt"   # the shipped evaluation text
NUM_BLOCKS = 19       # 304 prompt tokens: 19 full blocks of 16


@contextmanager
def torch_threads(num_threads: int) -> Iterator[None]:
    """Codec tests run on one thread: their tensors are small, and on a busy 2-core
    machine OpenMP's barriers across two threads made this folder ~8x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class RealKV(NamedTuple):
    keys: list[torch.Tensor]    # per layer [NUM_BLOCKS, 16, 3, 64] float32
    values: list[torch.Tensor]


@pytest.fixture(scope="session")
def real_kv(default_model) -> RealKV:
    """The KV of 304 tokens of Botchan: on a fresh engine the first request's blocks are
    0..n-1 in order, so the first n rows of each layer's cache hold it."""
    if not BOTCHAN.exists():
        pytest.skip(f"evaluation text {BOTCHAN} not found")
    llm = LLM(kv_format="native", loaded=default_model, kv_cache_memory_gb=0.05)
    text = BOTCHAN.read_text(encoding="utf-8")[:4000]
    ids = llm.tokenizer.encode(text)[:NUM_BLOCKS * 16]
    assert len(ids) == NUM_BLOCKS * 16
    with torch_threads(1):
        llm.generate(ids, SamplingParams(max_tokens=1))
    cache = llm.engine.runner.cache
    return RealKV([k[:NUM_BLOCKS].clone() for k in cache.key_caches],
                  [v[:NUM_BLOCKS].clone() for v in cache.value_caches])


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    with torch_threads(1):
        yield

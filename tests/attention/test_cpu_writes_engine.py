"""The engine with the C++ quantize-on-write (tiny model: head_dim 16, so groups of 8): the
same greedy tokens and the same cache bytes as with the torch writes, in every format, and a
prefix hit still gives the tokens of a cold run."""

from __future__ import annotations

import random

import pytest
import torch
from tiny import tiny_model

from kvserve import LLM, SamplingParams
from kvserve.attention import cpu
from kvserve.attention.cpu_writes import CpuWrites
from kvserve.kv.codecs import fp8_supported

pytestmark = pytest.mark.skipif(not cpu.is_available(), reason="the C++ CPU extension cannot be built here")

FORMATS = ["native", "fp16", "bf16", "fp8", "int8", "int4g8", "kivi4g8", "kivi2g8", "int8+had", "int4g8+out2",
           "kivi2g8+had+out2", "fp8+had+out2", "0=fp16;1-=kivi2g8", "k=int8,v=int4g8"]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded():
    return tiny_model()


@pytest.fixture
def layer_writes(monkeypatch) -> list[int]:
    """Counts the C++ writes (one per layer and forward pass)."""
    calls: list[int] = []
    original = CpuWrites.write

    def counting(self, layer, *args, **kwargs):
        calls.append(layer)
        original(self, layer, *args, **kwargs)

    monkeypatch.setattr(CpuWrites, "write", counting)
    return calls


def prompts(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    shared = [rng.randrange(128) for _ in range(35)]
    return [shared + [rng.randrange(128) for _ in range(n)] for n in (1, 9, 20, 31)] + [[3, 4, 5]]


def skip_without_fp8(fmt: str) -> None:
    if "fp8" in fmt and not fp8_supported():
        pytest.skip(f"torch {torch.__version__} has no float8_e4m3fn")


def engine(loaded, fmt: str, **kwargs) -> LLM:
    return LLM(loaded=loaded, kv_format=fmt, num_kv_blocks=64, max_num_batched_tokens=24, attention_backend="cpu",
               **kwargs)


@pytest.mark.parametrize("fmt", FORMATS)
def test_cpu_writes_give_the_torch_writes_tokens_and_bytes(loaded, fmt, monkeypatch, layer_writes):
    skip_without_fp8(fmt)
    # chunked prefills over cached context, decodes and a prefix hit, in one batch
    kernel = engine(loaded, fmt)
    kernel.generate(prompts()[:1], GREEDY)
    got = kernel.generate(prompts(), GREEDY)
    assert layer_writes and set(layer_writes) == {0, 1}
    monkeypatch.setattr(CpuWrites, "for_storage", lambda *args: None)   # storages built now write in torch
    torch_writes = engine(loaded, fmt)
    torch_writes.generate(prompts()[:1], GREEDY)
    count = len(layer_writes)
    ref = torch_writes.generate(prompts(), GREEDY)
    assert len(layer_writes) == count
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    for a, b in zip(kernel.engine.runner.cache.block_tensors(), torch_writes.engine.runner.cache.block_tensors()):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    kernel.engine.check_integrity()


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_prefix_hit_gives_the_tokens_of_a_cold_run(loaded, fmt, backend, layer_writes):
    skip_without_fp8(fmt)
    cold = LLM(loaded=loaded, kv_format=fmt, enable_prefix_caching=False, num_kv_blocks=64, attention_backend=backend)
    warm = LLM(loaded=loaded, kv_format=fmt, num_kv_blocks=64, attention_backend=backend)
    ref = cold.generate(prompts(), GREEDY)
    warm.generate(prompts()[:2], GREEDY)
    got = warm.generate(prompts(), GREEDY)
    assert layer_writes
    assert [o.token_ids for o in got] == [o.token_ids for o in ref]
    assert [o.num_cached_tokens for o in got] == [32, 32, 32, 32, 0]
    warm.engine.check_integrity()
    assert warm.engine.kv.residual.num_free_rows == warm.engine.kv.residual.num_rows

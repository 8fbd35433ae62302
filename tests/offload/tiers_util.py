"""Shared pieces of the engine-with-tiers tests: a tiny model, an 8-block device pool.

A "filler" prompt of 127 tokens takes every device block, so whatever was cached
before is evicted (and demoted).
"""

from __future__ import annotations

import random
import threading

from kvserve import LLM, SamplingParams
from kvserve.kv.tiering import OffloadTiering

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
FILL = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
POOL = 8            # device blocks of 16 tokens
PROMPT = [random.Random(1).randrange(128) for _ in range(70)]   # 4 full blocks + 6 tokens
PROMPT_HIT = 64     # a hit covers the 4 full blocks (the last token is always computed)
MIB = 1 / 1024      # in GiB

_cold: dict[tuple, list[int]] = {}


class TickTimer:
    """A timer for the cost model's measurements that reads no clock: each call on a thread
    moves that thread's time on by one tick, so a span timed on one thread lasts one tick
    more than the calls made inside it on that thread. A model step (no calls inside) is one
    tick, a tier read one tick plus whatever its transport ticks: the same on any machine."""

    def __init__(self, tick_s: float = 1e-3) -> None:
        self.tick_s = tick_s
        self._local = threading.local()

    def __call__(self) -> float:
        self._local.now = getattr(self._local, "now", 0.0) + self.tick_s
        return self._local.now


def cold_tokens(loaded, kv_format: str = "native", prompt: list[int] = PROMPT) -> list[int]:
    return cold_batch(loaded, [prompt], kv_format)[0]


def cold_batch(loaded, prompts: list[list[int]], kv_format: str = "native",
               params: SamplingParams = GREEDY) -> list[list[int]]:
    """Greedy tokens of a run without any cache, memoized."""
    todo = [p for p in prompts if (kv_format, params.max_tokens, *p) not in _cold]
    if todo:
        llm = LLM(loaded=loaded, kv_format=kv_format, enable_prefix_caching=False)
        for p, out in zip(todo, llm.generate(todo, params)):
            _cold[(kv_format, params.max_tokens, *p)] = out.token_ids
    return [_cold[(kv_format, params.max_tokens, *p)] for p in prompts]


def filler(seed: int) -> list[int]:
    """8 blocks (less one token) of tokens no test prompt shares."""
    rng = random.Random(1000 + seed)
    return [rng.randrange(128) for _ in range(POOL * 16 - 1)]


def evict_everything(llm: LLM, seed: int = 0) -> None:
    llm.generate(filler(seed), FILL)
    offload(llm).flush()


def offload(llm: LLM) -> OffloadTiering:
    assert isinstance(llm.engine.kv._tiering, OffloadTiering)
    return llm.engine.kv._tiering

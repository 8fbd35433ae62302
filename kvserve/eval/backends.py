"""What the harness evaluates: one KV configuration behind a small interface.

Two implementations: ``KVServeBackend`` (the engine with a KV format) and
``HFBackend`` in ``hf_baseline.py`` (transformers with a cache class).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any, NamedTuple, Protocol

from kvserve.kv.storage.quantized import QuantizedKVCache
from kvserve.llm import LLM
from kvserve.model.loader import LoadedModel
from kvserve.sampling_params import SamplingParams

# Storage is averaged over this many consecutive sequence lengths: one full cycle of
# transformers' full-precision residual (128 tokens), eight kvserve blocks.
STORAGE_CYCLE_TOKENS = 128


class StorageCost(NamedTuple):
    bytes_per_token: float          # compressed storage only (full blocks / quantized tensors)
    bytes_per_token_at_context: float  # everything a sequence of ~context tokens holds, residual included
    context_tokens: int


class EvalBackend(Protocol):
    """One KV configuration under evaluation.

    Every call starts from an empty cache for its prompt (no state carries over
    between calls) and feeds the prompt in chunks of ``chunk`` tokens: each chunk
    attends to the compressed cache of the chunks before it, as a long prompt
    does in a serving engine.
    """

    name: str
    chunk: int

    def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) for i = 1 .. n-1 (n-1 values)."""
        ...

    def greedy(self, token_ids: Sequence[int], max_tokens: int, shared_prefix: int = 0,
               keep_prefixes: Collection[int] = ()) -> list[int]:
        """Exactly ``max_tokens`` greedy tokens after the prompt (eos does not stop it).

        With ``shared_prefix`` > 0 (a multiple of ``chunk``), the backend may serve
        that many leading tokens from what earlier calls computed, provided the result
        is exactly a cold run's. ``keep_prefixes``: prefix lengths of this prompt that
        later calls will share (a hint; a backend may keep its state there)."""
        ...

    def storage(self, context_tokens: int) -> StorageCost:
        """Bytes per token of this configuration (may run the model to measure it)."""
        ...

    def decode(self, token_ids: Sequence[int]) -> str:
        ...


class KVServeBackend:
    """The engine with one KV format. ``max_num_batched_tokens = chunk`` makes a lone
    request's prefill go in chunks of exactly ``chunk`` tokens. The prefix cache is
    emptied before every call except a ``greedy`` with a ``shared_prefix``; a hit is
    then a multiple of ``chunk`` tokens (checked), so the remaining chunks are the
    cold run's chunks and the engine's guarantee (a hit gives exactly a cold run's
    tokens in the same format) applies. Prompt-logprob requests never take hits."""

    def __init__(self, loaded: LoadedModel, kv_format: str, chunk: int, name: str | None = None,
                 **engine_options: Any) -> None:
        self.name = name or kv_format
        self.chunk = chunk
        self.llm = LLM(loaded=loaded, kv_format=kv_format, max_num_batched_tokens=chunk,
                       enable_prefix_caching=True, **engine_options)
        self.spec = self.llm.engine.kv_format.spec

    def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        out = self.llm.generate(list(token_ids), SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        assert out.prompt_logprobs is not None
        return [p.logprob for p in out.prompt_logprobs[1:] if p is not None]

    def greedy(self, token_ids: Sequence[int], max_tokens: int, shared_prefix: int = 0,
               keep_prefixes: Collection[int] = ()) -> list[int]:
        # the prefix cache keeps every full block: ``keep_prefixes`` needs no action
        if shared_prefix % self.chunk:
            raise ValueError(f"shared_prefix {shared_prefix} is not a multiple of the chunk ({self.chunk})")
        if shared_prefix == 0:
            self.llm.reset_prefix_cache()
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        out = self.llm.generate(list(token_ids), params)[0]
        if out.num_cached_tokens % self.chunk:
            raise RuntimeError(
                f"{self.name}: a prefix hit of {out.num_cached_tokens} tokens is not a multiple of the "
                f"chunk ({self.chunk}), so this run is not a cold run's chunks; give the KV pool more memory")
        return out.token_ids

    def decode(self, token_ids: Sequence[int]) -> str:
        tok = self.llm.tokenizer
        return tok.decode(token_ids) if tok is not None else " ".join(map(str, token_ids))

    def storage(self, context_tokens: int) -> StorageCost:
        """From the format's exact block size: a sequence of L tokens holds ceil(L / B)
        blocks, plus, under a format with halves that encode whole blocks (KIVI's keys), one
        full-precision residual row of B tokens of those halves while its last block is open. Averaged over L in (context, context + 128]."""
        engine = self.llm.engine
        mc, bs = engine.model_config, engine.config.cache.block_size
        block_nbytes = engine.kv_format.nbytes_per_block(bs, mc.num_kv_heads, mc.head_dim)
        row_nbytes = (0 if engine.kv_format.is_lossless
                      else QuantizedKVCache.residual_row_nbytes(mc, engine.kv_format, bs, engine.dtype))
        ratios = []
        for length in range(context_tokens + 1, context_tokens + 1 + STORAGE_CYCLE_TOKENS):
            nbytes = -(-length // bs) * block_nbytes + (row_nbytes if length % bs else 0)
            ratios.append(nbytes / length)
        return StorageCost(block_nbytes / bs, sum(ratios) / len(ratios), context_tokens)

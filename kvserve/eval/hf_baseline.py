"""The baseline: transformers' own model with its quantized KV cache.

``QuantizedCache(backend="quanto", nbits=4|2)`` stores keys and values with
optimum-quanto: per token and head, groups of ``q_group_size`` (64) channels,
int codes packed into uint8 plus a scale and a zero point per group in the
compute dtype; the newest tokens (up to ``residual_length`` = 128) stay in full
precision and are quantized together (the whole cache is re-quantized) when the
residual fills. Its first forward attends to the unquantized keys, so prompts are
fed in chunks (``chunk`` tokens per forward), exactly as the engine is run.

Storage is measured, not computed: every tensor the cache holds (quanto's packed
codes, scales and shifts, and the residual) is summed.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from kvserve.eval.backends import STORAGE_CYCLE_TOKENS, StorageCost

HF_RESIDUAL_LENGTH = 128
HF_GROUP_SIZE = 64


def tensor_nbytes(t: Any) -> int:
    """Bytes of a tensor, recursing into wrapper subclasses (quanto's QTensors)."""
    if t is None:
        return 0
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_nbytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def cache_nbytes(cache: Any) -> tuple[int, int]:
    """(bytes of quantized storage, bytes of full-precision storage) over all layers."""
    quantized = full = 0
    for layer in cache.layers:
        for name in ("_quantized_keys", "_quantized_values"):
            quantized += tensor_nbytes(getattr(layer, name, None))
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if isinstance(t, torch.Tensor):
                full += tensor_nbytes(t)
    return quantized, full


def quanto_cache_factory(config: Any, nbits: int, q_group_size: int = HF_GROUP_SIZE,
                         residual_length: int = HF_RESIDUAL_LENGTH) -> Callable[[], Any]:
    """transformers' defaults (group 64, residual 128, axis 0 = per token) unless told."""
    from transformers import QuantizedCache

    def make() -> Any:
        return QuantizedCache(backend="quanto", config=config, nbits=nbits, q_group_size=q_group_size,
                              residual_length=residual_length)
    return make


def dynamic_cache_factory(config: Any) -> Callable[[], Any]:
    from transformers import DynamicCache

    def make() -> Any:
        return DynamicCache(config=config)
    return make


def snapshot(cache: Any) -> Any:
    """A copy of a cache's state that later updates of ``cache`` leave alone.

    Shallow per layer: transformers' dynamic and quantized layers never write into
    their tensors, they replace them (``torch.cat``, re-quantization), so sharing the
    tensors is safe (quanto's tensors cannot be deep-copied anyway)."""
    copied = copy.copy(cache)
    copied.layers = [copy.copy(layer) for layer in cache.layers]
    return copied


class HFBackend:
    """A transformers causal LM with a fresh cache from ``make_cache`` per call.

    ``greedy(..., keep_prefixes=...)`` keeps a snapshot of the cache after each of
    those prefix lengths (multiples of ``chunk``); a later call whose
    ``shared_prefix`` names the same tokens starts from it. Since the snapshot sits
    on a chunk boundary, the remaining forwards are exactly a cold run's."""

    def __init__(self, model: Any, make_cache: Callable[[], Any], name: str, chunk: int,
                 tokenizer: Any = None) -> None:
        self.model = model
        self.make_cache = make_cache
        self.name = name
        self.chunk = chunk
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self._snapshots: dict[tuple[int, ...], Any] = {}

    def _prefill(self, token_ids: Sequence[int], cache: Any, start: int = 0,
                 keep: Collection[int] = ()) -> list[torch.Tensor]:
        """Feed tokens [start, n) chunk by chunk; the logits of each chunk, float32 on CPU.
        Snapshots the cache after every prefix length in ``keep``."""
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        out = []
        for begin in range(start, ids.shape[1], self.chunk):
            end = min(begin + self.chunk, ids.shape[1])
            logits = self.model(input_ids=ids[:, begin:end], past_key_values=cache, use_cache=True).logits
            out.append(logits[0].float().cpu())
            if end in keep:
                self._snapshots[tuple(token_ids[:end])] = snapshot(cache)
        return out

    @torch.inference_mode()
    def prompt_logprobs(self, token_ids: Sequence[int]) -> list[float]:
        logits = torch.cat(self._prefill(token_ids, self.make_cache()))[:-1]
        targets = torch.tensor(list(token_ids[1:]), dtype=torch.long)
        logprobs = torch.log_softmax(logits, dim=-1)
        return logprobs[torch.arange(len(targets)), targets].tolist()

    @torch.inference_mode()
    def greedy(self, token_ids: Sequence[int], max_tokens: int, shared_prefix: int = 0,
               keep_prefixes: Collection[int] = ()) -> list[int]:
        if shared_prefix % self.chunk:
            raise ValueError(f"shared_prefix {shared_prefix} is not a multiple of the chunk ({self.chunk})")
        if not shared_prefix:
            self._snapshots.clear()
        ids = list(token_ids)
        start, cache = 0, self.make_cache()
        kept = self._snapshots.get(tuple(ids[:shared_prefix])) if shared_prefix else None
        if kept is not None:
            start, cache = shared_prefix, snapshot(kept)
        keep = {p for p in keep_prefixes if start < p < len(ids) and p % self.chunk == 0}
        next_id = int(self._prefill(ids, cache, start, keep)[-1][-1].argmax())
        out = [next_id]
        while len(out) < max_tokens:
            step = torch.tensor([[next_id]], dtype=torch.long, device=self.device)
            logits = self.model(input_ids=step, past_key_values=cache, use_cache=True).logits
            next_id = int(logits[0, -1].argmax())
            out.append(next_id)
        return out

    def decode(self, token_ids: Sequence[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else " ".join(map(str, token_ids))

    @torch.inference_mode()
    def storage(self, context_tokens: int) -> StorageCost:
        """From the cache's actual tensors after ``context_tokens`` tokens (fed in chunks)
        plus one decoded token: q = quantized bytes / quantized tokens (packed codes,
        scales, shifts), f = residual bytes / residual tokens. Decoding on from a flush,
        the residual holds r = 1, 2, .., R-1, 0 tokens (R = residual_length), so bytes per
        token at context is the mean over one cycle of (q (L - r) + f r) / L, L = context + i."""
        cache = self.make_cache()
        vocab = self.model.config.vocab_size
        # token values do not change the storage
        self._prefill([(7 * i) % vocab for i in range(context_tokens)], cache)
        length = context_tokens
        while True:   # decode until the residual holds a token (at most one cycle)
            self._prefill([length % vocab], cache)
            length += 1
            quantized, full = cache_nbytes(cache)
            residual = _residual_tokens(cache)
            if not quantized:                    # a dense cache: everything is full precision
                return StorageCost(full / length, full / length, context_tokens)
            if residual:
                break
        q, f = quantized / (length - residual), full / residual
        cycle = int(getattr(cache.layers[0], "residual_length", STORAGE_CYCLE_TOKENS))
        ratios = []
        for i in range(1, STORAGE_CYCLE_TOKENS + 1):
            r, n = i % cycle, context_tokens + i
            ratios.append((q * (n - r) + f * r) / n)
        return StorageCost(q, sum(ratios) / len(ratios), context_tokens)


def _residual_tokens(cache: Any) -> int:
    layer = cache.layers[0]
    keys = getattr(layer, "keys", None)
    if getattr(layer, "_quantized_keys", None) is None:
        return 0
    return int(keys.shape[-2]) if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0

"""Tiny random-weight Llama models for fast unit tests."""

from __future__ import annotations

from kvserve.bench.random_model import random_token_ids, random_weights
from kvserve.config import ModelConfig
from kvserve.model.loader import LoadedModel

TINY = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                   max_position_embeddings=512, tie_word_embeddings=False, eos_token_ids=())


def tiny_model(config: ModelConfig = TINY, seed: int = 0) -> LoadedModel:
    return LoadedModel(config=config, weights=random_weights(config, seed), tokenizer=None,  # type: ignore[arg-type]
                       fingerprint=f"tiny-{seed}", source="random")


def random_tokens(n: int, seed: int, vocab_size: int = TINY.vocab_size) -> list[int]:
    """``n`` token ids drawn with ``seed`` (the same ids every run)."""
    return random_token_ids(n, vocab_size, seed)

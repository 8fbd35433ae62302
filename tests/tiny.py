"""Tiny random-weight Llama models for fast unit tests."""

from __future__ import annotations

import random

import torch

from kvserve.config import ModelConfig
from kvserve.model.loader import LoadedModel

TINY = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                   num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                   max_position_embeddings=512, tie_word_embeddings=False, eos_token_ids=())


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.5

    c = config
    w = {"model.embed_tokens.weight": rand(c.vocab_size, c.hidden_size),
         "model.norm.weight": 1 + 0.1 * rand(c.hidden_size)}
    if not c.tie_word_embeddings:
        w["lm_head.weight"] = rand(c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rand(c.hidden_size)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rand(c.hidden_size)
        w[p + "self_attn.q_proj.weight"] = rand(c.q_size, c.hidden_size) / c.hidden_size ** 0.5
        w[p + "self_attn.k_proj.weight"] = rand(c.kv_size, c.hidden_size) / c.hidden_size ** 0.5
        w[p + "self_attn.v_proj.weight"] = rand(c.kv_size, c.hidden_size) / c.hidden_size ** 0.5
        w[p + "self_attn.o_proj.weight"] = rand(c.hidden_size, c.q_size) / c.q_size ** 0.5
        w[p + "mlp.gate_proj.weight"] = rand(c.intermediate_size, c.hidden_size) / c.hidden_size ** 0.5
        w[p + "mlp.up_proj.weight"] = rand(c.intermediate_size, c.hidden_size) / c.hidden_size ** 0.5
        w[p + "mlp.down_proj.weight"] = rand(c.hidden_size, c.intermediate_size) / c.intermediate_size ** 0.5
        if c.attention_bias:
            for n, size in (("q", c.q_size), ("k", c.kv_size), ("v", c.kv_size)):
                w[p + f"self_attn.{n}_proj.bias"] = 0.1 * rand(size)
    return w


def tiny_model(config: ModelConfig = TINY, seed: int = 0) -> LoadedModel:
    return LoadedModel(config=config, weights=random_weights(config, seed), tokenizer=None,  # type: ignore[arg-type]
                       fingerprint=f"tiny-{seed}", source="random")


def random_tokens(n: int, seed: int, vocab_size: int = TINY.vocab_size) -> list[int]:
    """``n`` token ids drawn with ``seed`` (the same ids every run)."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(n)]

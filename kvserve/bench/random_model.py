"""Random-weight models of real shapes: for timing where no model file can go (a lent GPU
machine takes no file of tens of MB, and reaches no network), and for tests' tiny models.

A decode step's time depends on the shapes, not on the values, so a model of SmolLM2-135M's or
Qwen2.5-Coder-1.5B's shape with random weights times as the real one does (its tokens mean
nothing). ``SHAPES`` holds those configs as the GGUF files give them (the default model's is
checked against its file by the tests), computed in bfloat16 on CUDA (the engine's dtype auto).
"""

from __future__ import annotations

import random
from dataclasses import replace

import torch

from kvserve.config import ModelConfig
from kvserve.model.loader import LoadedModel

SHAPES = {
    "smollm2-135m": ModelConfig(
        architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
        num_kv_heads=3, head_dim=64, rope_theta=100000.0, rms_norm_eps=1e-5, max_position_embeddings=8192,
        tie_word_embeddings=True, bos_token_id=1, eos_token_ids=(2,), torch_dtype="bfloat16"),
    "qwen2.5-coder-1.5b": ModelConfig(
        architecture="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
        num_kv_heads=2, head_dim=128, rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
        tie_word_embeddings=False, attention_bias=True, bos_token_id=151643, eos_token_ids=(151645,),
        torch_dtype="bfloat16"),
}


def random_weights(config: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every weight a Llama-family model of ``config`` reads, by its Hugging Face name, in float32
    (as a loader gives them), drawn with ``seed`` and scaled so that activations stay of order
    one (products by 1 / sqrt(fan-in))."""
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


def random_model(shape: str, seed: int = 0, num_layers: int | None = None) -> LoadedModel:
    """A model of ``SHAPES[shape]`` with random weights (computed in its dtype, bfloat16, where the
    engine's dtype is auto on CUDA; no tokenizer);
    ``num_layers``: fewer layers (a quicker model of the same layer shape). ValueError for a
    shape not in SHAPES."""
    if shape not in SHAPES:
        raise ValueError(f"unknown model shape {shape!r}; known: {', '.join(SHAPES)}")
    config = SHAPES[shape] if num_layers is None else replace(SHAPES[shape], num_layers=num_layers)
    return LoadedModel(config=config, weights=random_weights(config, seed), tokenizer=None,  # type: ignore[arg-type]
                       fingerprint=f"random-{shape}-{seed}", source=f"random weights of {shape}'s shape")


def random_token_ids(count: int, vocab_size: int, seed: int = 0) -> list[int]:
    """``count`` token ids drawn with ``seed`` (prompts for a model without a tokenizer)."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(count)]

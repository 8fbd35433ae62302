"""The Llama family (Llama, SmolLM, Qwen2, Mistral): pre-norm layers, SwiGLU, one RoPE.

The weights of Q, K and V are stacked into one matrix, gate and up into another, so a layer is
four products (kvserve/model/linear.py), each fused with what surrounds it: the RMSNorm before
Q/K/V and gate/up, the add into the residual after O and down, SwiGLU before down.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvserve.attention.paged import AttentionMetadata
from kvserve.config import LayerSpec, ModelConfig
from kvserve.kv.storage import KVStorage
from kvserve.model.decoder import Decoder, StepAngles
from kvserve.model.family import Family, GGUFKeys
from kvserve.model.linear import Product


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Product          # Q, K and V stacked (with Qwen2's bias)
    o: Product
    post_norm: torch.Tensor
    gate_up: Product      # gate and up stacked
    down: Product


class LlamaModel(Decoder):
    def build_layers(self) -> None:
        cfg, w, vector, make = self.config, self.weight, self.vector, self.products.product
        self.layers: list[LayerWeights] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if cfg.attention_bias:
                bias = torch.cat([vector(a + "q_proj.bias"), vector(a + "k_proj.bias"), vector(a + "v_proj.bias")])
            self.layers.append(LayerWeights(
                input_norm=vector(p + "input_layernorm.weight"),
                qkv=make(a + "qkv", [w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")], bias),
                o=make(a + "o_proj", [w(a + "o_proj.weight")]),
                post_norm=vector(p + "post_attention_layernorm.weight"),
                gate_up=make(p + "mlp.gate_up", [w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                down=make(p + "mlp.down_proj", [w(p + "mlp.down_proj.weight")]),
            ))

    def run_layers(self, h: torch.Tensor, angles: StepAngles, cache: KVStorage, meta: AttentionMetadata,
                   layers: Sequence[int]) -> torch.Tensor:
        """A step whose every layer attends in one backend call (``Decoder.step_calls``) runs as
        direct calls: each product's kernel into buffers made once for the step, RoPE, the
        storage's bound writes, the backend's bound attention; the same calls with the same
        arguments as ``layer_qkv`` / ``paged_attention`` / ``layer_output`` make, without their
        Python around every one (docs/models.md: SmolLM2-135M's decode step 13-15% faster on the CPU)."""
        bound = self.bound_layers()
        steps = self.step_calls(cache, meta) if bound else None
        if steps is None:
            return super().run_layers(h, angles, cache, meta, layers)
        writes, attends = steps
        n, first = h.shape[0], self.layers[0]
        qkv, v, attn, gate_up = self.step_buffers(h, first.qkv.rows, first.gate_up.rows)
        ropes = [rope.step_qk(a) for rope, a in zip(self.ropes, angles)]
        rope_of, q_size = self.rope_of_layer, self.config.q_size
        for i in layers:
            qkv_of, o_into, gate_up_of, down_into = bound[i]
            qkv_of(h, qkv)
            q, k = ropes[rope_of[i]](qkv)
            writes[i](i, k, v)
            o_into(attends[i](i, q, attn).view(n, q_size), h)
            gate_up_of(h, gate_up)
            down_into(gate_up, h)
        return h

    def bind_layers(self) -> tuple[tuple[Callable[..., object], ...], ...]:
        return self.bind_each_layer(self.layers, lambda lw: (
            (lw.qkv, "after_norm", lw.input_norm), (lw.o, "add_into", None),
            (lw.gate_up, "after_norm", lw.post_norm), (lw.down, "swiglu_add_into", None)))

    def layer_products(self) -> Sequence[Product]:
        return [p for lw in self.layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down)]

    def layer_vectors(self) -> Sequence[torch.Tensor]:
        return [t for lw in self.layers for t in (lw.input_norm, lw.post_norm)]

    def layer_qkv(self, layer: int, h: torch.Tensor,
                  angles: StepAngles) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg, lw = self.config, self.layers[layer]
        qkv = lw.qkv.after_norm(h, lw.input_norm, cfg.rms_norm_eps)
        q, k = self.rope_of(layer).qk(qkv, self.layer_angles(layer, angles))
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(h.shape[0], cfg.num_kv_heads, cfg.head_dim)
        return q, k, v

    def layer_output(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        lw = self.layers[layer]
        h = lw.o.add_into(h, attn.reshape(h.shape[0], self.config.q_size))
        return lw.down.swiglu_add_into(h, lw.gate_up.after_norm(h, lw.post_norm, self.config.rms_norm_eps))


def _layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (config.q_size, hidden),
        "self_attn.k_proj.weight": (config.kv_size, hidden),
        "self_attn.v_proj.weight": (config.kv_size, hidden),
        "self_attn.o_proj.weight": (hidden, config.q_size),
        "post_attention_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
    }
    if config.attention_bias:
        shapes |= {"self_attn.q_proj.bias": (config.q_size,), "self_attn.k_proj.bias": (config.kv_size,),
                   "self_attn.v_proj.bias": (config.kv_size,)}
    return shapes


def _gguf_config(keys: GGUFKeys, common: dict[str, Any]) -> ModelConfig:
    scaling = keys.arch("rope.scaling.type", "none")
    if "rope_freqs.weight" in keys.tensor_shapes or scaling != "none":
        raise ValueError(f"GGUF file {keys.source!r} uses RoPE scaling ({scaling if scaling != 'none' else 'rope_freqs'}), "
                         "which the GGUF loader does not support; load the Hugging Face "
                         "directory instead, whose llama3 rope_scaling is supported.")
    return ModelConfig(**common)


def _hf_config(raw: dict[str, Any], common: dict[str, Any], source: str) -> ModelConfig:
    model_type = common["architecture"]
    if raw.get("use_sliding_window"):
        raise ValueError(f"{source!r} uses Qwen2's sliding-window attention on its upper layers, which is not "
                         "supported.")
    config = ModelConfig(**common, attention_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)))
    window = raw.get("sliding_window") if model_type == "mistral" else None
    if window:     # Mistral v0.1: every layer attends over its last `sliding_window` positions
        spec = LayerSpec(int(window), config.rope_theta, config.rope_scaling)
        return replace(config, layers=(spec,) * config.num_layers)
    return config


def _to_hf(config: ModelConfig) -> dict[str, Any]:
    model_type = "qwen2" if config.attention_bias else config.architecture if config.architecture in (
        "llama", "mistral") else "llama"
    out: dict[str, Any] = {"model_type": model_type, "rope_theta": config.rope_theta}
    if config.rope_scaling is not None:
        s = config.rope_scaling
        out["rope_scaling"] = {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
                               "high_freq_factor": s.high_freq_factor,
                               "original_max_position_embeddings": s.original_max_position_embeddings}
    if config.has_sliding_layers:
        out["sliding_window"] = config.layer_specs[0].sliding_window
    return out


LLAMA = Family(
    name="llama",
    decoder=LlamaModel,
    gguf_architectures=("llama", "qwen2"),
    hf_model_types=("llama", "mistral", "qwen2"),
    hf_architectures=("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"),
    gguf_layer_names={
        "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    },
    layer_weight_shapes=_layer_shapes,
    gguf_config=_gguf_config,
    hf_config=_hf_config,
    to_hf_config=_to_hf,
    # llama.cpp interleaves Q/K rows for the llama architecture only (qwen2 rotates half-split)
    permutes_qk_rows=lambda architecture: architecture == "llama",
)

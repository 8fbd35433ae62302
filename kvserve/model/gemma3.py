"""Gemma 3 (``gemma3``; Hugging Face ``gemma3_text`` / ``Gemma3ForCausalLM``).

What it adds to the Llama layer, each a field of ``ModelConfig`` the loaders fill:

    h = embed(ids) * sqrt(hidden)
    layer:  x = norm(h);  q, k, v = x Wq, x Wk, x Wv;  q, k = norm(q), norm(k) per head, then RoPE
            h = h + norm(attention(q, k, v) Wo)                      (sandwich norms)
            x = norm(h);  h = h + norm((gelu_tanh(x Wgate) * x Wup) Wdown)
    norms:  RMSNorm scaling by 1 + weight (the weight as Hugging Face stores it)

Five layers of six attend over a sliding window (512 positions for the released models) and
rotate with base 10,000; every sixth attends over everything with base 1,000,000. Scores are
scaled by query_pre_attn_scalar ** -0.5. The embedding (262,144 rows) is tied to the LM head.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvserve.attention.paged import AttentionMetadata
from kvserve.config import LayerSpec, ModelConfig
from kvserve.kv.storage import KVStorage
from kvserve.model.chat_templates import builtin_chat_template
from kvserve.model.decoder import Decoder, StepAngles
from kvserve.model.family import Family, GGUFKeys
from kvserve.model.linear import Product

SLIDING_PATTERN = 6             # every sixth layer attends to the whole context
LOCAL_ROPE_THETA = 10000.0      # the sliding layers' RoPE base (llama.cpp's files do not carry it)
_HF_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_tanh")


@dataclass(frozen=True)
class Gemma3Layer:
    input_norm: torch.Tensor
    qkv: Product                  # Q, K and V stacked
    q_norm: torch.Tensor          # [head_dim]
    k_norm: torch.Tensor
    o: Product
    post_attention_norm: torch.Tensor
    pre_feedforward_norm: torch.Tensor
    gate_up: Product              # gate and up stacked
    down: Product
    post_feedforward_norm: torch.Tensor


class Gemma3Model(Decoder):
    norm_plus = 1.0         # every norm scales by 1 + weight

    def build_layers(self) -> None:
        cfg, w, make = self.config, self.weight, self.products.product

        def norm(name: str) -> torch.Tensor:
            return self.vector(name, plus=1.0)

        self.layers: list[Gemma3Layer] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            self.layers.append(Gemma3Layer(
                input_norm=norm(p + "input_layernorm.weight"),
                qkv=make(a + "qkv", [w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")]),
                q_norm=norm(a + "q_norm.weight"),
                k_norm=norm(a + "k_norm.weight"),
                o=make(a + "o_proj", [w(a + "o_proj.weight")]),
                post_attention_norm=norm(p + "post_attention_layernorm.weight"),
                pre_feedforward_norm=norm(p + "pre_feedforward_layernorm.weight"),
                gate_up=make(p + "mlp.gate_up", [w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                down=make(p + "mlp.down_proj", [w(p + "mlp.down_proj.weight")]),
                post_feedforward_norm=norm(p + "post_feedforward_layernorm.weight"),
            ))

    def layer_products(self) -> Sequence[Product]:
        return [p for lw in self.layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down)]

    def layer_vectors(self) -> Sequence[torch.Tensor]:
        return [t for lw in self.layers for t in (lw.input_norm, lw.q_norm, lw.k_norm, lw.post_attention_norm,
                                                   lw.pre_feedforward_norm, lw.post_feedforward_norm)]

    def layer_qkv(self, layer: int, h: torch.Tensor,
                  angles: StepAngles) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg, lw, eps = self.config, self.layers[layer], self.config.rms_norm_eps
        qkv = lw.qkv.after_norm(h, lw.input_norm, eps)
        q, k = self.rope_of(layer).qk_normed(qkv, self.layer_angles(layer, angles), lw.q_norm, lw.k_norm, eps)
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(h.shape[0], cfg.num_kv_heads, cfg.head_dim)
        return q, k, v

    def layer_output(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        lw, eps = self.layers[layer], self.config.rms_norm_eps
        h = self.norm_add(h, lw.o(attn.reshape(h.shape[0], self.config.q_size)), lw.post_attention_norm)
        gate_up = lw.gate_up.after_norm(h, lw.pre_feedforward_norm, eps)
        return self.norm_add(h, lw.down.geglu(gate_up), lw.post_feedforward_norm)

    def run_layers(self, h: torch.Tensor, angles: StepAngles, cache: KVStorage, meta: AttentionMetadata,
                   layers: Sequence[int]) -> torch.Tensor:
        """A step every layer group attends in one backend call runs as direct calls, as the
        Llama family's (``LlamaModel.run_layers``): the norms added into the residual by the C++
        ``norm_add``, the queries' and keys' norms and RoPE by ``qk_norm_rope``."""
        bound, ext = self.bound_layers(), self._ext
        steps = self.step_calls(cache, meta) if bound and ext is not None else None
        if steps is None or ext is None:
            return super().run_layers(h, angles, cache, meta, layers)
        writes, attends = steps
        n, first, eps = h.shape[0], self.layers[0], self.config.rms_norm_eps
        qkv, v, attn, gate_up = self.step_buffers(h, first.qkv.rows, first.gate_up.rows)
        out = h.new_empty(n, self.config.hidden_size)
        ropes = [rope.step_qk_normed(a, eps) for rope, a in zip(self.ropes, angles)]
        rope_of, q_size, norm_add = self.rope_of_layer, self.config.q_size, ext.norm_add
        for i in layers:
            lw = self.layers[i]
            qkv_of, o_of, gate_up_of, down_of = bound[i]
            qkv_of(h, qkv)
            q, k = ropes[rope_of[i]](qkv, lw.q_norm, lw.k_norm)
            writes[i](i, k, v)
            o_of(attends[i](i, q, attn).view(n, q_size), out)
            norm_add(h, out, lw.post_attention_norm, eps)
            gate_up_of(h, gate_up)
            down_of(gate_up, out)
            norm_add(h, out, lw.post_feedforward_norm, eps)
        return h

    def bind_layers(self) -> tuple[tuple[Callable[..., object], ...], ...]:
        return self.bind_each_layer(self.layers, lambda lw: (
            (lw.qkv, "after_norm", lw.input_norm), (lw.o, "call", None),
            (lw.gate_up, "after_norm", lw.pre_feedforward_norm), (lw.down, "geglu", None)))


def _layer_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    hidden, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    return {
        "input_layernorm.weight": (hidden,),
        "self_attn.q_proj.weight": (config.q_size, hidden),
        "self_attn.k_proj.weight": (config.kv_size, hidden),
        "self_attn.v_proj.weight": (config.kv_size, hidden),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "self_attn.o_proj.weight": (hidden, config.q_size),
        "post_attention_layernorm.weight": (hidden,),
        "pre_feedforward_layernorm.weight": (hidden,),
        "mlp.gate_proj.weight": (inter, hidden),
        "mlp.up_proj.weight": (inter, hidden),
        "mlp.down_proj.weight": (hidden, inter),
        "post_feedforward_layernorm.weight": (hidden,),
    }


def _config(common: dict[str, Any], layers: tuple[LayerSpec, ...], query_pre_attn_scalar: float,
            final_logit_softcapping: float | None) -> ModelConfig:
    return ModelConfig(**common, layers=layers, activation="gelu_tanh", qk_norm=True, sandwich_norms=True,
                       embedding_multiplier=common["hidden_size"] ** 0.5, query_pre_attn_scalar=query_pre_attn_scalar,
                       final_logit_softcapping=final_logit_softcapping)


def _gguf_config(keys: GGUFKeys, common: dict[str, Any]) -> ModelConfig:
    scaling = keys.arch("rope.scaling.type", "none")
    if scaling != "none":
        raise ValueError(f"GGUF file {keys.source!r}: Gemma 3 with RoPE scaling ({scaling}) is not supported yet")
    window = int(keys.arch("attention.sliding_window"))
    full, local = LayerSpec(None, common["rope_theta"]), LayerSpec(window, LOCAL_ROPE_THETA)
    layers = tuple(full if (i + 1) % SLIDING_PATTERN == 0 else local for i in range(common["num_layers"]))
    # the turn's end token ends a reply as eos does (as Gemma's generation config says)
    end_of_turn = keys.token_id("<end_of_turn>")
    eos = common["eos_token_ids"] + ((end_of_turn,) if end_of_turn is not None else ())
    # llama.cpp scales scores by head_dim ** -0.5 except for the 27B model (hidden / heads)
    scalar = common["hidden_size"] // common["num_heads"] if common["hidden_size"] == 5376 else common["head_dim"]
    return _config(common | {"eos_token_ids": tuple(dict.fromkeys(eos))}, layers, float(scalar),
                   keys.arch("final_logit_softcapping", 0.0) or None)


def _hf_config(raw: dict[str, Any], common: dict[str, Any], source: str) -> ModelConfig:
    if raw.get("hidden_activation", "gelu_pytorch_tanh") not in _HF_ACTIVATIONS:
        raise ValueError(f"{source!r}: hidden_activation {raw.get('hidden_activation')!r} is not Gemma 3's")
    if raw.get("attn_logit_softcapping") or raw.get("use_bidirectional_attention"):
        raise ValueError(f"{source!r}: attention logit soft-capping and bidirectional attention are not supported")
    n = common["num_layers"]
    types = raw.get("layer_types") or [
        "full_attention" if (i + 1) % int(raw.get("sliding_window_pattern", SLIDING_PATTERN)) == 0
        else "sliding_attention" for i in range(n)]
    rope = raw.get("rope_parameters") or {}
    thetas = {"full_attention": float(raw.get("rope_theta", 1_000_000.0)),
              "sliding_attention": float(raw.get("rope_local_base_freq", LOCAL_ROPE_THETA))}
    scaled = [(raw.get("rope_scaling") or {}).get("rope_type", "default")]
    for kind, theta in list(thetas.items()):
        params = rope.get(kind) or {}
        scaled.append(params.get("rope_type", "default"))
        thetas[kind] = float(params.get("rope_theta", theta))
    if set(scaled) != {"default"}:
        raise ValueError(f"{source!r}: Gemma 3 with RoPE scaling is not supported yet")
    window = int(raw["sliding_window"])
    layers = tuple(LayerSpec(window if t == "sliding_attention" else None, thetas[t]) for t in types)
    return _config(common | {"rope_theta": thetas["full_attention"]}, layers,
                   float(raw.get("query_pre_attn_scalar", common["head_dim"])), raw.get("final_logit_softcapping"))


def _to_hf(config: ModelConfig) -> dict[str, Any]:
    specs = config.layer_specs
    windows = {s.sliding_window for s in specs if s.sliding_window is not None}
    if len(windows) > 1:
        raise ValueError(f"transformers' Gemma 3 has one sliding window, this config {sorted(windows)}")

    def theta(kind: str) -> float:
        return next((s.rope_theta for s in specs if s.attention_kind == kind), config.rope_theta)

    return {
        "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": [f"{s.attention_kind}_attention" for s in specs],
        "sliding_window": next(iter(windows), config.max_position_embeddings),
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": theta("full")},
                            "sliding_attention": {"rope_type": "default", "rope_theta": theta("sliding")}},
        "query_pre_attn_scalar": int(config.query_pre_attn_scalar or config.head_dim),
        "final_logit_softcapping": config.final_logit_softcapping,
    }


GEMMA3 = Family(
    name="gemma3",
    decoder=Gemma3Model,
    gguf_architectures=("gemma3",),
    hf_model_types=("gemma3_text",),
    hf_architectures=("Gemma3ForCausalLM",),
    gguf_layer_names={
        "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
        "attn_output": "self_attn.o_proj", "post_attention_norm": "post_attention_layernorm",
        "ffn_norm": "pre_feedforward_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj", "post_ffw_norm": "post_feedforward_layernorm",
    },
    layer_weight_shapes=_layer_shapes,
    gguf_config=_gguf_config,
    hf_config=_hf_config,
    to_hf_config=_to_hf,
    gguf_norm_shift=-1.0,
    chat_template=builtin_chat_template("gemma3"),
)

"""The Llama-family decoder (Llama, SmolLM, Qwen2, Mistral) over a paged KV cache.

Plain tensors, no nn.Module: the weights of Q, K and V are stacked into one matrix,
gate and up into another, so a layer is four products (kvserve/model/linear.py), each
held in the weight format the engine chose (float, or quantized blocks read in place),
and each fused with what surrounds it: the RMSNorm before Q/K/V and gate/up, the add
into the residual after O and down, SwiGLU before down.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvserve.attention.paged import AttentionMetadata, paged_attention
from kvserve.config import ModelConfig, RopeScaling
from kvserve.kv.storage import KVStorage
from kvserve.model.cpu_extension import load_extension
from kvserve.model.linear import DenseProducts, Product, Products, TorchLinear, Weight, rms_norm


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: Product          # Q, K and V stacked (with Qwen2's bias)
    o: Product
    post_norm: torch.Tensor
    gate_up: Product      # gate and up stacked
    down: Product


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if config.rope_scaling is not None:
        inv_freq = _llama3_scale(inv_freq, config.rope_scaling)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    # Llama 3.1: long wavelengths slowed by `factor`, short ones kept, a smooth blend between.
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * inv_freq / s.factor + smooth * inv_freq
    out = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    is_medium = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
    return torch.where(is_medium, blended, out)


def rope_tables(config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's rotation angles, [max_position_embeddings, head_dim / 2]
    float32 on the CPU: the angles in float64, their cos and sin in float32, as Hugging Face
    computes them (so logits match it closely)."""
    inv_freq = rope_inv_freq(config)
    pos = torch.arange(config.max_position_embeddings, dtype=torch.float64)
    freqs = torch.outer(pos, inv_freq).float()
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [..., D] by angles given as ``cos``/``sin`` [..., D / 2] (broadcast).

    The half-split layout (GPT-NeoX, Hugging Face Llama): channel j pairs with j + D / 2.
    GGUF checkpoints store Q and K rows interleaved; the loader undoes that, so every
    model here rotates this way and anything that re-rotates keys calls this.
    """
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RopeAngles(NamedTuple):
    """A step's rotation angles, as ``Rope.qk`` reads them: the tokens' positions, and (torch
    path) the rows of the cos / sin tables there [T, 1, D / 2]."""

    positions: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None


class Rope:
    """RoPE of a step's queries and keys, taken from the fused Q/K/V product's rows: one C++
    call on the CPU in float32 (bit for bit ``apply_rope``'s result), ``apply_rope`` else."""

    def __init__(self, config: ModelConfig, device: torch.device, dtype: torch.dtype) -> None:
        cos, sin = rope_tables(config)
        self.cos = cos.to(device=device, dtype=dtype).contiguous()
        self.sin = sin.to(device=device, dtype=dtype).contiguous()
        self.config = config
        self.ext = load_extension() if device.type == "cpu" and dtype == torch.float32 else None

    def angles(self, positions: torch.Tensor) -> RopeAngles:
        if self.ext is not None:
            return RopeAngles(positions, None, None)
        return RopeAngles(positions, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))

    def qk(self, qkv: torch.Tensor, angles: RopeAngles) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated queries [T, H, D] and keys [T, Hkv, D] from qkv [T, (H + 2 Hkv) D]."""
        c = self.config
        if self.ext is not None:
            return self.ext.rope_qk(qkv, angles.positions, self.cos, self.sin, c.num_heads, c.num_kv_heads, c.head_dim)
        assert angles.cos is not None and angles.sin is not None
        num_tokens = qkv.shape[0]
        q = qkv[:, :c.q_size].view(num_tokens, c.num_heads, c.head_dim)
        k = qkv[:, c.q_size:c.q_size + c.kv_size].view(num_tokens, c.num_kv_heads, c.head_dim)
        return apply_rope(q, angles.cos, angles.sin), apply_rope(k, angles.cos, angles.sin)


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: Mapping[str, Weight], device: torch.device,
                 dtype: torch.dtype, products: Products | None = None) -> None:
        """``weights``: Hugging Face names to float tensors or packed GGUF blocks; ``products``:
        the weight format that turns them into products (default: float, ``F.linear``)."""
        self.config = config
        self.device = device
        self.dtype = dtype
        self.products = products if products is not None else DenseProducts(TorchLinear(), device, dtype)
        make = self.products.product

        def w(name: str) -> Weight:
            if name not in weights:
                raise ValueError(f"weight {name!r} missing from the checkpoint")
            return weights[name]

        def vector(name: str) -> torch.Tensor:
            t = w(name)
            assert isinstance(t, torch.Tensor), name     # norms and biases are never quantized
            return t.to(device=device, dtype=dtype).contiguous()

        embed = w("model.embed_tokens.weight")
        self.lm_head = make("lm_head", [embed if config.tie_word_embeddings else w("lm_head.weight")], is_head=True)
        self.embed = self.products.embedding(embed, self.lm_head if config.tie_word_embeddings else None)
        self.final_norm = vector("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if config.attention_bias:
                bias = torch.cat([vector(a + "q_proj.bias"), vector(a + "k_proj.bias"), vector(a + "v_proj.bias")])
            self.layers.append(LayerWeights(
                input_norm=vector(p + "input_layernorm.weight"),
                qkv=make(a + "qkv", [w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")], bias),
                o=make(a + "o_proj", [w(a + "o_proj.weight")]),
                post_norm=vector(p + "post_attention_layernorm.weight"),
                gate_up=make(p + "mlp.gate_up", [w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")]),
                down=make(p + "mlp.down_proj", [w(p + "mlp.down_proj.weight")]),
            ))
        self.rope = Rope(config, device, dtype)
        self.scale = config.head_dim ** -0.5

    @property
    def weight_nbytes(self) -> int:
        """Bytes of weights a decode step reads: every layer's products and norms, the final norm
        and the LM head (a tied embedding is the head; the lookup reads a row)."""
        products = [self.lm_head] + [p for lw in self.layers for p in (lw.qkv, lw.o, lw.gate_up, lw.down)]
        norms = [self.final_norm] + [t for lw in self.layers for t in (lw.input_norm, lw.post_norm)]
        return sum(p.nbytes for p in products) + sum(t.numel() * t.element_size() for t in norms)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVStorage,
                meta: AttentionMetadata, layers: Sequence[int] | None = None) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm. ``layers``: the layers to run,
        in order (default: all; a self-drafting pass leaves some out, kvserve/spec/drafters.py)."""
        h = self.embed(input_ids)
        angles = self.rope.angles(positions)
        for i in range(self.config.num_layers) if layers is None else layers:
            q, k, v = self.layer_qkv(i, h, angles)
            attn = paged_attention(q, k, v, i, cache, meta, self.scale)
            h = self.layer_output(i, h, attn)
        return self.final_norm_of(h)

    # The two halves of a layer, around its attention; ``forward`` is the paged composition
    # and kvserve/blend/ composes them with its own attention.
    def layer_qkv(self, layer: int, h: torch.Tensor,
                  angles: RopeAngles) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [T, H, D], keys and values [T, Hkv, D] of ``layer`` for hidden states ``h``
        [T, hidden]; queries and keys rotated at ``angles`` (``self.rope.angles`` of the
        tokens' positions)."""
        cfg, lw = self.config, self.layers[layer]
        qkv = lw.qkv.after_norm(h, lw.input_norm, cfg.rms_norm_eps)
        q, k = self.rope.qk(qkv, angles)
        v = qkv[:, cfg.q_size + cfg.kv_size:].view(h.shape[0], cfg.num_kv_heads, cfg.head_dim)
        return q, k, v

    def layer_output(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Hidden states after ``layer``, from those before it and its attention output [T, H, D]
        (``h`` may be updated in place: callers use what this returns)."""
        lw = self.layers[layer]
        h = lw.o.add_into(h, attn.reshape(h.shape[0], self.config.q_size))
        return lw.down.swiglu_add_into(h, lw.gate_up.after_norm(h, lw.post_norm, self.config.rms_norm_eps))

    def final_norm_of(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm, the step between the last layer and ``compute_logits``."""
        return rms_norm(h, self.final_norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.head(hidden).float()

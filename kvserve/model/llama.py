"""The Llama-family decoder (Llama, SmolLM, Qwen2, Mistral) over a paged KV cache.

Plain tensors, no nn.Module: the weights of Q, K and V are fused into one matrix,
gate and up into another, so a layer is four matmuls, each through ``linear``
(kvserve/model/linear.py: the matrices are stored in the form it reads).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvserve.attention.paged import AttentionMetadata, paged_attention
from kvserve.config import ModelConfig, RopeScaling
from kvserve.kv.storage import KVStorage
from kvserve.model.linear import Linear, TorchLinear


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


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


class LlamaModel:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor],
                 device: torch.device, dtype: torch.dtype, linear: Linear | None = None) -> None:
        self.config = config
        self.device = device
        self.dtype = dtype
        self.linear = linear if linear is not None else TorchLinear()
        pack = self.linear.prepare

        def w(name: str) -> torch.Tensor:
            if name not in weights:
                raise ValueError(f"weight {name!r} missing from the checkpoint")
            return weights[name].to(device=device, dtype=dtype).contiguous()

        self.embed = w("model.embed_tokens.weight")
        self.lm_head = pack(self.embed if config.tie_word_embeddings else w("lm_head.weight"))
        self.final_norm = w("model.norm.weight")
        self.layers: list[LayerWeights] = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            bias = None
            if config.attention_bias:
                bias = torch.cat([w(a + "q_proj.bias"), w(a + "k_proj.bias"), w(a + "v_proj.bias")])
            self.layers.append(LayerWeights(
                input_norm=w(p + "input_layernorm.weight"),
                qkv=pack(torch.cat([w(a + "q_proj.weight"), w(a + "k_proj.weight"), w(a + "v_proj.weight")])),
                qkv_bias=bias,
                o=pack(w(a + "o_proj.weight")),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up=pack(torch.cat([w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight")])),
                down=pack(w(p + "mlp.down_proj.weight")),
            ))
        cos, sin = rope_tables(config)
        self.cos = cos.to(device=device, dtype=dtype)
        self.sin = sin.to(device=device, dtype=dtype)
        self.scale = config.head_dim ** -0.5

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # in float32 as Hugging Face does, then back to the compute dtype
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.config.rms_norm_eps)
        return weight * normed.to(x.dtype)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cache: KVStorage,
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [num_tokens, hidden] after the final norm."""
        h = F.embedding(input_ids, self.embed)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        for i in range(self.config.num_layers):
            q, k, v = self.layer_qkv(i, h, cos, sin)
            attn = paged_attention(q, k, v, i, cache, meta, self.scale)
            h = self.layer_output(i, h, attn)
        return self._rms_norm(h, self.final_norm)

    # The two halves of a layer, around its attention; ``forward`` is the paged composition
    # and kvserve/blend/ composes them with its own attention.
    def layer_qkv(self, layer: int, h: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Queries [T, H, D], keys and values [T, Hkv, D] of ``layer`` for hidden states ``h``
        [T, hidden]; queries and keys rotated by ``cos``/``sin`` ([T, 1, D / 2], the rows of
        ``self.cos``/``self.sin`` at the tokens' positions)."""
        cfg, lw = self.config, self.layers[layer]
        num_tokens = h.shape[0]
        q_end, k_end = cfg.q_size, cfg.q_size + cfg.kv_size
        qkv = self.linear(self._rms_norm(h, lw.input_norm), lw.qkv, lw.qkv_bias)
        q = qkv[:, :q_end].view(num_tokens, cfg.num_heads, cfg.head_dim)
        k = qkv[:, q_end:k_end].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, k_end:].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def layer_output(self, layer: int, h: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Hidden states after ``layer``, from those before it and its attention output [T, H, D]."""
        lw = self.layers[layer]
        h = h + self.linear(attn.reshape(h.shape[0], self.config.q_size), lw.o)
        gate, up = self.linear(self._rms_norm(h, lw.post_norm), lw.gate_up).chunk(2, dim=-1)
        return h + self.linear(F.silu(gate) * up, lw.down)

    def final_norm_of(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm, the step between the last layer and ``compute_logits``."""
        return self._rms_norm(h, self.final_norm)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.linear.head(hidden, self.lm_head).float()

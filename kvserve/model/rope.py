"""Rotary position embeddings: the tables, the rotation, and a step's rotation of queries and keys.

Every model here rotates in the half-split layout (GPT-NeoX, Hugging Face Llama: channel j
pairs with j + D / 2); GGUF checkpoints that store Q and K rows interleaved are reordered by
the loader. A layer's RoPE is its ``LayerSpec``'s base and scaling: a model whose layers differ
(Gemma 3: 10,000 on sliding layers, 1,000,000 on full ones) holds one ``Rope`` per distinct spec.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch

from kvserve.config import ModelConfig, RopeScaling
from kvserve.model.cpu_extension import load_extension
from kvserve.model.linear import rms_norm


class RopeBase(NamedTuple):
    """What a rotation table depends on."""

    theta: float
    scaling: RopeScaling | None
    head_dim: int
    num_positions: int


def model_rope(config: ModelConfig) -> RopeBase:
    """The model-wide RoPE (``rope_theta`` / ``rope_scaling``)."""
    return RopeBase(config.rope_theta, config.rope_scaling, config.head_dim, config.max_position_embeddings)


def layer_ropes(config: ModelConfig) -> tuple[RopeBase, ...]:
    """Each layer's RoPE."""
    return tuple(RopeBase(s.rope_theta, s.rope_scaling, config.head_dim, config.max_position_embeddings)
                 for s in config.layer_specs)


def rope_inv_freq(base: RopeBase) -> torch.Tensor:
    dim = base.head_dim
    inv_freq = 1.0 / (base.theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    if base.scaling is not None:
        inv_freq = _llama3_scale(inv_freq, base.scaling)
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


def rope_tables(rope: ModelConfig | RopeBase) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of every position's rotation angles, [num_positions, head_dim / 2] float32 on
    the CPU: the angles in float64, their cos and sin in float32, as Hugging Face computes them
    (so logits match it closely). A ``ModelConfig`` stands for its model-wide RoPE."""
    base = model_rope(rope) if isinstance(rope, ModelConfig) else rope
    pos = torch.arange(base.num_positions, dtype=torch.float64)
    freqs = torch.outer(pos, rope_inv_freq(base)).float()
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [..., D] by angles given as ``cos``/``sin`` [..., D / 2] (broadcast), in the
    half-split layout; anything that re-rotates keys calls this."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RopeAngles(NamedTuple):
    """A step's rotation angles under one RoPE, as ``Rope.qk`` reads them: the tokens' positions,
    and (torch path) the rows of the cos / sin tables there [T, 1, D / 2]."""

    positions: torch.Tensor
    cos: torch.Tensor | None
    sin: torch.Tensor | None


class Rope:
    """RoPE of a step's queries and keys under one base: from the fused Q/K/V product's rows,
    one C++ call on the CPU in float32 (bit for bit ``apply_rope``'s result), ``apply_rope``
    else; or of given queries and keys (``rotate``)."""

    def __init__(self, base: RopeBase, num_heads: int, num_kv_heads: int, device: torch.device,
                 dtype: torch.dtype) -> None:
        cos, sin = rope_tables(base)
        self.cos = cos.to(device=device, dtype=dtype).contiguous()
        self.sin = sin.to(device=device, dtype=dtype).contiguous()
        self.base = base
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, base.head_dim
        self.ext = load_extension() if device.type == "cpu" and dtype == torch.float32 else None

    def angles(self, positions: torch.Tensor) -> RopeAngles:
        if self.ext is not None:
            return RopeAngles(positions, None, None)
        return RopeAngles(positions, self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1))

    def qk(self, qkv: torch.Tensor, angles: RopeAngles) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated queries [T, H, D] and keys [T, Hkv, D] from qkv [T, (H + 2 Hkv) D]."""
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.ext is not None:
            return self.ext.rope_qk(qkv, angles.positions, self.cos, self.sin, h, hkv, d)
        num_tokens = qkv.shape[0]
        q = qkv[:, :h * d].view(num_tokens, h, d)
        k = qkv[:, h * d:(h + hkv) * d].view(num_tokens, hkv, d)
        return self.rotate(q, k, angles)

    def step_qk(self, angles: RopeAngles) -> Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        """``qk`` with one step's ``angles`` bound, for a loop over the layers."""
        ext = self.ext
        if ext is None:
            return lambda qkv: self.qk(qkv, angles)
        args = (angles.positions, self.cos, self.sin, self.num_heads, self.num_kv_heads, self.head_dim)
        return lambda qkv: ext.rope_qk(qkv, *args)

    def step_qk_normed(self, angles: RopeAngles, eps: float) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
        """``qk_normed`` with one step's ``angles`` bound: (qkv, q_weight, k_weight) -> (q, k)."""
        ext = self.ext
        if ext is None:
            return lambda qkv, qw, kw: self.qk_normed(qkv, angles, qw, kw, eps)
        pos, cos, sin, h, hkv, d = angles.positions, self.cos, self.sin, self.num_heads, self.num_kv_heads, self.head_dim
        return lambda qkv, qw, kw: ext.qk_norm_rope(qkv, pos, cos, sin, qw, kw, h, hkv, d, eps)

    def qk_normed(self, qkv: torch.Tensor, angles: RopeAngles, q_weight: torch.Tensor, k_weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``qk`` with each head's query and key RMS-normed first (weights [D]): one C++ call on the
        CPU in float32, torch else."""
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        if self.ext is not None:
            return self.ext.qk_norm_rope(qkv, angles.positions, self.cos, self.sin, q_weight, k_weight, h, hkv, d, eps)
        n = qkv.shape[0]
        q = rms_norm(qkv[:, :h * d].view(n, h, d), q_weight, eps)
        k = rms_norm(qkv[:, h * d:(h + hkv) * d].view(n, hkv, d), k_weight, eps)
        return self.rotate(q, k, angles)

    def rotate(self, q: torch.Tensor, k: torch.Tensor, angles: RopeAngles) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries [T, H, D] and keys [T, Hkv, D] rotated at ``angles``."""
        if angles.cos is None or angles.sin is None:
            cos, sin = self.cos[angles.positions].unsqueeze(1), self.sin[angles.positions].unsqueeze(1)
        else:
            cos, sin = angles.cos, angles.sin
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

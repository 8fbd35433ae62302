"""Activation statistics for outlier protection: a float forward pass over calibration tokens,
recording the mean magnitude of every product's input channels (after its norm or SwiGLU)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from kvserve.model.linear import DenseProduct, DenseProducts, Linear, Product, TorchLinear, Weight, rms_norm
from kvserve.model.llama import LlamaModel
from kvserve.model.loaded import LoadedModel


class _Recorder:
    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.counts: dict[str, int] = {}

    def add(self, name: str, x: torch.Tensor) -> None:
        s = x.detach().abs().float().sum(dim=0)
        self.sums[name] = self.sums[name] + s if name in self.sums else s
        self.counts[name] = self.counts.get(name, 0) + x.shape[0]

    def means(self) -> dict[str, torch.Tensor]:
        return {name: s / self.counts[name] for name, s in self.sums.items()}


class _RecordingProduct(DenseProduct):
    def __init__(self, name: str, weight: torch.Tensor, linear: Linear, bias: torch.Tensor | None,
                 recorder: _Recorder) -> None:
        super().__init__(weight, linear, bias)
        self.name = name
        self.recorder = recorder

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.recorder.add(self.name, x)
        return super().__call__(x)

    def after_norm(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self(rms_norm(x, norm_weight, eps))

    def add_into(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return residual + self(x)

    def swiglu_add_into(self, residual: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return residual + self(F.silu(gate) * up)


class _RecordingProducts(DenseProducts):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__(TorchLinear(), torch.device("cpu"), torch.float32)
        self.recorder = recorder

    def product(self, name: str, parts: Sequence[Weight], bias: torch.Tensor | None = None, *,
                is_head: bool = False) -> Product:
        dense = super().product(name, parts, bias, is_head=is_head)
        assert isinstance(dense, DenseProduct)
        return _RecordingProduct(name, dense.weight, self.linear, dense.bias, self.recorder)


@torch.inference_mode()
def record_activations(loaded: LoadedModel, token_ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """Mean |x| per input channel [cols] of every product, by the name the model gives it."""
    recorder = _Recorder()
    model = LlamaModel(loaded.config, loaded.weights, torch.device("cpu"), torch.float32,
                       _RecordingProducts(recorder))
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    positions = torch.arange(len(ids))
    angles = model.rope.angles(positions)
    h = model.embed(ids)
    group = model.config.num_heads // model.config.num_kv_heads
    for layer in range(model.config.num_layers):
        q, k, v = model.layer_qkv(layer, h, angles)
        attn = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              is_causal=True, scale=model.scale, enable_gqa=group > 1)
        h = model.layer_output(layer, h, attn.transpose(0, 1))
    return recorder.means()

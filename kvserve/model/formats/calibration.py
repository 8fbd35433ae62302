"""Activation statistics for outlier protection: a float forward pass over calibration tokens,
recording the mean magnitude of every product's input channels (after its norm or SwiGLU)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.attention.reference import causal_attention
from kvserve.model.families import build_decoder
from kvserve.model.linear import DenseProduct, DenseProducts, HookedProduct, Product, TorchLinear, Weight
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


class _RecordingProducts(DenseProducts):
    def __init__(self, recorder: _Recorder) -> None:
        super().__init__(TorchLinear(), torch.device("cpu"), torch.float32)
        self.recorder = recorder

    def product(self, name: str, parts: Sequence[Weight], bias: torch.Tensor | None = None, *,
                is_head: bool = False) -> Product:
        dense = super().product(name, parts, bias, is_head=is_head)
        assert isinstance(dense, DenseProduct)

        def record(x: torch.Tensor) -> torch.Tensor:
            self.recorder.add(name, x)
            return x
        return HookedProduct(dense, record)


@torch.inference_mode()
def record_activations(loaded: LoadedModel, token_ids: Sequence[int]) -> dict[str, torch.Tensor]:
    """Mean |x| per input channel [cols] of every product, by the name the model gives it."""
    recorder = _Recorder()
    model = build_decoder(loaded.config, loaded.weights, torch.device("cpu"), torch.float32,
                       _RecordingProducts(recorder))
    ids = torch.tensor(list(token_ids), dtype=torch.long)
    positions = torch.arange(len(ids))
    angles = model.angles(positions)
    h = model.embed(ids)
    for layer in range(model.config.num_layers):
        q, k, v = model.layer_qkv(layer, h, angles)
        h = model.layer_output(layer, h, causal_attention(q, k, v, model.scale, model.windows[layer]))
    return recorder.means()

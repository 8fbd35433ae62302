"""Random packed weights of every GGUF type the kernels read (their bytes from
kvserve.model.formats.random_blocks), and the references the products are held to (shared by
the CPU and Triton kernel tests)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvserve.model.formats.packing import PackedWeight, dequantize_segment, pack_gguf
from kvserve.model.formats.random_blocks import random_gguf_bytes
from kvserve.model.linear import DenseProduct, DenseProducts, HookedProduct, Product, TorchLinear, Weight


def random_packed(type_name: str, rows: int, cols: int, seed: int) -> PackedWeight:
    return pack_gguf(type_name, random_gguf_bytes(type_name, rows, cols, seed), rows, cols)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: per row and half block of 16, int8 codes times amax / 127
    (codes rounded half to even in float32, as the kernel rounds)."""
    rows, cols = x.shape
    b = x.float().reshape(rows, cols // 16, 16)
    amax = b.abs().amax(dim=-1, keepdim=True)
    # 127 / amax as the kernel divides, in float32 (torch's scalar / tensor multiplies by a
    # reciprocal instead, whose last bit can move a product that lies on a tie to the other code)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0) / torch.where(amax > 0, amax, 1.0), 0.0)
    codes = torch.round(b * inv).clamp(-128, 127)
    return (codes * (amax / 127.0)).reshape(rows, cols)


def mirror(x: torch.Tensor, w: PackedWeight) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's product in float64 with the kernel's own roundings of the activations,
    y = x_hat W^T (the integer part is exact), and a bound on float32 accumulation error per
    output (sum |x_hat| |w|, times a few ulp). Outlier channels are zeroed before the
    activations are quantized and added back in float."""
    xq = x.double().clone()
    if w.outliers is not None:
        xq[:, w.outliers.channels.long()] = 0.0
    x_hat = quantize_activations(xq).double()
    outs, bounds = [], []
    for seg in w.segments:
        weight = dequantize_segment(seg).double()
        outs.append(x_hat @ weight.T)
        bounds.append(x_hat.abs() @ weight.abs().T)
    y, bound = torch.cat(outs, dim=1), torch.cat(bounds, dim=1)
    if w.outliers is not None:
        y = y + x.double()[:, w.outliers.channels.long()] @ w.outliers.weight.double().T
    if w.bias is not None:
        y = y + w.bias.double()
    return y, bound


class RoundingProducts(DenseProducts):
    """The model in float32 with the activations of every product of packed weights rounded as
    the kernels round them (a product with a float part stays float, as the gguf format keeps
    it): what the gguf format computes, up to float32 summation order."""

    def __init__(self) -> None:
        super().__init__(TorchLinear(), torch.device("cpu"), torch.float32)

    def product(self, name: str, parts: Sequence[Weight], bias: torch.Tensor | None = None, *,
                is_head: bool = False) -> Product:
        dense = super().product(name, parts, bias, is_head=is_head)
        assert isinstance(dense, DenseProduct)
        if not all(isinstance(p, PackedWeight) for p in parts):
            return dense
        return HookedProduct(dense, quantize_activations)

"""Packed weights multiplied on the CPU by the C++ kernel (csrc/qkernel.h), read in place.

Each product is one call: the prologue (RMSNorm, or SwiGLU / GeGLU of the gate and up halves), the
activations' quantization to int8 per block of 32, the integer products, the outlier
channels in float32, the bias, and the add into the residual all happen inside it. Inputs
and outputs are float32.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from kvserve.model.formats.kernel import QuantKernel
from kvserve.model.formats.packing import LANES, PART_NAMES, PackedWeight
from kvserve.model.linear import Embedding, Product

NONE, RMSNORM, SWIGLU, GEGLU = 0, 1, 2, 3      # csrc/qkernel.h Prologue
_ABSENT = torch.empty(())
# Product.bound's forms: (prologue, add into the output)
_BOUND_FORMS = {"call": (NONE, False), "after_norm": (RMSNORM, False), "add_into": (NONE, True),
                "swiglu_add_into": (SWIGLU, True), "geglu": (GEGLU, False)}


def register(ext: ModuleType, w: PackedWeight) -> object:
    """The kernel's handle for ``w`` (shapes checked once, here)."""
    segments = []
    for s in w.segments:
        group_blocks = s.group // 32 if s.kind.is_grouped else 1
        segments.append((int(s.kind), s.rows, s.cols, group_blocks,
                         [s.parts.get(name, _ABSENT) for name in PART_NAMES]))
    channels, weight = _ABSENT, _ABSENT
    if w.outliers is not None:
        if len(w.segments) != 1:
            raise ValueError("outlier channels are supported on single-segment weights")
        n = w.outliers.channels.numel()
        tiles = w.segments[0].tiles
        padded = torch.zeros(tiles * LANES, n)
        padded[:w.rows] = w.outliers.weight.float()
        channels = w.outliers.channels.to(torch.int32).contiguous()
        weight = padded.reshape(tiles, LANES, n).transpose(1, 2).contiguous()
    bias = _ABSENT if w.bias is None else w.bias.float().contiguous()
    return ext.make_weight(segments, bias, channels, weight)


class CpuPackedProduct(Product):
    def __init__(self, ext: ModuleType, packed: PackedWeight) -> None:
        self.ext = ext
        self.packed = packed
        self.rows, self.cols = packed.shape
        self.handle = register(ext, packed)

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def _run(self, x: torch.Tensor, out: torch.Tensor, prologue: int, norm: torch.Tensor, eps: float,
             add: bool) -> torch.Tensor:
        if x.stride(-1) != 1:
            x = x.contiguous()
        self.ext.linear(self.handle, x, out, prologue, norm, eps, add)
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, x.new_empty(x.shape[0], self.rows), NONE, _ABSENT, 0.0, False)

    def after_norm(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._run(x, x.new_empty(x.shape[0], self.rows), RMSNORM, norm_weight, eps, False)

    def add_into(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, residual, NONE, _ABSENT, 0.0, True)

    def swiglu_add_into(self, residual: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        return self._run(gate_up, residual, SWIGLU, _ABSENT, 0.0, True)

    def bound(self, form: str, norm_weight: torch.Tensor | None = None,
              eps: float = 0.0) -> Callable[[torch.Tensor, torch.Tensor], object] | None:
        """The kernel's call with this product's handle and form bound (inputs with unit column
        stride: the caller's buffers)."""
        prologue, add = _BOUND_FORMS[form]
        linear, handle = self.ext.linear, self.handle
        norm = _ABSENT if norm_weight is None else norm_weight
        return lambda x, out: linear(handle, x, out, prologue, norm, eps, add)

    def geglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._run(gate_up, gate_up.new_empty(gate_up.shape[0], self.rows), GEGLU, _ABSENT, 0.0, False)


class CpuPackedEmbedding(Embedding):
    """Rows of a packed embedding, dequantized as they are looked up (shares the LM head's
    packed blocks when the two are tied)."""

    def __init__(self, product: CpuPackedProduct) -> None:
        self.product = product

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return self.product.ext.dequantize_rows(self.product.handle, ids.to(torch.long).contiguous())


class CpuKernel(QuantKernel):
    name = "cpu"

    def __init__(self, ext: ModuleType) -> None:
        self.ext = ext

    def product(self, packed: PackedWeight) -> Product:
        return CpuPackedProduct(self.ext, packed)

    def embedding(self, product: Product) -> Embedding:
        if not isinstance(product, CpuPackedProduct):
            raise TypeError(f"the CPU kernel looks up rows of its own products, not of {type(product).__name__}")
        return CpuPackedEmbedding(product)

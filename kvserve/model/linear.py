"""The decoder's products (``x @ W^T``): each matrix of the model is a ``Product``, with the
fused forms a layer uses (norm then product, product added into the residual, SwiGLU then
product). ``DenseProduct`` holds float weights and multiplies them with a float backend,
by name (``--linear-backend``); quantized weights are products of their own
(kvserve/model/formats/: the GGUF's blocks or int8 / int4 groups, read in place).

    torch    ``F.linear`` on the weights as loaded
    onednn   the weights reordered once, at load, into oneDNN's blocked layout, and multiplied
             by oneDNN (``torch.ops.mkldnn``: what torch.compile's CPU weight freezing uses);
             CPU, float32 only
    auto     onednn where it runs (CPU, float32, a torch built with oneDNN), else torch

Why: on the project's CPU box (AMD EPYC, 2 cores, torch 2.13's MKL 2024.2) ``F.linear``
streams SmolLM2-135M's layer weights at about 10 GB/s for decode batches of 1-16 rows,
a quarter of the memory bandwidth; the packed oneDNN product reads them at 26-39 GB/s:
2.0-3.4x faster at 1-16 rows, 2.2-2.3x at 64-512 (prefill chunks), 1.3-3.3x for the LM
head (``python -m kvserve.bench.linear``, docs/benchmarks.md). Decode of a small model is bound by reading the
weights, so this is most of a decode step. Results differ from ``F.linear`` only in float32
summation order.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvserve.config import LINEAR_BACKENDS
from kvserve.model.formats.packing import PackedWeight, dequantize

log = logging.getLogger(__name__)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, as Hugging Face computes it, then back to x's dtype, times ``weight``."""
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


class Product(ABC):
    """One weight matrix W [rows, cols] of the model, held in the form its backend multiplies,
    with an optional bias. The fused forms compute what their names say; an implementation
    may run each in one call. ``x`` rows are tokens."""

    rows: int
    cols: int

    @property
    @abstractmethod
    def nbytes(self) -> int:
        """Bytes the weight holds in memory (what a decode step reads)."""

    @abstractmethod
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, cols] -> x W^T + bias [T, rows]."""

    @abstractmethod
    def after_norm(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``rms_norm(x, norm_weight, eps)`` W^T + bias."""

    @abstractmethod
    def add_into(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + x W^T; ``residual`` may be updated in place (and is then returned)."""

    @abstractmethod
    def swiglu_add_into(self, residual: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """residual + (silu(gate) * up) W^T, gate and up the two halves of ``gate_up`` [T, 2 cols];
        ``residual`` may be updated in place (and is then returned)."""

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head's product: a few rows against the whole vocabulary."""
        return self(x)

    def bound(self, form: str, norm_weight: torch.Tensor | None = None,
              eps: float = 0.0) -> Callable[[torch.Tensor, torch.Tensor], object] | None:
        """One form as a direct call ``(x, out)`` for a loop over the layers: ``call`` (``__call__``),
        ``after_norm`` and ``geglu`` written into ``out``, ``add_into`` / ``swiglu_add_into``
        added into ``out`` in place (the residual); None where the backend has no such call (then
        the methods serve)."""
        return None

    def geglu(self, gate_up: torch.Tensor) -> torch.Tensor:
        """(gelu_tanh(gate) * up) W^T + bias, gate and up the two halves of ``gate_up`` [T, 2 cols]."""
        gate, up = gate_up.chunk(2, dim=-1)
        return self(F.gelu(gate, approximate="tanh") * up)


class DenseProduct(Product):
    """Float weights through a float backend; the fused forms are the plain torch compositions."""

    def __init__(self, weight: torch.Tensor, linear: Linear, bias: torch.Tensor | None = None) -> None:
        self.rows, self.cols = weight.shape
        self._nbytes = weight.numel() * weight.element_size() + (0 if bias is None else bias.numel() * bias.element_size())
        self.weight = linear.prepare(weight)
        self.bias = bias
        self.linear = linear

    @property
    def nbytes(self) -> int:
        return self._nbytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x, self.weight, self.bias)

    def after_norm(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.linear(rms_norm(x, norm_weight, eps), self.weight, self.bias)

    def add_into(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return residual + self.linear(x, self.weight, self.bias)

    def swiglu_add_into(self, residual: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return residual + self.linear(F.silu(gate) * up, self.weight, self.bias)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear.head(x, self.weight)


class Linear(ABC):
    name: ClassVar[str]

    @abstractmethod
    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight [out, in] in the form ``__call__`` reads (done once, at load)."""

    @abstractmethod
    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, in] -> [rows, out]; ``weight`` as ``prepare`` returned it."""

    def head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The LM head's product: a few rows against the whole vocabulary."""
        return self(x, weight)


class TorchLinear(Linear):
    name = "torch"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return weight

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, weight, bias)

    def head(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # (W @ x^T)^T rather than x @ W^T: for a few rows against the 49k-row vocabulary,
        # MKL runs this orientation about 1.6x faster on CPU (measured at 8 and 16 rows;
        # equal at 1).
        return torch.mm(weight, x.t()).t()


class OneDnnLinear(Linear):
    name = "onednn"

    def prepare(self, weight: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous())

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if x.shape[0] == 1:
            # one row takes oneDNN's matrix-vector path, which sums some products (K = 1,536
            # here) in another order than the matrix path does for the same row in a batch;
            # as two rows it takes the matrix path, so a token's result never depends on
            # what it was batched with (a prefix hit then writes the cold run's exact KV)
            return torch.ops.mkldnn._linear_pointwise(x.expand(2, -1).contiguous(), weight, bias,
                                                      "none", [], "")[:1]
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, bias, "none", [], "")


def onednn_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the onednn backend cannot run here, or None when it can (a small product is
    checked against ``F.linear``, so a torch without the ops or with a broken build says so)."""
    if device.type != "cpu":
        return f"onednn multiplies CPU tensors, the engine is on {device}"
    if dtype != torch.float32:
        return f"onednn is used for float32 only, the compute dtype is {dtype}"
    if not torch.backends.mkldnn.is_available():
        return "this torch was built without oneDNN"
    try:
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(24, 40, generator=g), torch.randn(3, 40, generator=g)
        got = OneDnnLinear()(x, OneDnnLinear().prepare(w))
    except (RuntimeError, AttributeError) as e:
        return f"oneDNN's linear failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
    if not torch.allclose(got, F.linear(x, w), atol=1e-4, rtol=1e-5):
        return "oneDNN's linear disagrees with F.linear"
    return None


def make_linear(name: str, device: torch.device, dtype: torch.dtype) -> Linear:
    if name not in LINEAR_BACKENDS:
        raise ValueError(f"linear_backend must be one of {', '.join(LINEAR_BACKENDS)}, got {name!r}")
    if name == "torch":
        return TorchLinear()
    reason = onednn_unavailable_reason(device, dtype)
    if reason is None:
        return OneDnnLinear()
    if name == "onednn":
        raise ValueError(f"linear_backend onednn cannot run here: {reason}")
    if device.type == "cpu" and dtype == torch.float32:   # where auto would have taken it: say why not
        log.info("linear backend: torch (%s)", reason)
    return TorchLinear()


class HookedProduct(DenseProduct):
    """A float product whose input passes through ``hook`` first (the fused forms call it on
    the normed / SwiGLU input): activation statistics (kvserve/model/formats/calibration.py),
    or the quantized kernels' rounding, simulated (tests)."""

    def __init__(self, product: DenseProduct, hook: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.rows, self.cols, self._nbytes = product.rows, product.cols, product.nbytes
        self.weight, self.bias, self.linear = product.weight, product.bias, product.linear
        self.hook = hook

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(self.hook(x))

    def after_norm(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self(rms_norm(x, norm_weight, eps))

    def add_into(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return residual + self(x)

    def swiglu_add_into(self, residual: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return residual + self(F.silu(gate) * up)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return self(x)


class Embedding(ABC):
    """The token embedding [vocab, hidden], in the form it is stored (the LM head may share it)."""

    @abstractmethod
    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids [T] -> their rows [T, hidden] in the compute dtype."""


class DenseEmbedding(Embedding):
    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


Weight = torch.Tensor | PackedWeight     # a loaded matrix: float, or a GGUF file's blocks


def as_float(w: Weight) -> torch.Tensor:
    """A loaded matrix as float32 (packed blocks dequantized: the values a kernel multiplies by)."""
    return dequantize(w) if isinstance(w, PackedWeight) else w


class Products(ABC):
    """Turns a loaded model's matrices into its products and embedding, in one weight format
    (``name``, part of the model's fingerprint)."""

    name: str

    @abstractmethod
    def product(self, name: str, parts: Sequence[Weight], bias: torch.Tensor | None = None, *,
                is_head: bool = False) -> Product:
        """The product of ``parts`` stacked by rows (Q, K and V; gate and up), named ``name``."""

    @abstractmethod
    def embedding(self, weight: Weight, tied_head: Product | None) -> Embedding:
        """The token embedding; ``tied_head``: the LM head's product when the two share weights."""


class DenseProducts(Products):
    """The ``native`` format: every matrix in the compute dtype, through a float backend."""

    name = "native"

    def __init__(self, linear: Linear, device: torch.device, dtype: torch.dtype) -> None:
        self.linear = linear
        self.device = device
        self.dtype = dtype

    def _float(self, w: Weight) -> torch.Tensor:
        return as_float(w).to(device=self.device, dtype=self.dtype).contiguous()

    def product(self, name: str, parts: Sequence[Weight], bias: torch.Tensor | None = None, *,
                is_head: bool = False) -> Product:
        weight = self._float(parts[0]) if len(parts) == 1 else torch.cat([self._float(p) for p in parts])
        return DenseProduct(weight, self.linear, None if bias is None else self._float(bias))

    def embedding(self, weight: Weight, tied_head: Product | None) -> Embedding:
        return DenseEmbedding(self._float(weight))

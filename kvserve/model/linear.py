"""The decoder's dense products (``x @ W^T``), by name: ``--linear-backend``.

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
from typing import ClassVar

import torch
import torch.nn.functional as F

from kvserve.config import LINEAR_BACKENDS

log = logging.getLogger(__name__)


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

"""An engine's weight format (spec.py), chosen and built: which kernel multiplies packed weights
on this device, and how each loaded matrix becomes a product.

    make_products(parse_weight_format("auto"), loaded, device, dtype, linear)  -> Products (kvserve/model/linear.py)

``gguf`` keeps the file's blocks where every part of a product (Q, K and V; gate and up) is in a
type a kernel reads, and dequantizes the product otherwise (one log line per cause). ``int8`` /
``int4`` quantize every matrix at load from its float values (a quantized file's values
dequantized first: said in the log). Outlier channels (``+outN``) are chosen from activations
measured on a calibration text shipped in the package (kvserve/data/botchan.txt, its last
tokens: the quality harness reads its beginning).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import replace
from importlib import resources

import torch

from kvserve.model.cpu_extension import load_extension
from kvserve.model.formats.cpu import CpuKernel
from kvserve.model.formats.kernel import QuantKernel
from kvserve.model.formats.packing import Outliers, PackedWeight, quantize_int4, quantize_int8, stack
from kvserve.model.formats.spec import WeightFormat
from kvserve.model.linear import DenseProduct, DenseProducts, Embedding, Linear, Product, Products, Weight, as_float
from kvserve.model.loaded import LoadedModel

log = logging.getLogger(__name__)

HEAD_GROUP = 32                   # int4 formats keep the LM head / embedding in int8 per 32 columns
CALIBRATION_TOKENS = 512


def quant_kernel(device: torch.device, dtype: torch.dtype) -> tuple[QuantKernel | None, str | None]:
    """The kernel that multiplies packed weights here, or None and why not."""
    if device.type == "cpu":
        if dtype != torch.float32:
            return None, f"quantized weights on the CPU compute in float32, the compute dtype is {dtype}"
        ext = load_extension()
        if ext is None:
            return None, "the C++ quantized-weight kernel could not be built (see the log)"
        return CpuKernel(ext), None
    if device.type == "cuda":
        from kvserve.model.formats.triton import TritonKernel, triton_unavailable_reason  # imports triton

        reason = triton_unavailable_reason(device, dtype)
        return (TritonKernel(device, dtype), None) if reason is None else (None, reason)
    return None, f"no quantized-weight kernel for {device.type} devices"


def has_packed(weights: Mapping[str, Weight]) -> bool:
    return any(isinstance(w, PackedWeight) for w in weights.values())


def resolve(fmt: WeightFormat, loaded: LoadedModel, device: torch.device,
            dtype: torch.dtype) -> tuple[WeightFormat, QuantKernel | None]:
    """The format ``fmt`` comes to for this model and device, and its kernel (None for native).
    ``auto`` is gguf when the file has blocks a kernel here reads, else native; an explicit
    format that cannot run raises ValueError saying why."""
    if fmt.base == "native":
        return fmt, None
    packed = has_packed(loaded.weights)
    if fmt.base == "auto":
        if not packed:
            return WeightFormat("native"), None
        kernel, reason = quant_kernel(device, dtype)
        if kernel is None:
            log.info("weight format: native (the file's quantized blocks are dequantized: %s)", reason)
            return WeightFormat("native"), None
        return WeightFormat("gguf"), kernel
    if fmt.base == "gguf" and not packed:
        raise ValueError(f"weight format gguf keeps a GGUF file's quantized blocks, and {loaded.source} has "
                         "none (float weights): use native, int8 or int4")
    kernel, reason = quant_kernel(device, dtype)
    if kernel is None:
        raise ValueError(f"weight format {fmt.name} cannot run here: {reason}")
    return fmt, kernel


def make_products(fmt: WeightFormat, loaded: LoadedModel, device: torch.device, dtype: torch.dtype,
                  linear: Linear) -> Products:
    """The products of ``loaded`` in the format ``fmt`` (ValueError when it cannot run here)."""
    fmt, kernel = resolve(fmt, loaded, device, dtype)
    dense = DenseProducts(linear, device, dtype)
    if kernel is None:
        return dense
    stats = calibrate(loaded) if fmt.outliers else {}
    if fmt.is_quantized_here and has_packed(loaded.weights):
        kinds = sorted({w.format_name for w in loaded.weights.values() if isinstance(w, PackedWeight)})
        log.info("weight format %s: requantizing %s's %s blocks from their float values", fmt.name,
                 loaded.source, "/".join(kinds))
    return PackedProducts(fmt, kernel, dense, stats)


class PackedProducts(Products):
    def __init__(self, fmt: WeightFormat, kernel: QuantKernel, dense: DenseProducts,
                 activation_stats: Mapping[str, torch.Tensor]) -> None:
        self.fmt = fmt
        self.name = fmt.name
        self.kernel = kernel
        self.dense = dense
        self.activation_stats = activation_stats
        self._said: set[str] = set()

    def product(self, name: str, parts: Sequence[Weight], bias: torch.Tensor | None = None, *,
                is_head: bool = False) -> Product:
        if self.fmt.base == "gguf":
            packed = [p for p in parts if isinstance(p, PackedWeight)]
            if len(packed) == len(parts):
                return self.kernel.product(stack(packed, None if bias is None else bias.float()))
            self._say(f"{name} is dequantized: a part of it is float in the file, or was in a type no kernel "
                      "reads (the loader's log names those)")
            return self.dense.product(name, parts, bias, is_head=is_head)
        return self.kernel.product(self._quantize(name, parts, bias, is_head))

    def embedding(self, weight: Weight, tied_head: Product | None) -> Embedding:
        if tied_head is not None and not isinstance(tied_head, DenseProduct):
            return self.kernel.embedding(tied_head)          # the head's blocks, shared
        if self.fmt.base == "gguf":
            if isinstance(weight, PackedWeight):
                return self.kernel.embedding(self.kernel.product(weight))
            return self.dense.embedding(weight, None)
        return self.kernel.embedding(self.kernel.product(self._quantize("embedding", [weight], None, True)))

    def _quantize(self, name: str, parts: Sequence[Weight], bias: torch.Tensor | None, is_head: bool) -> PackedWeight:
        w = torch.cat([as_float(p).float().cpu() for p in parts]) if len(parts) > 1 else as_float(parts[0]).float().cpu()
        cols = w.shape[1]
        int4 = self.fmt.base == "int4" and not is_head
        group = HEAD_GROUP if is_head and self.fmt.base == "int4" else (self.fmt.group or cols)
        if cols % group:
            raise ValueError(f"weight format {self.fmt.name}: {name} has {cols} input columns, not a multiple of "
                             f"{group}; choose a group that divides every matrix's input width")
        outliers = None
        if self.fmt.outliers and not is_head:
            stats = self.activation_stats[name]
            channels = torch.topk(stats, self.fmt.outliers).indices.sort().values
            outliers = Outliers(channels.to(torch.int32), w[:, channels].contiguous())
            w = w.clone()
            w[:, channels] = 0.0
        packed = quantize_int4(w, group) if int4 else quantize_int8(w, group)
        return replace(packed, bias=None if bias is None else bias.float().cpu(), outliers=outliers)

    def _say(self, message: str) -> None:
        if message not in self._said:
            self._said.add(message)
            log.info("weight format %s: %s", self.fmt.name, message)


# ---- activation statistics for outlier channels -----------------------------------------

def calibration_text() -> str:
    return resources.files("kvserve").joinpath("data/botchan.txt").read_text(encoding="utf-8")


def calibrate(loaded: LoadedModel, num_tokens: int = CALIBRATION_TOKENS) -> dict[str, torch.Tensor]:
    """Mean |activation| per input channel of every product, by product name, from a float
    forward pass over the last ``num_tokens`` tokens of the calibration text."""
    from kvserve.model.formats.calibration import record_activations

    if loaded.tokenizer is None:
        raise ValueError("outlier protection measures activations on a text, and this model has no tokenizer")
    num_tokens = min(num_tokens, loaded.config.max_position_embeddings)
    text = calibration_text()
    ids = loaded.tokenizer.encode(text[-8 * num_tokens:])[-num_tokens:]
    return record_activations(loaded, ids)

"""KV memory arithmetic: bytes per token, per sequence, per batch; what fits in a budget; what
prefix sharing saves; what the offload tiers hold. Everything is counted in whole blocks.

A running sequence of n tokens holds ceil(n / B) blocks, the last one partly filled:

    tokens   |0 ........ 15|16 ....... 31|32 .. 39 ...... 47|
    blocks   |   block 0   |   block 1   |  block 2 (open)   |   n = 40: 3 blocks

Under a format with halves that encode whole blocks (KIVI keys: statistics over the block's
tokens), each such half has floor(n / B) quantized blocks plus one open block of B tokens in
the compute dtype (the engine's residual row), reserved for every running sequence even when
n is a multiple of B (the next token opens it). Other halves store each token as it comes.

The KV budget is given (``memory_bytes``), or is what a device (``device_bytes``) leaves beside
the weights (weights.py counts them in a weight format).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvserve.config import ModelConfig
from kvserve.kv.codecs import KVFormat
from kvserve.offload.serialization import HEADER_NBYTES
from kvserve.plan.formats import BLOCK_SIZE, FormatSpec, build_format, compute_dtype, display_name
from kvserve.plan.models import ModelShape, resolve_model
from kvserve.plan.weights import WeightCount

GIB = 1 << 30
# The header a host / disk / Redis tier stores with each block (key, format, length, checksum).
TIER_BLOCK_HEADER_NBYTES = HEADER_NBYTES


class Capacity(NamedTuple):
    """What ``nbytes`` of memory holds. ``num_sequences`` counts sequences of the plan's context
    length; None where a sequence has nothing to store there (shorter than a block, in a tier)."""

    nbytes: int
    num_blocks: int
    num_tokens: int
    num_sequences: int | None


class Sharing(NamedTuple):
    """``num_users`` sequences of ``context_tokens`` that start with the same ``prefix_tokens``.
    Only the prefix's full blocks are shared; its partial block is each user's own."""

    prefix_tokens: int
    num_users: int
    context_tokens: int
    shared_blocks: int
    shared_tokens: int
    without_sharing_nbytes: int
    with_sharing_nbytes: int

    @property
    def saved_nbytes(self) -> int:
        return self.without_sharing_nbytes - self.with_sharing_nbytes


@dataclass(frozen=True)
class KVLayout:
    """A model's KV cache in the engine's ``KVFormat``, in blocks of ``block_size`` tokens.
    ``compute_format`` is the dtype of the residual (the open block) and of ``native``."""

    model: ModelShape
    kv_format: KVFormat
    block_size: int = BLOCK_SIZE
    compute_format: str = "fp16"

    def __post_init__(self) -> None:
        if len(self.kv_format.layers) != self.model.num_layers:
            raise ValueError(f"{len(self.kv_format.layers)} layer formats for {self.model.num_layers} layers")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block size must be a power of two, got {self.block_size}")
        compute_dtype(self.compute_format)
        _ = self.block_nbytes  # raises now, not at first use, if a format cannot store this head_dim

    @classmethod
    def build(cls, model: str | ModelShape | ModelConfig, kv_format: FormatSpec = "fp16", *,
              key_format: str | None = None, value_format: str | None = None,
              block_size: int = BLOCK_SIZE, compute_format: str = "fp16") -> KVLayout:
        shape = resolve_model(model)
        fmt = build_format(shape.num_layers, shape.head_dim, kv_format, compute_dtype(compute_format),
                           key_format, value_format)
        return cls(shape, fmt, block_size, compute_format)

    def _block_nbytes(self, residual: bool, sliding: bool | None = None) -> int:
        """Bytes of one block over all KV heads, of the halves that keep a residual
        (``residual``: they encode whole blocks, so the open block waits in the compute dtype
        until it is full) or of the others; of every layer, or (``sliding``) of the layers that
        attend over a sliding window or of the others."""
        m, b, fmt = self.model, self.block_size, self.kv_format
        if fmt.refine is not None:      # zip: every half keeps a residual; a block costs lo + salient x hi
            return fmt.nbytes_per_block(b, m.num_kv_heads, m.head_dim) if residual else 0
        windowed = set(m.sliding_layers)
        return sum(c.nbytes_per_block(b, m.num_kv_heads, m.head_dim)
                   for i, layer in enumerate(fmt.layers) for c in (layer.key, layer.value)
                   if c.encodes_whole_blocks == residual and (sliding is None or (i in windowed) == sliding))

    def bytes_per_token_by_kind(self) -> dict[str, float]:
        """Bytes a token's block costs in the full-attention layers and in the sliding ones."""
        return {kind: (self._block_nbytes(False, sliding) + self._block_nbytes(True, sliding)) / self.block_size
                for kind, sliding in (("full", False), ("sliding", True))}

    def _window_blocks(self) -> int:
        """Blocks a sliding layer holds for one sequence: its window's, and the open one."""
        windows = [w for w in self.model.windows if w is not None]
        return self.num_blocks(max(windows)) + 1 if windows else 0

    @property
    def block_nbytes(self) -> int:
        """One full block: K and V, all layers and KV heads."""
        return self._block_nbytes(residual=False) + self._block_nbytes(residual=True)

    @property
    def bytes_per_token(self) -> float:
        """``block_nbytes / block_size``: a whole number for every built-in model and format at B=16."""
        return self.block_nbytes / self.block_size

    @property
    def residual_nbytes(self) -> int:
        """The open block every running sequence keeps in the compute dtype (0 without KIVI)."""
        m = self.model
        num_halves = sum(self.kv_format.keeps_rows(c) for layer in self.kv_format.layers for c in (layer.key, layer.value))
        element = torch.empty((), dtype=compute_dtype(self.compute_format)).element_size()
        return num_halves * self.block_size * m.num_kv_heads * m.head_dim * element

    @property
    def format_name(self) -> str:
        return display_name(self.kv_format)

    def num_blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def sequence_nbytes(self, num_tokens: int) -> int:
        """Bytes one running sequence of ``num_tokens`` holds (see the module docstring)."""
        if num_tokens < 1:
            raise ValueError(f"a sequence has at least one token, got {num_tokens}")
        if self.model.sliding_layers:       # those layers hold their window's blocks only
            whole, window = self.num_blocks(num_tokens), min(self.num_blocks(num_tokens), self._window_blocks())
            full = num_tokens // self.block_size
            return (whole * self._block_nbytes(False, sliding=False) + window * self._block_nbytes(False, sliding=True)
                    + full * self._block_nbytes(True, sliding=False) + min(full, window)
                    * self._block_nbytes(True, sliding=True) + self.residual_nbytes)
        plain = self.num_blocks(num_tokens) * self._block_nbytes(residual=False)
        quantized = num_tokens // self.block_size * self._block_nbytes(residual=True)
        return plain + quantized + self.residual_nbytes

    def device_capacity(self, nbytes: int, context_tokens: int) -> Capacity:
        """Blocks and tokens of a pool of ``nbytes``, and how many running sequences of
        ``context_tokens`` fit (with their residuals)."""
        num_blocks = nbytes // self.block_nbytes
        return Capacity(nbytes, num_blocks, num_blocks * self.block_size,
                        nbytes // self.sequence_nbytes(context_tokens))

    def tier_capacity(self, nbytes: int, context_tokens: int) -> Capacity:
        """What an offload tier of ``nbytes`` holds: blocks of the same payload plus
        ``TIER_BLOCK_HEADER_NBYTES`` each. Tiers hold full blocks only (only they have content
        keys), so a sequence puts ``context_tokens // block_size`` blocks there."""
        num_blocks = nbytes // (self.block_nbytes + TIER_BLOCK_HEADER_NBYTES)
        per_sequence = context_tokens // self.block_size
        return Capacity(nbytes, num_blocks, num_blocks * self.block_size,
                        num_blocks // per_sequence if per_sequence else None)

    def prefix_sharing(self, prefix_tokens: int, num_users: int, context_tokens: int) -> Sharing:
        """Memory of ``num_users`` running sequences of ``context_tokens`` without and with their
        common first ``prefix_tokens`` stored once."""
        if not 1 <= prefix_tokens <= context_tokens:
            raise ValueError(f"the shared prefix ({prefix_tokens} tokens) must be 1 to the context "
                             f"length ({context_tokens} tokens)")
        if num_users < 1:
            raise ValueError(f"the number of users must be >= 1, got {num_users}")
        shared_blocks = prefix_tokens // self.block_size
        unshared = num_users * self.sequence_nbytes(context_tokens)
        return Sharing(prefix_tokens, num_users, context_tokens, shared_blocks, shared_blocks * self.block_size,
                       unshared, unshared - (num_users - 1) * shared_blocks * self.block_nbytes)


@dataclass(frozen=True)
class PlanRequest:
    """What to plan for. ``memory_bytes``: the device KV budget, or ``device_bytes``: the
    device's memory for weights and KV together (the plan then needs the weights); ``prefix_tokens``
    and ``num_users`` go together; ``tier_nbytes``: (tier name, bytes) of offload tiers."""

    context_tokens: int
    batch_size: int = 1
    memory_bytes: int | None = None
    prefix_tokens: int | None = None
    num_users: int | None = None
    tier_nbytes: tuple[tuple[str, int], ...] = ()
    device_bytes: int | None = None

    def __post_init__(self) -> None:
        if self.context_tokens < 1:
            raise ValueError(f"the context length must be >= 1 token, got {self.context_tokens}")
        if self.batch_size < 1:
            raise ValueError(f"the batch size must be >= 1, got {self.batch_size}")
        if self.memory_bytes is not None and self.memory_bytes <= 0:
            raise ValueError(f"the KV memory budget must be positive, got {self.memory_bytes} bytes")
        if self.device_bytes is not None and self.device_bytes <= 0:
            raise ValueError(f"the device memory must be positive, got {self.device_bytes} bytes")
        if self.device_bytes is not None and self.memory_bytes is not None:
            raise ValueError("give the KV budget or the device memory (weights + KV), not both")
        if (self.prefix_tokens is None) != (self.num_users is None):
            raise ValueError("give both the shared prefix length and the number of users, or neither")
        for name, nbytes in self.tier_nbytes:
            if nbytes <= 0:
                raise ValueError(f"the {name} tier's size must be positive, got {nbytes} bytes")


@dataclass(frozen=True)
class Plan:
    """The answers for one ``PlanRequest`` on one ``KVLayout``; built by ``make_plan``.
    ``weights``: the weights when counted; ``kv_budget_nbytes``: the KV budget, given or left
    on the device beside the weights (None when neither)."""

    layout: KVLayout
    request: PlanRequest
    sequence_nbytes: int
    batch_nbytes: int
    fp16: KVLayout          # the same model and block size in fp16 and fp32, for comparison
    fp32: KVLayout
    device: Capacity | None
    sharing: Sharing | None
    tiers: tuple[tuple[str, Capacity], ...]
    weights: WeightCount | None = None
    kv_budget_nbytes: int | None = None

    @property
    def batch_fits(self) -> bool | None:
        return None if self.kv_budget_nbytes is None else self.batch_nbytes <= self.kv_budget_nbytes

    def compression(self, reference: KVLayout) -> float:
        """How many times fewer bytes per full block than ``reference``."""
        return reference.block_nbytes / self.layout.block_nbytes

    def sequence_compression(self, reference: KVLayout) -> float:
        """The same for a running sequence of the context length, residual included."""
        context = self.request.context_tokens
        return reference.sequence_nbytes(context) / self.sequence_nbytes


def kv_budget_nbytes(request: PlanRequest, weights: WeightCount | None) -> int | None:
    """The KV budget: given, or what the device leaves beside the weights (ValueError when they
    do not fit, or when a device is given without the weights)."""
    if request.device_bytes is None:
        return request.memory_bytes
    if weights is None:
        raise ValueError("a device's memory holds the weights and the KV cache: count the weights too")
    left = request.device_bytes - weights.nbytes
    if left <= 0:
        raise ValueError(f"the weights of {weights.model_name} in {weights.weight_format} "
                         f"({weights.nbytes:,} B = {weights.nbytes / GIB:.2f} GiB) do not fit in the device's "
                         f"{request.device_bytes:,} B ({request.device_bytes / GIB:.2f} GiB), so nothing is left "
                         "for the KV cache: choose a smaller weight format (int8, int4) or a larger device")
    return left


def make_plan(layout: KVLayout, request: PlanRequest, weights: WeightCount | None = None) -> Plan:
    """The plan; ``weights`` (weights.count_weights) are reported, and with ``device_bytes``
    they take their share of the device before the KV cache."""
    context = request.context_tokens
    budget = kv_budget_nbytes(request, weights)
    sequence = layout.sequence_nbytes(context)
    reference = {name: KVLayout.build(layout.model, name, block_size=layout.block_size) for name in ("fp16", "fp32")}
    sharing = None
    if request.prefix_tokens is not None and request.num_users is not None:
        sharing = layout.prefix_sharing(request.prefix_tokens, request.num_users, context)
    return Plan(
        layout=layout, request=request, sequence_nbytes=sequence, batch_nbytes=request.batch_size * sequence,
        fp16=reference["fp16"], fp32=reference["fp32"],
        device=None if budget is None else layout.device_capacity(budget, context),
        sharing=sharing,
        tiers=tuple((name, layout.tier_capacity(nbytes, context)) for name, nbytes in request.tier_nbytes),
        weights=weights, kv_budget_nbytes=budget)

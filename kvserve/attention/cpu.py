"""The CPU attention backend: a C++ kernel (csrc/) that reads every KV format in place.

Same contract as ``reference.reference_attention`` (see layout.py for the storage): each
block is read where it lies in its stored format and dequantized into a few L1-resident
rows, the ``group`` query heads of a KV head share every K/V row read, softmax is online
in float32, long contexts are split over the cores and merged. Compute is float32: q of
another float dtype is converted and the result returned in q's dtype.

The kernel is compiled on first use (cpu_extension.py); ``is_available()`` says whether
that worked (when it did not, one log line said why, and the torch backend is the one to
use). Shapes, dtypes and layouts are checked before anything is read: a layout the kernel
cannot read raises ValueError.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import ModuleType

import torch

from kvserve.attention.cpu_extension import load_extension
from kvserve.kv.storage.layout import AttentionScores, CodecKind, HalfLayout, HalfStore, PagedBatch

_DTYPE_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
_INNER_PARTS = {
    CodecKind.PLAIN: ("data",),
    CodecKind.INT8: ("codes", "scale"),
    CodecKind.FP8: ("codes", "scale"),
    CodecKind.ASYM_TOKEN: ("codes", "scale", "zero"),
    CodecKind.ASYM_CHANNEL: ("codes", "scale", "zero"),
}
_OUTLIER_PARTS = ("outlier_values", "outlier_channels")
_ABSENT = torch.empty(())   # stands for a part a layout does not have; never written


def is_available() -> bool:
    """Whether the C++ kernel is built (or can be built now) and loads."""
    return load_extension() is not None


HalfArgs = tuple[list[int], list[torch.Tensor]]


def paged_attention(q: torch.Tensor, key: HalfStore, value: HalfStore, batch: PagedBatch, scale: float,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] -> [T, Hq, D] in q's dtype (written into ``out`` when given). Rows of q
    outside every sequence's ``query_starts`` range are left as they are in ``out``."""
    ext = load_extension()
    if ext is None:
        raise RuntimeError("the C++ CPU attention kernel is unavailable (see the log); use the torch backend")
    return run(ext, q, key, value, batch, scale, out)


def run(ext: ModuleType, q: torch.Tensor, key: HalfStore, value: HalfStore, batch: PagedBatch, scale: float,
        out: torch.Tensor | None = None) -> torch.Tensor:
    """``paged_attention`` with a given build of the kernel (``load_extension(isa)``)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3 or not q.is_floating_point():
        raise ValueError(f"q must be a float tensor [tokens, heads, head_dim], got {_describe(q)}")
    if q.device.type != "cpu":
        raise ValueError(f"the CPU attention backend needs CPU tensors, q is on {q.device}")
    if out is not None and (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device):
        raise ValueError(f"out must match q ({tuple(q.shape)}, {q.dtype}), got {tuple(out.shape)}, {out.dtype}")
    if key.refined is not None or value.refined is not None:
        raise ValueError("mixed-precision blocks (HalfStore.refined) are read through registered halves "
                         "(register_halves, run_registered)")
    d = q.shape[-1]
    (k_layout, k_parts), (v_layout, v_parts) = half_args("key", key, d), half_args("value", value, d)
    q32 = q.float().contiguous()
    direct = out is not None and out.dtype == torch.float32 and out.is_contiguous()
    result = out if direct else torch.empty(q.shape, dtype=torch.float32)
    assert result is not None
    ext.run(q32, result, k_layout, k_parts, v_layout, v_parts, batch.block_tables, batch.context_lens,
            batch.query_starts, batch.open_rows, batch.block_size, float(scale), query_positions(batch), batch.window or 0)
    if direct:
        return result
    if out is None:
        return result if q.dtype == torch.float32 else result.to(q.dtype)
    return out.copy_(result)


DENSE_BLOCK = 16    # tokens per block of a dense KV as ``dense_attention`` reads it
_PLAIN_F32 = HalfLayout(CodecKind.PLAIN, plain_dtype=torch.float32)


def dense_rows(num_positions: int) -> int:
    """Rows of a dense KV of ``num_positions`` positions that ``dense_attention`` reads in place."""
    return -(-num_positions // DENSE_BLOCK) * DENSE_BLOCK


def dense_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, positions: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """``AttentionBackend.attend_dense`` for float32 keys and values on the CPU: the dense KV seen
    as one sequence's blocks of DENSE_BLOCK tokens in order (copied only where it is not
    ``dense_rows`` long), the queries a prefill with gaps (``PagedBatch.query_positions``)."""
    n = int(positions[-1]) + 1
    size = dense_rows(n)
    halves = []
    for x in (key, value):
        x = x[:size] if x.shape[0] >= size else torch.cat([x[:n], x.new_zeros((size - n, *x.shape[1:]))])
        halves.append(HalfStore(_PLAIN_F32, {"data": x.contiguous().view(-1, DENSE_BLOCK, *x.shape[1:])}))
    num_blocks = size // DENSE_BLOCK
    batch = PagedBatch(torch.arange(num_blocks, dtype=torch.int32)[None], torch.tensor([n], dtype=torch.int32),
                       torch.tensor([0, positions.numel()], dtype=torch.int32), torch.tensor([-1], dtype=torch.int32),
                       DENSE_BLOCK, positions.numel(), n, positions.to(torch.int32))
    return paged_attention(q, halves[0], halves[1], batch, scale)


def half_args(name: str, store: HalfStore, head_dim: int) -> HalfArgs:
    """The kernel's view of a half: (kind, dtype, bits, group, hadamard, outliers) and its
    six tensors (data/codes, scale, zero, outlier values, outlier channels, residual)."""
    return _half_args(name, store.layout, store.parts, store.residual, head_dim)


def _half_args(name: str, layout: HalfLayout, parts: Mapping[str, torch.Tensor], residual: torch.Tensor | None,
               head_dim: int) -> HalfArgs:
    if not isinstance(layout, HalfLayout) or layout.kind not in _INNER_PARTS:
        raise ValueError(f"{name}: no CPU kernel reads layout {layout!r}")
    wanted = _INNER_PARTS[layout.kind] + (_OUTLIER_PARTS if layout.num_outliers else ())
    if set(parts) != set(wanted):
        raise ValueError(f"{name}: layout {layout} stores parts {sorted(wanted)}, got {sorted(parts)}")
    dtype = 0
    if layout.kind == CodecKind.PLAIN:
        if layout.plain_dtype not in _DTYPE_CODES:
            raise ValueError(f"{name}: plain storage must be float32, float16 or bfloat16, got {layout.plain_dtype}")
        dtype = _DTYPE_CODES[layout.plain_dtype]
    if layout.hadamard and (head_dim & (head_dim - 1)):
        raise ValueError(f"{name}: +had needs a power-of-two head_dim, got {head_dim}")
    tensors = [parts[wanted[0]], parts.get("scale", _ABSENT), parts.get("zero", _ABSENT),
               parts.get("outlier_values", _ABSENT), parts.get("outlier_channels", _ABSENT),
               _ABSENT if residual is None else residual]
    return [int(layout.kind), dtype, layout.bits, layout.group_size, int(layout.hadamard), layout.num_outliers], tensors


def register_halves(ext: ModuleType, key: HalfStore, value: HalfStore, head_dim: int) -> object:
    """The kernel's checked view of a layer's two halves, for ``run_registered`` and the KV
    writes (kvserve/attention/cpu_writes.py): the storage's parts are handed over and checked once."""
    (k_layout, k_parts), (v_layout, v_parts) = half_args("key", key, head_dim), half_args("value", value, head_dim)
    block_size = next(iter(key.parts.values())).shape[1]
    if key.refined is None and value.refined is None:
        return ext.make_halves(k_layout, k_parts, v_layout, v_parts, block_size, head_dim)
    if key.refined is None or value.refined is None or key.refined.side_map is not value.refined.side_map:
        raise ValueError("keys and values are refined together, by one side map")
    # a finer copy is only read for full blocks: no residual rows
    kf = _half_args("key (finer)", key.refined.layout, key.refined.parts, None, head_dim)
    vf = _half_args("value (finer)", value.refined.layout, value.refined.parts, None, head_dim)
    return ext.make_halves_refined(k_layout, k_parts, v_layout, v_parts, *kf, *vf, key.refined.side_map,
                                   block_size, head_dim)


def run_registered(ext: ModuleType, halves: object, q: torch.Tensor, batch: PagedBatch, scale: float,
                   out: torch.Tensor | None = None, scores: AttentionScores | None = None) -> torch.Tensor:
    """``paged_attention`` over halves ``register_halves`` made (q float32 on the CPU: the
    engine's case; ``out`` written when it is a contiguous float32 tensor of q's shape).
    ``scores``: where to add the attention weights each key gets (``AttentionScores``)."""
    if q.dtype != torch.float32 or not q.is_contiguous() or q.device.type != "cpu":
        raise ValueError(f"registered halves take contiguous float32 CPU queries, got {_describe(q)}")
    result = out if out is not None and out.dtype == torch.float32 and out.is_contiguous() else torch.empty_like(q)
    if scores is not None:
        ext.run_halves_scored(halves, q, result, batch.block_tables, batch.context_lens, batch.query_starts,
                              batch.open_rows, float(scale), scores.weights, scores.score_from, query_positions(batch))
    else:
        ext.run_halves(halves, q, result, batch.block_tables, batch.context_lens, batch.query_starts,
                       batch.open_rows, float(scale), query_positions(batch), batch.window or 0)
    if out is not None and result is not out:
        return out.copy_(result)
    return result


_NO_POSITIONS = torch.empty(0, dtype=torch.int32)


def query_positions(batch: PagedBatch) -> torch.Tensor:
    """The kernel's ``query_positions``: the batch's, or empty (each sequence's last n positions)."""
    return _NO_POSITIONS if batch.query_positions is None else batch.query_positions


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} tensor of shape {tuple(x.shape)}"
    return type(x).__name__

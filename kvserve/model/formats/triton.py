"""Packed weights multiplied on CUDA devices by Triton kernels, read in place (packing.py's
planes, as the CPU kernel reads them): y = x W^T + bias, activations in the compute dtype.

Importing this module decorates the kernels: set ``TRITON_INTERPRET=1`` before the first
import of triton to run them on CPU tensors through Triton's interpreter.

``_matmul`` runs one program per (BLOCK_N output columns, BLOCK_M rows, K split) of one
segment; a segment's rows are output columns col0 .. col0 + rows of the product:

             K split 0        K split 1               W^T tile [BLOCK_K, BLOCK_N], built as
    x rows  | BLOCK_K | ... | BLOCK_K | ... |         [BLOCK_K / SUB, SUB, BLOCK_N]: codes read
    (M)       x tile . W^T tile -> acc (float32)      per element from (tile n/16, block k/32,
                                                      lane n%16), one scale (and minimum) per
                                                      SUB-column sub-block and lane

The W tile is dequantized in registers to float32 with the reference's float steps
(packing.dequantize_segment), rounded to the compute dtype and multiplied by ``tl.dot``
with float32 accumulation. With one split the program adds the bias, the outlier channels'
product and the residual and stores; with several it stores its partial sum and ``_reduce``
adds the splits in order, then does the same.

A row's result does not depend on its batch: tile widths and splits come from the weight's
shape alone, and every row of a tile runs the same loop over K. Before sm_90 only BLOCK_M
follows the row count (16 up to 16 rows, 64 above), which changes which rows share a
``tl.dot``, not a row's own sums: both shapes take the same MMA instruction (the interpreter:
numpy; sm_80: mma.sync). On sm_90 a 64-row tile compiles to wgmma and a 16-row one to
mma.sync, and their sums differ in the last bits (seen on an H200: a row alone and the same
row among 33 differed in their last bits), so there every row count runs in 64-row tiles (``one_tile``):
a decode step's tile is mostly masked rows, which costs tensor-core work but no weight bytes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F

from kvserve.model.formats.kernel import QuantKernel
from kvserve.model.formats.packing import LANES, Kind, Outliers, PackedWeight, Segment, dequantize_segment
from kvserve.model.linear import Embedding, Product, rms_norm

try:
    import triton  # type: ignore[import-untyped]
    import triton.language as tl  # type: ignore[import-untyped]
except ImportError:          # no triton: triton_unavailable_reason says so
    triton = None
    tl = None

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DECODE_ROWS = 16             # BLOCK_M up to this many rows (tl.dot's smallest tile); 64 above
PREFILL_BLOCK_M = 64
MIN_SPLIT_COLS = 128         # a K split shorter than this costs more in partial sums than it spreads
PROGRAMS_PER_SM = 2


def _constexpr(value: int) -> Any:
    return value if tl is None else tl.constexpr(value)


def _not_compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    return fn


jit: Any = _not_compiled if triton is None else triton.jit
Q4_0 = _constexpr(Kind.Q4_0)
Q4_1 = _constexpr(Kind.Q4_1)
Q8_0 = _constexpr(Kind.Q8_0)
Q4_K = _constexpr(Kind.Q4_K)
Q6_K = _constexpr(Kind.Q6_K)
Q5_0 = _constexpr(Kind.Q5_0)
Q5_1 = _constexpr(Kind.Q5_1)
Q5_K = _constexpr(Kind.Q5_K)
TILE_ROWS = _constexpr(LANES)   # packed rows per tile (lanes), as a kernel constant


# ---- kernels ----------------------------------------------------------------------------

@jit
def _weight_tile(codes, high, scale, minimum, sub_scale, sub_min, super_scale, super_min, k0, n, n_ok, K,
                 KIND: tl.constexpr, GROUP: tl.constexpr, SUB: tl.constexpr, BLOCK_K: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """W^T [BLOCK_K, BLOCK_N] in float32: columns k0 .. k0 + BLOCK_K of segment rows ``n``
    (zero where ``n_ok`` is false). k0 is a multiple of BLOCK_K, which divides 256 and GROUP
    (or GROUP divides it): a sub-block of SUB columns has one scale per row."""
    NS: tl.constexpr = BLOCK_K // SUB
    first = k0 + tl.arange(0, NS)[:, None, None] * SUB           # [NS, 1, 1] each sub-block's first column
    k = first + tl.arange(0, SUB)[None, :, None]                  # [NS, SUB, 1]
    tile = (n // TILE_ROWS).to(tl.int64)[None, None, :]          # [1, 1, BLOCK_N]
    lane = (n % TILE_ROWS)[None, None, :]
    ok = n_ok[None, None, :]
    tb = tile * (K // 32) + k // 32                               # (tile, block of 32) index
    j = (k % 32) // 4                                             # vector j holds codes 4j .. 4j+3
    inner = lane * 4 + k % 4
    if KIND == Q8_0:
        q = tl.load(codes + tb * 512 + j * 64 + inner, mask=ok, other=0).to(tl.float32)
    else:       # vector j in the low nibbles of bytes 64 (j % 4) .., j + 4 in the high ones
        byte = tl.load(codes + tb * 256 + (j % 4) * 64 + inner, mask=ok, other=0).to(tl.int32)
        code = (byte >> ((j // 4) * 4)) & 15
        if KIND == Q6_K:   # high bits of vector 4s + i at bits 2i of half s's byte
            bits = tl.load(high + tb * 128 + (j // 4) * 64 + inner, mask=ok, other=0).to(tl.int32)
            code = code | (((bits >> ((j % 4) * 2)) & 3) << 4)
        elif KIND == Q5_0 or KIND == Q5_1 or KIND == Q5_K:   # vector j's fifth bit at bit j of the byte
            bits = tl.load(high + tb * 64 + inner, mask=ok, other=0).to(tl.int32)
            code = code | (((bits >> j) & 1) << 4)
        q = code.to(tl.float32)
    if KIND == Q4_0 or KIND == Q4_1 or KIND == Q8_0 or KIND == Q5_0 or KIND == Q5_1:
        g = (tile * (K // GROUP) + first // GROUP) * TILE_ROWS + lane  # [NS, 1, BLOCK_N]
        d = tl.load(scale + g, mask=ok, other=0.0).to(tl.float32)
        if KIND == Q4_0:
            w = d * (q - 8.0)
        elif KIND == Q5_0:
            w = d * (q - 16.0)
        elif KIND == Q8_0:
            w = d * q
        else:
            w = d * q + tl.load(minimum + g, mask=ok, other=0.0).to(tl.float32)
    else:       # BLOCK_K divides 256: the whole tile lies in one super-block
        sup = (tile * (K // 256) + k0 // 256) * TILE_ROWS + lane
        d = tl.load(super_scale + sup, mask=ok, other=0.0).to(tl.float32)
        if KIND == Q4_K or KIND == Q5_K:
            sb = (tile * (K // 32) + first // 32) * TILE_ROWS + lane
            sc = d * tl.load(sub_scale + sb, mask=ok, other=0).to(tl.float32)
            mn = tl.load(super_min + sup, mask=ok, other=0.0).to(tl.float32) * \
                tl.load(sub_min + sb, mask=ok, other=0).to(tl.float32)
            w = sc * q - mn
        else:
            sb = (tile * (K // 16) + first // 16) * TILE_ROWS + lane
            sc = d * tl.load(sub_scale + sb, mask=ok, other=0).to(tl.float32)
            w = sc * (q - 32.0)
    return tl.reshape(w, (BLOCK_K, BLOCK_N))


@jit
def _round_bf16(x):
    """float32 x rounded to the nearest bfloat16 (ties to even), still float32: the
    interpreter's casts to bfloat16 truncate (so a cast of the result is then exact)."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
    return bits.to(tl.float32, bitcast=True)


@jit
def _finish(acc, m, n, m_ok, n_ok, out, stride_out, bias, extra, stride_extra,
            HAS_BIAS: tl.constexpr, HAS_EXTRA: tl.constexpr, ADD: tl.constexpr, F32_DOTS: tl.constexpr):
    """out[m, n] = acc + bias + extra (+ out, with ADD), in out's dtype."""
    mask = m_ok[:, None] & n_ok[None, :]
    m64 = m.to(tl.int64)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias + n, mask=n_ok, other=0.0)[None, :]
    if HAS_EXTRA:
        acc += tl.load(extra + m64 * stride_extra + n[None, :], mask=mask, other=0.0)
    ptrs = out + m64 * stride_out + n[None, :]
    if ADD:
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if F32_DOTS and out.dtype.element_ty == tl.bfloat16:
        acc = _round_bf16(acc)
    tl.store(ptrs, acc.to(out.dtype.element_ty), mask=mask)


@jit
def _matmul(x, stride_x, out, stride_out, partial, bias, extra, stride_extra,
            codes, high, scale, minimum, sub_scale, sub_min, super_scale, super_min,
            M, N, K, k_per_split,
            KIND: tl.constexpr, GROUP: tl.constexpr, SUB: tl.constexpr, HAS_BIAS: tl.constexpr,
            HAS_EXTRA: tl.constexpr, ADD: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr, F32_DOTS: tl.constexpr):
    """One program: rows [BLOCK_M) x segment rows [BLOCK_N) over columns of one K split."""
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    n_ok = n < N
    m_ok = m < M
    kk = tl.arange(0, BLOCK_K)
    x_rows = x + m.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    lo = split * k_per_split
    hi = tl.minimum(lo + k_per_split, K)
    for k0 in range(lo, hi, BLOCK_K):
        a = tl.load(x_rows + k0 + kk[None, :], mask=m_ok[:, None], other=0.0)
        w = _weight_tile(codes, high, scale, minimum, sub_scale, sub_min, super_scale, super_min, k0, n, n_ok, K,
                         KIND, GROUP, SUB, BLOCK_K, BLOCK_N)
        if F32_DOTS:   # the interpreter (its dot reads bfloat16 as integer bits) and GPUs before sm_80
            w = _round_bf16(w) if DOT == tl.bfloat16 else w.to(DOT).to(tl.float32)
            acc = tl.dot(a.to(tl.float32), w, acc, input_precision="ieee")
        elif DOT == tl.float32:
            acc = tl.dot(a, w, acc, input_precision="tf32x3")
        else:
            acc = tl.dot(a.to(DOT), w.to(DOT), acc)
    if SPLIT:
        tl.store(partial + (split * M + m.to(tl.int64))[:, None] * N + n[None, :], acc,
                 mask=m_ok[:, None] & n_ok[None, :])
    else:
        _finish(acc, m, n, m_ok, n_ok, out, stride_out, bias, extra, stride_extra, HAS_BIAS, HAS_EXTRA, ADD,
                F32_DOTS)


@jit
def _reduce(out, stride_out, partial, bias, extra, stride_extra, M, N, num_splits,
            HAS_BIAS: tl.constexpr, HAS_EXTRA: tl.constexpr, ADD: tl.constexpr, F32_DOTS: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The splits' partial sums [num_splits, M, N] added in split order, then finished."""
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = m < M
    n_ok = n < N
    mask = m_ok[:, None] & n_ok[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for s in range(num_splits):
        acc += tl.load(partial + (s * M + m.to(tl.int64))[:, None] * N + n[None, :], mask=mask, other=0.0)
    _finish(acc, m, n, m_ok, n_ok, out, stride_out, bias, extra, stride_extra, HAS_BIAS, HAS_EXTRA, ADD,
            F32_DOTS)


# ---- host ---------------------------------------------------------------------------------

def is_interpreted() -> bool:
    """Whether the kernels were decorated for Triton's interpreter (CPU tensors)."""
    return triton is not None and type(_matmul).__name__ == "InterpretedFunction"


def triton_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the Triton kernels cannot multiply packed weights on ``device`` in ``dtype``, or None."""
    if triton is None:
        return "quantized weights on CUDA need the triton package (pip install triton)"
    if dtype not in FLOAT_DTYPES:
        return f"the Triton quantized-weight kernels compute in float32, float16 or bfloat16, not {dtype}"
    if device.type == "cuda" or (device.type == "cpu" and is_interpreted()):
        return None
    return (f"the Triton quantized-weight kernels run on CUDA devices (or on CPU under TRITON_INTERPRET=1), "
            f"the device is {device}")


@dataclass(frozen=True)
class LaunchConfig:
    """How one segment's product is cut, from the weight's shape alone (never the row count,
    so that a row's result does not depend on its batch): output columns per program, and
    K columns per split (a multiple of 64; the whole K: one split)."""

    block_n: int
    k_per_split: int
    num_warps: int = 4

    def __post_init__(self) -> None:
        if self.block_n < LANES or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two of at least {LANES}, got {self.block_n}")
        if self.k_per_split < 64 or self.k_per_split % 64:
            raise ValueError(f"k_per_split must be a positive multiple of 64, got {self.k_per_split}")


def launch_config(rows: int, cols: int, num_sms: int) -> LaunchConfig:
    """Enough (column block, split) programs to fill the device twice over, each split at
    least MIN_SPLIT_COLS long (a decode step has one row block: the splits spread it)."""
    block_n = 32
    programs = -(-rows // block_n)
    splits = max(1, min(-(-PROGRAMS_PER_SM * num_sms // programs), cols // MIN_SPLIT_COLS))
    return LaunchConfig(block_n, -(-cols // (splits * 64)) * 64)


def _block_k(seg: Segment) -> int:
    """64 columns a step where K, the super-block and the scale groups allow, else 32."""
    grouped = seg.kind.is_grouped
    fits = not grouped or seg.group == 32 or seg.group % 64 == 0
    return 64 if seg.cols % 64 == 0 and fits else 32


@dataclass(frozen=True)
class Launch:
    """A kernel's grid, positional arguments and compile-time constants."""

    grid: tuple[int, ...]
    args: list[Any]
    constants: dict[str, Any]


class SegmentLaunch:
    """One segment's planes on the device, as ``_matmul`` reads them, and its launches."""

    def __init__(self, seg: Segment, col0: int, config: LaunchConfig, dtype: torch.dtype, f32_dots: bool,
                 one_tile: bool = False) -> None:
        self.rows, self.cols, self.col0, self.config = seg.rows, seg.cols, col0, config
        self.one_tile = one_tile        # every row count in PREFILL_BLOCK_M tiles (sm_90: see the module doc)
        codes = seg.parts["codes"]
        if seg.kind == Kind.Q8_0:
            codes = codes.view(torch.int8)
        names = ("high", "scale", "min", "sub_scale", "sub_min", "super_scale", "super_min")
        self.planes = [codes, *(seg.parts.get(name, codes) for name in names)]   # codes stand in for absent planes
        block_k = _block_k(seg)
        if seg.kind == Kind.Q6_K:
            sub = 16
        elif seg.kind in (Kind.Q4_K, Kind.Q5_K):
            sub = 32
        else:
            sub = min(seg.group, block_k)
        self.constants = {"KIND": int(seg.kind), "GROUP": seg.group, "SUB": sub, "BLOCK_K": block_k,
                          "BLOCK_N": config.block_n, "DOT": _dot_dtype(dtype), "F32_DOTS": f32_dots}
        self.num_splits = -(-seg.cols // config.k_per_split)

    def matmul(self, x: torch.Tensor, out: torch.Tensor, partial: torch.Tensor, bias: torch.Tensor | None,
               extra: torch.Tensor | None, add: bool) -> Launch:
        """``_matmul``'s launch for rows ``x``: ``out``, ``bias`` and ``extra`` (the outlier
        channels' product) are the segment's columns; ``partial`` [splits, rows of x, rows]."""
        num_rows = x.shape[0]
        block_m = DECODE_ROWS if num_rows <= DECODE_ROWS and not self.one_tile else PREFILL_BLOCK_M
        grid = (-(-self.rows // self.config.block_n), -(-num_rows // block_m), self.num_splits)
        args = [x, x.stride(0), *_epilogue_args(out, partial, bias, extra), *self.planes, num_rows, self.rows,
                self.cols, self.config.k_per_split]
        constants = {**self.constants, **_epilogue_constants(bias, extra, add), "SPLIT": self.num_splits > 1,
                     "BLOCK_M": block_m}
        return Launch(grid, args, constants)

    def reduce(self, num_rows: int, out: torch.Tensor, partial: torch.Tensor, bias: torch.Tensor | None,
               extra: torch.Tensor | None, add: bool) -> Launch:
        """``_reduce``'s launch over the partial sums ``matmul`` wrote."""
        grid = (-(-num_rows // 16), -(-self.rows // 64))
        args = [*_epilogue_args(out, partial, bias, extra), num_rows, self.rows, self.num_splits]
        constants = {**_epilogue_constants(bias, extra, add), "F32_DOTS": self.constants["F32_DOTS"],
                     "BLOCK_M": 16, "BLOCK_N": 64}
        return Launch(grid, args, constants)

    def run(self, x: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None, extra: torch.Tensor | None,
            add: bool) -> None:
        """out[:, col0 .. col0 + rows] (+)= x W^T + bias + extra, from the product's full-width tensors."""
        cols = slice(self.col0, self.col0 + self.rows)
        out = out[:, cols]
        bias = None if bias is None else bias[cols]
        extra = None if extra is None else extra[:, cols]
        partial = out     # not read with one split
        if self.num_splits > 1:
            partial = torch.empty(self.num_splits, x.shape[0], self.rows, dtype=torch.float32, device=x.device)
        launch = self.matmul(x, out, partial, bias, extra, add)
        _matmul[launch.grid](*launch.args, **launch.constants, num_warps=self.config.num_warps)
        if self.num_splits > 1:
            launch = self.reduce(x.shape[0], out, partial, bias, extra, add)
            _reduce[launch.grid](*launch.args, **launch.constants, num_warps=4)


def _dot_dtype(dtype: torch.dtype) -> Any:
    return {torch.float32: tl.float32, torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}[dtype]


def _epilogue_args(out: torch.Tensor, partial: torch.Tensor, bias: torch.Tensor | None,
                   extra: torch.Tensor | None) -> list[Any]:
    """out, its row stride, partial, bias, extra, its row stride (``out`` stands in for the absent)."""
    extra_t = out if extra is None else extra
    return [out, out.stride(0), partial, out if bias is None else bias, extra_t, extra_t.stride(0)]


def _epilogue_constants(bias: torch.Tensor | None, extra: torch.Tensor | None, add: bool) -> dict[str, bool]:
    return {"HAS_BIAS": bias is not None, "HAS_EXTRA": extra is not None, "ADD": add}


def _to_device(w: PackedWeight, device: torch.device) -> PackedWeight:
    def move(t: torch.Tensor) -> torch.Tensor:
        return t.to(device).contiguous()

    segments = tuple(replace(s, parts={k: move(v) for k, v in s.parts.items()}) for s in w.segments)
    bias = None if w.bias is None else move(w.bias.float())
    outliers = None
    if w.outliers is not None:
        outliers = Outliers(move(w.outliers.channels.to(torch.int32)), move(w.outliers.weight.float()))
    return PackedWeight(segments, bias, outliers)


class TritonPackedProduct(Product):
    """A packed weight on the device, multiplied by ``_matmul`` (one launch per segment, plus
    ``_reduce`` for a split one). Outlier channels: their activations are zeroed for the
    kernel and ``x[:, channels] @ weight^T`` (float32, torch) is added in its epilogue. The
    prologues (RMSNorm, SwiGLU) run in torch first. ``config`` overrides the default cut of
    every segment (tests)."""

    def __init__(self, packed: PackedWeight, device: torch.device, dtype: torch.dtype,
                 config: LaunchConfig | None = None) -> None:
        reason = triton_unavailable_reason(device, dtype)
        if reason is not None:
            raise ValueError(reason)
        self.packed = _to_device(packed, device)
        self.rows, self.cols = packed.shape
        self.device, self.dtype = device, dtype
        f32_dots = is_interpreted() or torch.cuda.get_device_capability(device) < (8, 0)
        one_tile = not is_interpreted() and torch.cuda.get_device_capability(device) >= (9, 0)
        num_sms = 1 if device.type != "cuda" else torch.cuda.get_device_properties(device).multi_processor_count
        self.segments: list[SegmentLaunch] = []
        col0 = 0
        for seg in self.packed.segments:
            cfg = config or launch_config(seg.rows, seg.cols, num_sms)
            self.segments.append(SegmentLaunch(seg, col0, cfg, dtype, f32_dots, one_tile))
            col0 += seg.rows

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def _run(self, x: torch.Tensor, out: torch.Tensor, add: bool) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.cols:
            raise ValueError(f"x must be [tokens, {self.cols}], got {tuple(x.shape)}")
        if x.dtype != self.dtype:
            x = x.to(self.dtype)
        if x.stride(-1) != 1:
            x = x.contiguous()
        if x.shape[0] == 0:
            return out
        extra = None
        outliers = self.packed.outliers
        if outliers is not None:
            channels = outliers.channels.long()
            extra = x[:, channels].float() @ outliers.weight.t()
            x = x.index_fill(1, channels, 0.0)
        for seg in self.segments:
            seg.run(x, out, self.packed.bias, extra, add)
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self._run(x, torch.empty(x.shape[0], self.rows, dtype=self.dtype, device=x.device), False)

    def after_norm(self, x: torch.Tensor, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self(rms_norm(x, norm_weight, eps))

    def add_into(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if residual.dtype != self.dtype or residual.stride(-1) != 1:
            return residual + self(x)
        return self._run(x, residual, True)

    def swiglu_add_into(self, residual: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.add_into(residual, F.silu(gate) * up)


def _rows_of(seg: Segment, rows: torch.Tensor) -> Segment:
    """The segment's rows ``rows`` (long [T], in range) as a segment of T rows: each plane's
    lanes gathered and tiled again, so dequantizing it reads only those rows."""
    tiles, lanes = rows // LANES, rows % LANES
    pad = -rows.numel() % LANES
    parts = {}
    for name, plane in seg.parts.items():
        if name in ("codes", "high"):     # [tiles, K/32, vectors x 64]: 4 bytes a lane per vector
            v = plane.reshape(*plane.shape[:2], -1, LANES, 4)[tiles, :, :, lanes]      # [T, K/32, vectors, 4]
            v = F.pad(v, (0, 0, 0, 0, 0, 0, 0, pad)).reshape(-1, LANES, *v.shape[1:])
            parts[name] = v.permute(0, 2, 3, 1, 4).reshape(v.shape[0], v.shape[2], -1)
        else:                             # [tiles, groups, 16]
            v = plane[tiles, :, lanes]                                                 # [T, groups]
            v = F.pad(v, (0, 0, 0, pad)).reshape(-1, LANES, v.shape[1])
            parts[name] = v.transpose(1, 2)
    return replace(seg, rows=rows.numel(), parts=parts)


class TritonPackedEmbedding(Embedding):
    """Rows of a packed product (a tied LM head's blocks, shared), dequantized on the device as
    they are looked up: exactly ``dequantize(packed)[ids]``, in the compute dtype."""

    def __init__(self, product: TritonPackedProduct) -> None:
        self.product = product

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        packed = self.product.packed
        ids = ids.to(device=self.product.device, dtype=torch.long)
        out: torch.Tensor | None = None
        row0 = 0
        for seg in packed.segments:      # every id through every segment: no host sync
            local = ids - row0
            values = dequantize_segment(_rows_of(seg, local.clamp(0, seg.rows - 1)))
            out = values if out is None else torch.where(((local >= 0) & (local < seg.rows))[:, None], values, out)
            row0 += seg.rows
        assert out is not None
        if packed.outliers is not None:
            out[:, packed.outliers.channels.long()] = packed.outliers.weight[ids]
        return out.to(self.product.dtype)


class TritonKernel(QuantKernel):
    name = "triton"

    def __init__(self, device: torch.device, dtype: torch.dtype) -> None:
        reason = triton_unavailable_reason(device, dtype)
        if reason is not None:
            raise ValueError(reason)
        self.device = device
        self.dtype = dtype

    def product(self, packed: PackedWeight) -> Product:
        return TritonPackedProduct(packed, self.device, self.dtype)

    def embedding(self, product: Product) -> Embedding:
        if not isinstance(product, TritonPackedProduct):
            raise TypeError(f"the triton kernel looks rows up in its own products, got {type(product).__name__}")
        return TritonPackedEmbedding(product)

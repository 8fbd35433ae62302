"""Quantized weights in the layout the kernels read (csrc/qkernel.h), from a GGUF file's
blocks or quantized here from float weights.

A ``PackedWeight`` is one or more *segments* (matrices sharing an input, such as Q, K and V,
each in its own format) whose rows are stacked. Each segment's rows are cut into tiles of
16; along K, blocks of 32. Every plane is a tensor indexed [tile, block or group, ...]:

    codes        uint8 [tiles, K/32, 256]   4-bit codes (the low 4 bits of 5- and 6-bit ones),
                                            or [tiles, K/32, 512] 8-bit codes
    high         uint8 [tiles, K/32, 128]   Q6_K: the codes' two high bits;
                       [tiles, K/32, 64]    Q5_0 / Q5_1 / Q5_K: their fifth bit
    scale, min   f16   [tiles, groups, 16]  Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 (and int8 / int4) per group
    sub_scale    Q4_K, Q5_K: uint8 [tiles, K/32, 16]; Q6_K: int8 [tiles, K/16, 16]
    sub_min      Q4_K, Q5_K: uint8 [tiles, K/32, 16]
    super_scale  f16   [tiles, K/256, 16]   Q4_K / Q5_K / Q6_K d
    super_min    f16   [tiles, K/256, 16]   Q4_K / Q5_K dmin

Within a (tile, block) the codes are 8 vectors of 64 bytes, vector j holding codes
4j .. 4j+3 of each of the 16 rows (row n at bytes 4n .. 4n+3); 4-bit codes pair vector j
(low nibbles) with j + 4 (high nibbles); the Q5 kinds' plane of fifth bits holds, in its
byte x, the fifth bit of vector j's byte x at bit j. For GGUF types these are the file's own
codes and scales, moved, not requantized: dequantizing a packed weight gives exactly what
``gguf.quants.dequantize`` gives for the same bytes (tested), and the bytes are as many
(Q4_K: 3% more, its 6-bit scales kept as bytes; Q5_K: 2% more).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

LANES = 16
BLOCK = 32
SUPER = 256
PART_NAMES = ("codes", "high", "scale", "min", "sub_scale", "sub_min", "super_scale", "super_min")


class Kind(enum.IntEnum):
    """The kernels' weight kinds (csrc/qkernel.h ``Kind``); int8 is Q8_0's layout with its own
    group, int4 Q4_1's."""

    Q4_0 = 0
    Q4_1 = 1
    Q8_0 = 2
    Q4_K = 3
    Q6_K = 4
    Q5_0 = 5
    Q5_1 = 6
    Q5_K = 7

    @property
    def is_grouped(self) -> bool:
        """One scale (and minimum) per group of columns, not the K-quants' super-blocks."""
        return self in (Kind.Q4_0, Kind.Q4_1, Kind.Q8_0, Kind.Q5_0, Kind.Q5_1)

    @property
    def high_bytes(self) -> int:
        """Bytes of the high-bit plane per (tile, block): 0 when the codes have no high bits."""
        return {Kind.Q6_K: 128, Kind.Q5_0: 64, Kind.Q5_1: 64, Kind.Q5_K: 64}.get(self, 0)


# GGUF type name -> (kind, elements per block, bytes per block)
GGUF_TYPES: dict[str, tuple[Kind, int, int]] = {
    "Q4_0": (Kind.Q4_0, 32, 18),
    "Q4_1": (Kind.Q4_1, 32, 20),
    "Q8_0": (Kind.Q8_0, 32, 34),
    "Q4_K": (Kind.Q4_K, 256, 144),
    "Q6_K": (Kind.Q6_K, 256, 210),
    "Q5_0": (Kind.Q5_0, 32, 22),
    "Q5_1": (Kind.Q5_1, 32, 24),
    "Q5_K": (Kind.Q5_K, 256, 176),
}


@dataclass(frozen=True)
class Segment:
    kind: Kind
    rows: int
    cols: int
    group: int                      # columns per scale group (grouped kinds); 256 for the K-quants
    parts: dict[str, torch.Tensor]  # planes by PART_NAMES; absent planes are missing
    source: str                     # what it was made from: a GGUF type name, int8, int4

    @property
    def tiles(self) -> int:
        return -(-self.rows // LANES)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.parts.values())


@dataclass(frozen=True)
class Outliers:
    """Input channels multiplied in float32 apart from the quantized product (LLM.int8()'s
    decomposition): their activations are zeroed before quantizing, then added back as
    ``x[:, channels] @ weight^T``."""

    channels: torch.Tensor   # int32 [n]
    weight: torch.Tensor     # float32 [rows, n]: the float columns of W at ``channels``

    @property
    def nbytes(self) -> int:
        return self.channels.numel() * 4 + self.weight.numel() * 4


@dataclass(frozen=True)
class PackedWeight:
    """A quantized matrix [rows, cols] (segments stacked by rows), with an optional bias."""

    segments: tuple[Segment, ...]
    bias: torch.Tensor | None = None
    outliers: Outliers | None = None
    handle: object = field(default=None, compare=False)   # a backend's registered form (cpu.py)

    def __post_init__(self) -> None:
        if not self.segments or len({s.cols for s in self.segments}) != 1:
            raise ValueError("a packed weight needs segments with the same number of columns")

    @property
    def rows(self) -> int:
        return sum(s.rows for s in self.segments)

    @property
    def cols(self) -> int:
        return self.segments[0].cols

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.cols)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * 4
        extra += 0 if self.outliers is None else self.outliers.nbytes
        return sum(s.nbytes for s in self.segments) + extra

    @property
    def format_name(self) -> str:
        names = dict.fromkeys(s.source for s in self.segments)
        return "+".join(names) + (f"+out{self.outliers.channels.numel()}" if self.outliers is not None else "")


def stack(weights: Sequence[PackedWeight], bias: torch.Tensor | None = None) -> PackedWeight:
    """Matrices sharing an input as one weight, rows stacked in order (one product, one pass
    over the activations)."""
    if any(w.outliers is not None or w.bias is not None for w in weights):
        raise ValueError("stack packed weights before adding outliers or a bias")
    return PackedWeight(tuple(s for w in weights for s in w.segments), bias)


# ---- tiling ----------------------------------------------------------------------------

def _pad_rows(a: np.ndarray, rows: int) -> np.ndarray:
    tiles = -(-rows // LANES)
    if tiles * LANES == rows:
        return a
    pad = np.zeros((tiles * LANES - rows, *a.shape[1:]), dtype=a.dtype)
    return np.concatenate([a, pad])


def _tile_codes(codes: np.ndarray) -> np.ndarray:
    """uint8 codes [rows, K] -> [tiles, K/32, 8, 64] (vector j: codes 4j..4j+3 of each row)."""
    rows, k = codes.shape
    c = _pad_rows(codes, rows)
    tiles = c.shape[0] // LANES
    return np.ascontiguousarray(c.reshape(tiles, LANES, k // BLOCK, 8, 4).transpose(0, 2, 3, 1, 4)).reshape(
        tiles, k // BLOCK, 8, 64)


def pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes [rows, K] (0..15) -> the codes plane [tiles, K/32, 256]."""
    v = _tile_codes(codes)
    return np.ascontiguousarray((v[:, :, :4] | (v[:, :, 4:] << 4)).reshape(v.shape[0], v.shape[1], 256))


def pack_bytes(codes: np.ndarray) -> np.ndarray:
    """8-bit codes [rows, K] -> the codes plane [tiles, K/32, 512]."""
    v = _tile_codes(codes)
    return v.reshape(v.shape[0], v.shape[1], 512)


def pack_high2(codes6: np.ndarray) -> np.ndarray:
    """The two high bits of 6-bit codes [rows, K] -> the high plane [tiles, K/32, 128]:
    byte x of half s holds, at bits 2i, 2i+1, the high bits of vector 4s + i's byte x."""
    h = _tile_codes(codes6 >> 4).reshape(-1, codes6.shape[1] // BLOCK, 2, 4, 64)
    out = h[:, :, :, 0] | (h[:, :, :, 1] << 2) | (h[:, :, :, 2] << 4) | (h[:, :, :, 3] << 6)
    return np.ascontiguousarray(out.reshape(h.shape[0], h.shape[1], 128))


def pack_high1(codes5: np.ndarray) -> np.ndarray:
    """The fifth bits of 5-bit codes [rows, K] -> the high plane [tiles, K/32, 64]: byte x holds,
    at bit j, the fifth bit of vector j's byte x."""
    h = _tile_codes(codes5 >> 4)                                  # [tiles, K/32, 8, 64] of 0 / 1
    out = np.zeros((*h.shape[:2], 64), dtype=np.uint8)
    for j in range(8):
        out |= h[:, :, j] << j
    return out


def tile_lanes(per_row: np.ndarray) -> np.ndarray:
    """A per-row quantity [rows, G] -> [tiles, G, 16]."""
    rows = per_row.shape[0]
    a = _pad_rows(per_row, rows)
    return np.ascontiguousarray(a.reshape(a.shape[0] // LANES, LANES, -1).transpose(0, 2, 1))


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a))


# ---- GGUF blocks -------------------------------------------------------------------------

def _f16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.float16)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[n, 16] packed bytes of a 32-element block -> [n, 32]: low nibbles first, then high."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:
    """[n, 4] bytes of a 32-element block's fifth bits (a little-endian uint32, bit i for
    element i) -> [n, 32] of 0 or 16: each bit in place above its element's nibble."""
    return np.unpackbits(qh, axis=-1, bitorder="little") << 4


def _q4k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K's 12 bytes of 6-bit scales and minimums -> two [n, 8] uint8 arrays."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def pack_gguf(type_name: str, data: np.ndarray, rows: int, cols: int,
              row_order: np.ndarray | None = None) -> PackedWeight:
    """A GGUF tensor's raw blocks (uint8, the file's bytes: ``rows`` rows of ``cols``
    elements) as a packed weight, its rows taken in ``row_order`` when given (llama.cpp's
    Q/K row permutation undone). ValueError for types the kernels do not read."""
    if type_name not in GGUF_TYPES:
        raise ValueError(f"GGUF type {type_name} is not read in place (kernels read {', '.join(GGUF_TYPES)})")
    kind, block, nbytes = GGUF_TYPES[type_name]
    if cols % block:
        raise ValueError(f"{type_name} rows of {cols} elements are not whole blocks of {block}")
    blocks = np.ascontiguousarray(np.asarray(data, dtype=np.uint8)).reshape(rows * (cols // block), nbytes)
    per_row: dict[str, np.ndarray] = {}      # plane name -> [rows, ...] before tiling
    if kind.is_grouped:    # d [m] [qh: 4 bytes of fifth bits] qs
        per_row["scale"] = _f16(blocks[:, :2]).reshape(rows, cols // BLOCK)
        has_min = kind in (Kind.Q4_1, Kind.Q5_1)
        if has_min:
            per_row["min"] = _f16(blocks[:, 2:4]).reshape(rows, cols // BLOCK)
        start = 4 if has_min else 2
        if kind == Kind.Q8_0:
            per_row["codes8"] = blocks[:, 2:].reshape(rows, cols)
        elif kind in (Kind.Q4_0, Kind.Q4_1):
            per_row["codes4"] = _nibbles(blocks[:, start:start + 16]).reshape(rows, cols)
        else:
            codes = _nibbles(blocks[:, start + 4:start + 20]) | _fifth_bits(blocks[:, start:start + 4])
            per_row["codes5"] = codes.reshape(rows, cols)
        group = BLOCK
    elif kind in (Kind.Q4_K, Kind.Q5_K):   # d dmin scales[12] [qh[32]] qs[128]
        n = blocks.shape[0]
        per_row["super_scale"] = _f16(blocks[:, 0:2]).reshape(rows, -1)
        per_row["super_min"] = _f16(blocks[:, 2:4]).reshape(rows, -1)
        sc, mn = _q4k_scale_min(blocks[:, 4:16])
        per_row["sub_scale"] = sc.reshape(rows, -1)
        per_row["sub_min"] = mn.reshape(rows, -1)
        qs = blocks[:, -128:].reshape(n, 4, 32)            # 64 elements per 32 bytes: low nibbles, then high
        codes = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(n, SUPER)
        if kind == Kind.Q4_K:
            per_row["codes4"] = codes.reshape(rows, cols)
        else:   # element 32i + l's fifth bit is bit i of qh[l]
            qh = np.unpackbits(blocks[:, 16:48].reshape(n, 32, 1), axis=-1, bitorder="little")
            per_row["codes5"] = (codes | (qh.transpose(0, 2, 1).reshape(n, SUPER) << 4)).reshape(rows, cols)
        group = SUPER
    else:   # Q6_K: ql[128] qh[64] scales[16] d
        n = blocks.shape[0]
        ql = blocks[:, :128].reshape(n, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        qh = blocks[:, 128:192].reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        per_row["codes6"] = ((ql & 0x0F).reshape(n, 8, 32) | ((qh & 0x03).reshape(n, 8, 32) << 4)).reshape(rows, cols)
        per_row["sub_scale"] = blocks[:, 192:208].view(np.int8).reshape(rows, -1)
        per_row["super_scale"] = _f16(blocks[:, 208:210]).reshape(rows, -1)
        group = SUPER
    if row_order is not None:
        per_row = {k: v[row_order] for k, v in per_row.items()}
    parts: dict[str, np.ndarray] = {}
    for name, a in per_row.items():
        if name == "codes8":
            parts["codes"] = pack_bytes(a)
        elif name == "codes4":
            parts["codes"] = pack_nibbles(a)
        elif name == "codes6":
            parts["codes"] = pack_nibbles(a & 0x0F)
            parts["high"] = pack_high2(a)
        elif name == "codes5":
            parts["codes"] = pack_nibbles(a & 0x0F)
            parts["high"] = pack_high1(a)
        else:
            parts[name] = tile_lanes(a)
    seg = Segment(kind, rows, cols, group, {k: _t(v) for k, v in parts.items()}, type_name)
    return PackedWeight((seg,))


# ---- quantized here from float weights ---------------------------------------------------

def _check_group(weight: torch.Tensor, group: int) -> tuple[int, int]:
    rows, cols = weight.shape
    if group < BLOCK or group % BLOCK or cols % group:
        raise ValueError(f"a scale group of {group} columns must be a multiple of {BLOCK} dividing the row's {cols}")
    return rows, cols


def quantize_int8(weight: torch.Tensor, group: int) -> PackedWeight:
    """Symmetric int8 with one float16 scale per ``group`` columns of a row (``group`` = cols:
    per output channel): code = round(w / scale), scale = max |w| / 127."""
    rows, cols = _check_group(weight, group)
    w = weight.detach().float().cpu().reshape(rows, cols // group, group)
    scale = (w.abs().amax(dim=-1) / 127.0).half()
    s = scale.float().unsqueeze(-1)
    codes = torch.where(s > 0, torch.round(w / torch.where(s > 0, s, 1.0)), 0.0).clamp(-127, 127)
    codes8 = codes.to(torch.int8).reshape(rows, cols).numpy().view(np.uint8)
    seg = Segment(Kind.Q8_0, rows, cols, group,
                  {"codes": _t(pack_bytes(codes8)), "scale": _t(tile_lanes(scale.numpy()))}, "int8")
    return PackedWeight((seg,))


def quantize_int4(weight: torch.Tensor, group: int) -> PackedWeight:
    """Asymmetric int4 per ``group`` columns of a row: w ~ scale x code + min, code in 0..15,
    scale = (max - min) / 15, both float16 (the codes are rounded against the float16 values)."""
    rows, cols = _check_group(weight, group)
    w = weight.detach().float().cpu().reshape(rows, cols // group, group)
    lo = w.amin(dim=-1)
    hi = w.amax(dim=-1)
    scale = ((hi - lo) / 15.0).half()
    mn = lo.half()
    s = scale.float().unsqueeze(-1)
    codes = torch.where(s > 0, torch.round((w - mn.float().unsqueeze(-1)) / torch.where(s > 0, s, 1.0)), 0.0)
    codes4 = codes.clamp(0, 15).to(torch.uint8).reshape(rows, cols).numpy()
    seg = Segment(Kind.Q4_1, rows, cols, group,
                  {"codes": _t(pack_nibbles(codes4)), "scale": _t(tile_lanes(scale.numpy())),
                   "min": _t(tile_lanes(mn.numpy()))}, "int4")
    return PackedWeight((seg,))


# ---- back to float (the portable path and the reference) ---------------------------------

def _untile_lanes(a: torch.Tensor, rows: int) -> torch.Tensor:
    """[tiles, G, 16] -> [rows, G]."""
    return a.transpose(1, 2).reshape(-1, a.shape[1])[:rows]


def _untile_codes(v: torch.Tensor, rows: int) -> torch.Tensor:
    """[tiles, K/32, 8, 64] -> [rows, K]."""
    tiles, kb = v.shape[:2]
    return v.reshape(tiles, kb, 8, LANES, 4).permute(0, 3, 1, 2, 4).reshape(tiles * LANES, kb * BLOCK)[:rows]


def segment_codes(seg: Segment) -> torch.Tensor:
    """The integer codes [rows, K] (int32): 0..15, 0..31 (Q5_*), 0..63 (Q6_K) or -128..127 (8-bit)."""
    c = seg.parts["codes"]
    if seg.kind == Kind.Q8_0:
        return _untile_codes(c.reshape(*c.shape[:2], 8, 64).view(torch.int8), seg.rows).int()
    p = c.reshape(*c.shape[:2], 4, 64)
    v = torch.cat([p & 0x0F, p >> 4], dim=2)
    if seg.kind == Kind.Q6_K:
        h = seg.parts["high"].reshape(*c.shape[:2], 2, 1, 64)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=h.device).reshape(1, 1, 1, 4, 1)
        v = v | (((h >> shifts) & 3) << 4).reshape(*c.shape[:2], 8, 64)
    elif seg.kind.high_bytes:     # Q5_*: bit j of byte x is vector j's fifth bit
        h = seg.parts["high"].reshape(*c.shape[:2], 1, 64)
        shifts = torch.arange(8, dtype=torch.uint8, device=h.device).reshape(1, 1, 8, 1)
        v = v | (((h >> shifts) & 1) << 4)
    return _untile_codes(v, seg.rows).int()


def dequantize_segment(seg: Segment) -> torch.Tensor:
    """float32 [rows, K], the values the kernels multiply by (same float steps as gguf's
    dequantize for GGUF types, so equal to it bit for bit)."""
    q = segment_codes(seg).float()
    rows = seg.rows
    if seg.kind.is_grouped:
        per = seg.group
        d = _untile_lanes(seg.parts["scale"], rows).float().repeat_interleave(per, dim=1)
        if seg.kind in (Kind.Q4_0, Kind.Q5_0):
            return d * (q - (8 if seg.kind == Kind.Q4_0 else 16))
        if seg.kind == Kind.Q8_0:
            return d * q
        return d * q + _untile_lanes(seg.parts["min"], rows).float().repeat_interleave(per, dim=1)
    d = _untile_lanes(seg.parts["super_scale"], rows).float()
    if seg.kind in (Kind.Q4_K, Kind.Q5_K):
        sc = (d.repeat_interleave(8, dim=1) * _untile_lanes(seg.parts["sub_scale"], rows).float())
        dmin = _untile_lanes(seg.parts["super_min"], rows).float().repeat_interleave(8, dim=1)
        mn = dmin * _untile_lanes(seg.parts["sub_min"], rows).float()
        return sc.repeat_interleave(BLOCK, dim=1) * q - mn.repeat_interleave(BLOCK, dim=1)
    sc = d.repeat_interleave(16, dim=1) * _untile_lanes(seg.parts["sub_scale"], rows).float()
    return sc.repeat_interleave(16, dim=1) * (q - 32)


def dequantize(w: PackedWeight) -> torch.Tensor:
    """The whole matrix as float32 [rows, cols] (outlier columns put back)."""
    out = torch.cat([dequantize_segment(s) for s in w.segments])
    if w.outliers is not None:
        out[:, w.outliers.channels.long()] = w.outliers.weight.to(out.device)
    return out


# ---- stored (the converted-weights cache) ------------------------------------------------

def flatten(name: str, w: PackedWeight) -> tuple[dict[str, torch.Tensor], list[dict[str, object]]]:
    """Tensors (``name#segment.plane``) and JSON-able metadata that ``unflatten`` turns back
    into ``w`` (a loaded weight: no bias, no outliers)."""
    if w.bias is not None or w.outliers is not None:
        raise ValueError("only loaded weights (no bias, no outliers) are stored")
    tensors = {f"{name}#{i}.{part}": t.contiguous() for i, s in enumerate(w.segments) for part, t in s.parts.items()}
    meta: list[dict[str, object]] = [{"kind": s.kind.name, "rows": s.rows, "cols": s.cols, "group": s.group,
                                      "source": s.source, "parts": sorted(s.parts)} for s in w.segments]
    return tensors, meta


def unflatten(name: str, tensors: dict[str, torch.Tensor], meta: list[dict[str, object]]) -> PackedWeight:
    """The inverse of ``flatten``; KeyError / ValueError when anything is missing or wrong."""
    segments = []
    for i, m in enumerate(meta):
        parts = {str(p): tensors[f"{name}#{i}.{p}"] for p in m["parts"]}  # type: ignore[attr-defined]
        segments.append(Segment(Kind[str(m["kind"])], int(m["rows"]), int(m["cols"]),  # type: ignore[call-overload]
                                int(m["group"]), parts, str(m["source"])))  # type: ignore[call-overload]
    return PackedWeight(tuple(segments))

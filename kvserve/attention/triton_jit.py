"""The Triton kernels of the CUDA attention backend (host side: ``triton_kernels``).

Importing this module decorates the kernels: set ``TRITON_INTERPRET=1`` before the first
import to run them on CPU tensors through Triton's interpreter.

``attend`` runs one program per (sequence x query tile, KV head, context split):

    rows  r = query * GROUP + g: the tile's queries x the KV head's GROUP query heads, so
          each K/V tile is read once for the whole group
    keys  the split [split * tokens_per_split, +tokens_per_split) of the sequence, in tiles
          of BLOCK_N tokens; a tile holds whole blocks (or lies inside one), whose ids it
          reads from the block table

          0                                     tail_lo       L
          | main tiles: every half read from    | tail: the open block, from residual
          | its encoded parts                   | rows for the halves that keep them

A tile is dequantized in registers to float32 (``_load_tile``), then multiplied in the
compute dtype (q's) with float32 accumulation; online softmax in base 2. With one split the
program writes the output; with several it writes (acc, max, sum), and the last of a tile's
split programs to finish combines them (``MERGE_HERE``; else the ``merge`` kernel does).
A zip storage's full blocks are read from their finer copy where the side map names one
(``_load_half``). Scoring (``AttentionScores``): the program that writes a row's output also stores its
final (max, sum), and ``score`` then adds each key's softmax weight per (sequence, KV head).

``+had`` without outliers is folded out of the loop: H is symmetric and orthonormal, so
q.(H y) = (H q).y and sum p (H y) = H sum p y; the program rotates q before and the
accumulator after, and rotates residual rows (real channels) into that basis. ``+had`` with
``+outN`` replaces real channels after the rotation, so those tiles are rotated in place (a
dot with the +-1 Sylvester matrix) before their outlier channels are written.
"""

from __future__ import annotations

import triton  # type: ignore[import-untyped]
import triton.language as tl  # type: ignore[import-untyped]
from triton.runtime.errors import OutOfResources  # type: ignore[import-untyped]  # noqa: F401  (triton_kernels)

# CodecKind values (kvserve.kv.storage.layout), as kernel constants
PLAIN = tl.constexpr(0)
INT8 = tl.constexpr(1)
FP8 = tl.constexpr(2)
ASYM_TOKEN = tl.constexpr(3)
ASYM_CHANNEL = tl.constexpr(4)
NEG_BIG = tl.constexpr(-1.0e30)   # initial running max: finite, so exp2(m_old - m_new) is never nan


@triton.jit
def _dot(a, b, DOT: tl.constexpr, F32_DOTS: tl.constexpr):
    """a @ b with float32 accumulation, the operands rounded to DOT. F32_DOTS: multiply the
    rounded operands in float32 (the interpreter, whose dot reads bfloat16 operands as their
    integer bits; GPUs before sm_80, without bfloat16 or tf32 MMA). Otherwise the MMA runs in
    DOT, float32 as three tf32 products (float32 accuracy on tensor cores)."""
    if F32_DOTS:
        return tl.dot(a.to(DOT).to(tl.float32), b.to(DOT).to(tl.float32), input_precision="ieee")
    elif DOT == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="tf32x3")
    else:
        return tl.dot(a.to(DOT), b.to(DOT))


@triton.jit
def _rotate(x, D: tl.constexpr, DOT: tl.constexpr, F32_DOTS: tl.constexpr):
    """x @ H for the orthonormal Sylvester Hadamard matrix (D a power of two):
    H[a, b] = (-1)^popcount(a & b) / sqrt(D), the +-1 part exact in any dtype."""
    a = tl.arange(0, D)[:, None]
    b = tl.arange(0, D)[None, :]
    bits = a & b
    bits = bits ^ (bits >> 8)
    bits = bits ^ (bits >> 4)
    bits = bits ^ (bits >> 2)
    bits = bits ^ (bits >> 1)
    signs = (1 - 2 * (bits & 1)).to(tl.float32)
    return _dot(x, signs, DOT, F32_DOTS) * tl.rsqrt(tl.full((1, 1), D, tl.float32))


@triton.jit
def _e4m3_to_f32(codes):
    """float8 e4m3fn bit patterns (uint8) -> float32, by integer arithmetic (any GPU, and the
    interpreter). Normal: the 7 magnitude bits shifted under float32's exponent field, the
    exponent rebiased by 127 - 7; subnormal (exponent 0): mantissa * 2^-9. (0x7f, nan, is
    never stored: the codec clamps to 448.)"""
    bits = codes.to(tl.int32)
    mag = bits & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    x = tl.where((mag >> 3) == 0, (mag & 7).to(tl.float32) * 0.001953125, normal)
    return tl.where((bits & 0x80) != 0, -x, x)


@triton.jit
def _dequant_asym(t_ok, blk64, off, pages, page_ok, h, H, dd, mask, main, scale, zero, sb_main, sb_scale, sb_zero,
                  KIND: tl.constexpr, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, D: tl.constexpr,
                  D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGES: tl.constexpr):
    """code * scale + zero of packed 2/4-bit codes, [BLOCK_N, D_PAD] float32. Power-of-two
    shapes load each byte and each group's scale once and unpack by reshaping
    [BLOCK_N, bytes, codes per byte] -> [BLOCK_N, D] (lowest bits = first channel), and a
    per-channel half loads each page's scales once; other shapes gather per channel."""
    PER_BYTE: tl.constexpr = 8 // BITS
    ROW: tl.constexpr = D // PER_BYTE
    NG: tl.constexpr = D // GROUP_SIZE
    codes = main + blk64[:, None] * sb_main + off[:, None] * (H * ROW) + h * ROW
    if KIND == ASYM_TOKEN:
        params = off[:, None] * (H * NG) + h * NG
    else:
        params = h * D + dd[None, :]
    if D == D_PAD and (KIND == ASYM_CHANNEL or (GROUP_SIZE & (GROUP_SIZE - 1)) == 0):
        byte = tl.load(codes + tl.arange(0, ROW)[None, :], mask=t_ok[:, None], other=0).to(tl.int32)
        shifts = tl.arange(0, PER_BYTE) * BITS
        code = ((byte[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        if KIND == ASYM_TOKEN:
            g = tl.arange(0, NG)[None, :]
            s = tl.load(scale + blk64[:, None] * sb_scale + params + g, mask=t_ok[:, None], other=0.0)
            z = tl.load(zero + blk64[:, None] * sb_zero + params + g, mask=t_ok[:, None], other=0.0)
            x = tl.reshape(code, (BLOCK_N, NG, GROUP_SIZE)) * s.to(tl.float32)[:, :, None] \
                + z.to(tl.float32)[:, :, None]
            x = tl.reshape(x, (BLOCK_N, D))
        elif PAGES > 0:
            pages64 = pages.to(tl.int64)
            s = tl.load(scale + pages64[:, None] * sb_scale + params, mask=page_ok[:, None], other=0.0)
            z = tl.load(zero + pages64[:, None] * sb_zero + params, mask=page_ok[:, None], other=0.0)
            x = tl.reshape(code, (PAGES, BLOCK_N // PAGES, D)) * s.to(tl.float32)[:, None, :] \
                + z.to(tl.float32)[:, None, :]
            x = tl.reshape(x, (BLOCK_N, D))
        else:
            s = tl.load(scale + blk64[:, None] * sb_scale + params, mask=t_ok[:, None], other=0.0)
            z = tl.load(zero + blk64[:, None] * sb_zero + params, mask=t_ok[:, None], other=0.0)
            x = tl.reshape(code, (BLOCK_N, D)) * s.to(tl.float32) + z.to(tl.float32)
    else:
        byte = tl.load(codes + (dd // PER_BYTE)[None, :], mask=mask, other=0).to(tl.int32)
        code = ((byte >> ((dd % PER_BYTE) * BITS)[None, :]) & ((1 << BITS) - 1)).to(tl.float32)
        if KIND == ASYM_TOKEN:
            params = params + (dd // GROUP_SIZE)[None, :]
        s = tl.load(scale + blk64[:, None] * sb_scale + params, mask=mask, other=0.0).to(tl.float32)
        z = tl.load(zero + blk64[:, None] * sb_zero + params, mask=mask, other=0.0).to(tl.float32)
        x = code * s + z
    return x


@triton.jit
def _load_tile(t_ok, blk, off, pages, page_ok, open_row, h, H, dd, d_ok,
               main, scale, zero, out_vals, out_chans, residual,
               sb_main, sb_scale, sb_zero, sb_out_vals, sb_out_chans, sb_residual,
               KIND: tl.constexpr, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAD: tl.constexpr,
               NOUT: tl.constexpr, FROM_RESIDUAL: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
               BLOCK_N: tl.constexpr, PAGES: tl.constexpr, DOT: tl.constexpr, F32_DOTS: tl.constexpr):
    """[BLOCK_N, D_PAD] float32 keys or values of one tile's tokens (their blocks ``blk``,
    offsets ``off``; zero where ``t_ok`` is false; with PAGES > 0, PAGES runs of tokens in
    blocks ``pages``), in the basis the loop works in: rotated by H for a ``+had`` half
    without outliers, real channels otherwise. Parts are contiguous but for their block
    stride (checked by the host)."""
    mask = t_ok[:, None] & d_ok[None, :]
    if FROM_RESIDUAL:
        ptrs = residual + open_row.to(tl.int64) * sb_residual + off[:, None] * (H * D) + h * D + dd[None, :]
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        if HAD and NOUT == 0:
            x = _rotate(x, D, DOT, F32_DOTS)
    else:
        blk64 = blk.to(tl.int64)
        if KIND == ASYM_TOKEN or KIND == ASYM_CHANNEL:
            x = _dequant_asym(t_ok, blk64, off, pages, page_ok, h, H, dd, mask, main, scale, zero, sb_main, sb_scale,
                              sb_zero, KIND, BITS, GROUP_SIZE, D, D_PAD, BLOCK_N, PAGES)
        else:
            ptrs = main + blk64[:, None] * sb_main + off[:, None] * (H * D) + h * D + dd[None, :]
            raw = tl.load(ptrs, mask=mask, other=0)
            if KIND == PLAIN:
                x = raw.to(tl.float32)
            else:
                if KIND == FP8:
                    x = _e4m3_to_f32(raw)
                else:
                    x = raw.to(tl.float32)
                s = tl.load(scale + blk64 * sb_scale + off * H + h, mask=t_ok, other=0.0).to(tl.float32)
                x = x * s[:, None]
        if NOUT > 0:
            if HAD:
                x = _rotate(x, D, DOT, F32_DOTS)
            chans = out_chans + blk64 * sb_out_chans + h * NOUT
            vals = out_vals + blk64 * sb_out_vals + off * (H * NOUT) + h * NOUT
            for i in range(NOUT):
                chan = tl.load(chans + i, mask=t_ok, other=0).to(tl.int32)
                val = tl.load(vals + i, mask=t_ok, other=0.0).to(tl.float32)
                x = tl.where(dd[None, :] == chan[:, None], val[:, None], x)
    return x


@triton.jit
def _load_half(t_ok, blk, off, pages, page_ok, open_row, h, H, dd, d_ok, side_map,
               main, scale, zero, out_vals, out_chans, residual,
               sb_main, sb_scale, sb_zero, sb_out_vals, sb_out_chans, sb_residual,
               f_main, f_scale, f_zero, f_out_vals, f_out_chans,
               fb_main, fb_scale, fb_zero, fb_out_vals, fb_out_chans,
               KIND: tl.constexpr, BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAD: tl.constexpr,
               NOUT: tl.constexpr, F_KIND: tl.constexpr, F_BITS: tl.constexpr, F_GROUP_SIZE: tl.constexpr,
               F_HAD: tl.constexpr, F_NOUT: tl.constexpr, FROM_RESIDUAL: tl.constexpr, REFINED: tl.constexpr,
               D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, PAGES: tl.constexpr,
               DOT: tl.constexpr, F32_DOTS: tl.constexpr):
    """``_load_tile`` of a half whose full blocks may also hold a finer copy (precision by
    saliency, kv/storage/zip.py: ``side_map[block]`` is its side slot, or -1): a token of a
    block with one is read from the finer parts at that slot, the others from the base parts,
    each load masked to its own tokens (every byte read once). Both copies are in the loop's
    basis (the host refuses a finer copy in another Hadamard domain than its base). Open blocks
    come from residual rows either way."""
    if REFINED and FROM_RESIDUAL == 0:
        side = tl.load(side_map + blk, mask=t_ok, other=-1)
        fine = side >= 0
        if PAGES > 0:
            side_pages = tl.load(side_map + pages, mask=page_ok, other=-1)
        else:
            side_pages = side
        x = _load_tile(t_ok & (side < 0), blk, off, pages, page_ok & (side_pages < 0), open_row, h, H, dd, d_ok,
                       main, scale, zero, out_vals, out_chans, residual,
                       sb_main, sb_scale, sb_zero, sb_out_vals, sb_out_chans, sb_residual,
                       KIND, BITS, GROUP_SIZE, HAD, NOUT, False, D, D_PAD, BLOCK_N, PAGES, DOT, F32_DOTS)
        x_fine = _load_tile(t_ok & fine, side, off, side_pages, page_ok & (side_pages >= 0), open_row, h, H, dd,
                            d_ok, f_main, f_scale, f_zero, f_out_vals, f_out_chans, residual,
                            fb_main, fb_scale, fb_zero, fb_out_vals, fb_out_chans, sb_residual,
                            F_KIND, F_BITS, F_GROUP_SIZE, F_HAD, F_NOUT, False, D, D_PAD, BLOCK_N, PAGES, DOT,
                            F32_DOTS)
        x = tl.where(fine[:, None], x_fine, x)
    else:
        x = _load_tile(t_ok, blk, off, pages, page_ok, open_row, h, H, dd, d_ok,
                       main, scale, zero, out_vals, out_chans, residual,
                       sb_main, sb_scale, sb_zero, sb_out_vals, sb_out_chans, sb_residual,
                       KIND, BITS, GROUP_SIZE, HAD, NOUT, FROM_RESIDUAL, D, D_PAD, BLOCK_N, PAGES, DOT, F32_DOTS)
    return x


@triton.jit
def _tile_blocks(t0, hi, table_row, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAGES: tl.constexpr):
    """A tile's keys t0 .. t0 + BLOCK_N (those below ``hi`` valid): positions, validity, offsets
    in their blocks, each token's block, and with PAGES > 0 the tile's PAGES blocks."""
    t = t0 + tl.arange(0, BLOCK_N)
    t_ok = t < hi
    off = t % BLOCK_SIZE
    if PAGES > 0:     # t0 is block-aligned: the tile holds PAGES whole blocks, or lies in one
        p = tl.arange(0, PAGES)
        page_ok = t0 + p * (BLOCK_N // PAGES) < hi
        pages = tl.load(table_row + t0 // BLOCK_SIZE + p, mask=page_ok, other=0)
        blk = tl.reshape(tl.broadcast_to(pages[:, None], (PAGES, BLOCK_N // PAGES)), (BLOCK_N,))
    else:             # tiles straddle blocks: look every token up
        blk = tl.load(table_row + t // BLOCK_SIZE, mask=t_ok, other=0)
        pages = blk
        page_ok = t_ok
    return t, t_ok, off, blk, pages, page_ok


@triton.jit
def _key_tile(q, t0, hi, table_row, open_row, h, H, qk_scale, dd, d_ok, side_map,
              k_main, k_scale, k_zero, k_out_vals, k_out_chans, k_residual,
              kb_main, kb_scale, kb_zero, kb_out_vals, kb_out_chans, kb_residual,
              kf_main, kf_scale, kf_zero, kf_out_vals, kf_out_chans,
              kfb_main, kfb_scale, kfb_zero, kfb_out_vals, kfb_out_chans,
              K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP_SIZE: tl.constexpr, K_HAD: tl.constexpr,
              K_NOUT: tl.constexpr, KF_KIND: tl.constexpr, KF_BITS: tl.constexpr, KF_GROUP_SIZE: tl.constexpr,
              KF_HAD: tl.constexpr, KF_NOUT: tl.constexpr, FROM_RESIDUAL: tl.constexpr, REFINED: tl.constexpr,
              D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
              PAGES: tl.constexpr, DOT: tl.constexpr, F32_DOTS: tl.constexpr):
    """The tile of keys t0 .. t0 + BLOCK_N below ``hi``: ``_tile_blocks``' positions and blocks,
    and the rows' logits over its keys (log2 domain, not yet masked)."""
    t, t_ok, off, blk, pages, page_ok = _tile_blocks(t0, hi, table_row, BLOCK_SIZE, BLOCK_N, PAGES)
    k = _load_half(t_ok, blk, off, pages, page_ok, open_row, h, H, dd, d_ok, side_map,
                   k_main, k_scale, k_zero, k_out_vals, k_out_chans, k_residual,
                   kb_main, kb_scale, kb_zero, kb_out_vals, kb_out_chans, kb_residual,
                   kf_main, kf_scale, kf_zero, kf_out_vals, kf_out_chans,
                   kfb_main, kfb_scale, kfb_zero, kfb_out_vals, kfb_out_chans,
                   K_KIND, K_BITS, K_GROUP_SIZE, K_HAD, K_NOUT, KF_KIND, KF_BITS, KF_GROUP_SIZE, KF_HAD, KF_NOUT,
                   FROM_RESIDUAL, REFINED, D, D_PAD, BLOCK_N, PAGES, DOT, F32_DOTS)
    return t, t_ok, off, blk, pages, page_ok, _dot(q, tl.trans(k), DOT, F32_DOTS) * qk_scale


@triton.jit
def _attend_tiles(q, m_i, l_i, acc, lo, hi, pos, before, table_row, open_row, h, H, qk_scale, dd, d_ok,
                  k_main, k_scale, k_zero, k_out_vals, k_out_chans, k_residual,
                  kb_main, kb_scale, kb_zero, kb_out_vals, kb_out_chans, kb_residual,
                  v_main, v_scale, v_zero, v_out_vals, v_out_chans, v_residual,
                  vb_main, vb_scale, vb_zero, vb_out_vals, vb_out_chans, vb_residual,
                  side_map, kf_main, kf_scale, kf_zero, kf_out_vals, kf_out_chans,
                  kfb_main, kfb_scale, kfb_zero, kfb_out_vals, kfb_out_chans,
                  vf_main, vf_scale, vf_zero, vf_out_vals, vf_out_chans,
                  vfb_main, vfb_scale, vfb_zero, vfb_out_vals, vfb_out_chans,
                  K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP_SIZE: tl.constexpr, K_HAD: tl.constexpr,
                  K_NOUT: tl.constexpr, K_FROM_RESIDUAL: tl.constexpr,
                  V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_GROUP_SIZE: tl.constexpr, V_HAD: tl.constexpr,
                  V_NOUT: tl.constexpr, V_FROM_RESIDUAL: tl.constexpr,
                  KF_KIND: tl.constexpr, KF_BITS: tl.constexpr, KF_GROUP_SIZE: tl.constexpr, KF_HAD: tl.constexpr,
                  KF_NOUT: tl.constexpr, VF_KIND: tl.constexpr, VF_BITS: tl.constexpr,
                  VF_GROUP_SIZE: tl.constexpr, VF_HAD: tl.constexpr, VF_NOUT: tl.constexpr, REFINED: tl.constexpr,
                  D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                  PAGES: tl.constexpr, DOT: tl.constexpr, F32_DOTS: tl.constexpr):
    """Online softmax over keys [lo, hi) of one sequence; returns the updated (m, l, acc). Row r
    sees the keys t with before[r] < t <= pos[r] (``before``: -1, or a sliding window's edge)."""
    for t0 in range(lo, hi, BLOCK_N):
        t, t_ok, off, blk, pages, page_ok, s = _key_tile(
            q, t0, hi, table_row, open_row, h, H, qk_scale, dd, d_ok, side_map,
            k_main, k_scale, k_zero, k_out_vals, k_out_chans, k_residual,
            kb_main, kb_scale, kb_zero, kb_out_vals, kb_out_chans, kb_residual,
            kf_main, kf_scale, kf_zero, kf_out_vals, kf_out_chans, kfb_main, kfb_scale, kfb_zero, kfb_out_vals,
            kfb_out_chans, K_KIND, K_BITS, K_GROUP_SIZE, K_HAD, K_NOUT, KF_KIND, KF_BITS, KF_GROUP_SIZE, KF_HAD,
            KF_NOUT, K_FROM_RESIDUAL, REFINED, D, D_PAD, BLOCK_SIZE, BLOCK_N, PAGES, DOT, F32_DOTS)
        visible = t_ok[None, :] & (t[None, :] <= pos[:, None]) & (t[None, :] > before[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = _load_half(t_ok, blk, off, pages, page_ok, open_row, h, H, dd, d_ok, side_map,
                       v_main, v_scale, v_zero, v_out_vals, v_out_chans, v_residual,
                       vb_main, vb_scale, vb_zero, vb_out_vals, vb_out_chans, vb_residual,
                       vf_main, vf_scale, vf_zero, vf_out_vals, vf_out_chans,
                       vfb_main, vfb_scale, vfb_zero, vfb_out_vals, vfb_out_chans,
                       V_KIND, V_BITS, V_GROUP_SIZE, V_HAD, V_NOUT, VF_KIND, VF_BITS, VF_GROUP_SIZE, VF_HAD, VF_NOUT,
                       V_FROM_RESIDUAL, REFINED, D, D_PAD, BLOCK_N, PAGES, DOT, F32_DOTS)
        acc = acc * alpha[:, None] + _dot(p, v, DOT, F32_DOTS)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _tail_lo(length, open_row, HAS_RESIDUAL: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    """The first key of a sequence's open block where its halves read it from residual rows
    (tokens [tail_lo, length)), else ``length``."""
    tail_lo = length
    if HAS_RESIDUAL:  # noqa: SIM102 (compile-time test, then a run-time one)
        if open_row >= 0:
            tail_lo = (length // BLOCK_SIZE) * BLOCK_SIZE
    return tail_lo


@triton.jit
def _query_tile(q_ptr, sq_t, sq_h, query_positions, q_start, n, length, q_tile, h, dd, d_ok,
                K_HAD: tl.constexpr, K_NOUT: tl.constexpr, GROUP: tl.constexpr, QUERIES: tl.constexpr,
                ROWS: tl.constexpr, D: tl.constexpr, DOT: tl.constexpr, F32_DOTS: tl.constexpr,
                HAS_POSITIONS: tl.constexpr):
    """Query tile ``q_tile`` of a sequence of ``n`` queries: its rows' query index ``j``,
    validity, query head, position and row of q, and q itself in the keys' basis (rotated for a
    ``+had`` key half read rotated) in the dot dtype. With HAS_POSITIONS each query's position is
    read from ``query_positions``, else a sequence's queries are its last n positions."""
    rows = tl.arange(0, ROWS)
    j = q_tile * QUERIES + rows // GROUP
    row_ok = (rows < QUERIES * GROUP) & (j < n)
    head = h * GROUP + rows % GROUP
    if HAS_POSITIONS:
        pos = tl.load(query_positions + q_start + j, mask=row_ok, other=0)
    else:
        pos = length - n + j
    q_rows = (q_start + j).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * sq_t + head[:, None] * sq_h + dd[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    if K_HAD and K_NOUT == 0:
        q = _rotate(q, D, tl.float32, F32_DOTS)
    return j, row_ok, head, pos, q_rows, q.to(DOT)


@triton.jit
def attend(q_ptr, sq_t, sq_h, o_ptr, so_t, so_h, part_acc, part_m, part_l, num_rows,
           tables, s_table, context_lens, query_starts, open_rows, query_positions, window,
           H, num_q_tiles, tokens_per_split, qk_scale,
           k_main, k_scale, k_zero, k_out_vals, k_out_chans, k_residual,
           kb_main, kb_scale, kb_zero, kb_out_vals, kb_out_chans, kb_residual,
           v_main, v_scale, v_zero, v_out_vals, v_out_chans, v_residual,
           vb_main, vb_scale, vb_zero, vb_out_vals, vb_out_chans, vb_residual,
           side_map, kf_main, kf_scale, kf_zero, kf_out_vals, kf_out_chans,
           kfb_main, kfb_scale, kfb_zero, kfb_out_vals, kfb_out_chans,
           vf_main, vf_scale, vf_zero, vf_out_vals, vf_out_chans,
           vfb_main, vfb_scale, vfb_zero, vfb_out_vals, vfb_out_chans, row_m, row_l, tickets,
           K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP_SIZE: tl.constexpr, K_HAD: tl.constexpr,
           K_NOUT: tl.constexpr, K_HAS_RESIDUAL: tl.constexpr,
           V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_GROUP_SIZE: tl.constexpr, V_HAD: tl.constexpr,
           V_NOUT: tl.constexpr, V_HAS_RESIDUAL: tl.constexpr,
           KF_KIND: tl.constexpr, KF_BITS: tl.constexpr, KF_GROUP_SIZE: tl.constexpr, KF_HAD: tl.constexpr,
           KF_NOUT: tl.constexpr, VF_KIND: tl.constexpr, VF_BITS: tl.constexpr, VF_GROUP_SIZE: tl.constexpr,
           VF_HAD: tl.constexpr, VF_NOUT: tl.constexpr, REFINED: tl.constexpr,
           GROUP: tl.constexpr, QUERIES: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
           BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAGES: tl.constexpr, SPLIT: tl.constexpr,
           DOT: tl.constexpr, F32_DOTS: tl.constexpr, HAS_POSITIONS: tl.constexpr, STATS: tl.constexpr,
           MERGE_HERE: tl.constexpr):
    """One program: ROWS (query, head) rows of one sequence over one split of its keys. With
    HAS_POSITIONS each query's position is read from ``query_positions`` (ascending, the last
    at length - 1: a prefill with gaps), else a sequence's queries are its last n positions.
    ``window`` > 0: each query sees only its last ``window`` positions (a sliding-window layer);
    keys before the tile's first query's window are not read. With SPLIT the program writes its
    split's partials; with MERGE_HERE too, the last of a tile's splits to finish (``tickets``: one
    counter per (program_id(0), KV head), zero before the launch and left zero) merges them."""
    s_idx = tl.program_id(0) // num_q_tiles
    q_tile = tl.program_id(0) % num_q_tiles
    h = tl.program_id(1)
    split = tl.program_id(2)
    q_start = tl.load(query_starts + s_idx)
    n = tl.load(query_starts + s_idx + 1) - q_start
    if q_tile * QUERIES >= n:
        return
    length = tl.load(context_lens + s_idx)
    open_row = tl.load(open_rows + s_idx)
    tail_lo = _tail_lo(length, open_row, K_HAS_RESIDUAL or V_HAS_RESIDUAL, BLOCK_SIZE)
    lo = split * tokens_per_split
    dd = tl.arange(0, D_PAD)
    d_ok = dd < D
    _, row_ok, head, pos, q_rows, q = _query_tile(q_ptr, sq_t, sq_h, query_positions, q_start, n, length, q_tile,
                                                  h, dd, d_ok, K_HAD, K_NOUT, GROUP, QUERIES, ROWS, D, DOT, F32_DOTS,
                                                  HAS_POSITIONS)
    last_q = tl.minimum(n, (q_tile + 1) * QUERIES) - 1
    if HAS_POSITIONS:
        last_pos = tl.load(query_positions + q_start + last_q)
    else:
        last_pos = length - n + last_q
    # keys past this tile's last query are masked for every row: stop there
    hi = tl.minimum(tl.minimum(lo + tokens_per_split, length), last_pos + 1)
    before = tl.where(window > 0, pos - window, -1)          # each row's last key before its window
    if window > 0:    # keys before the first row's window are masked for every row: start there
        first_q = q_tile * QUERIES
        if HAS_POSITIONS:
            first_pos = tl.load(query_positions + q_start + first_q)
        else:
            first_pos = length - n + first_q
        lo = tl.maximum(lo, tl.maximum(first_pos - window + 1, 0) // BLOCK_N * BLOCK_N)   # tiles stay aligned

    m_i = tl.full((ROWS,), NEG_BIG, tl.float32)
    l_i = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D_PAD), tl.float32)
    table_row = tables + s_idx.to(tl.int64) * s_table
    m_i, l_i, acc = _attend_tiles(q, m_i, l_i, acc, lo, tl.minimum(hi, tail_lo), pos, before, table_row, open_row, h, H,
                                  qk_scale, dd, d_ok,
                                  k_main, k_scale, k_zero, k_out_vals, k_out_chans, k_residual,
                                  kb_main, kb_scale, kb_zero, kb_out_vals, kb_out_chans, kb_residual,
                                  v_main, v_scale, v_zero, v_out_vals, v_out_chans, v_residual,
                                  vb_main, vb_scale, vb_zero, vb_out_vals, vb_out_chans, vb_residual,
                                  side_map, kf_main, kf_scale, kf_zero, kf_out_vals, kf_out_chans,
                                  kfb_main, kfb_scale, kfb_zero, kfb_out_vals, kfb_out_chans,
                                  vf_main, vf_scale, vf_zero, vf_out_vals, vf_out_chans,
                                  vfb_main, vfb_scale, vfb_zero, vfb_out_vals, vfb_out_chans,
                                  K_KIND, K_BITS, K_GROUP_SIZE, K_HAD, K_NOUT, False,
                                  V_KIND, V_BITS, V_GROUP_SIZE, V_HAD, V_NOUT, False,
                                  KF_KIND, KF_BITS, KF_GROUP_SIZE, KF_HAD, KF_NOUT, VF_KIND, VF_BITS, VF_GROUP_SIZE, VF_HAD, VF_NOUT,
                                  REFINED, D, D_PAD, BLOCK_SIZE, BLOCK_N, PAGES, DOT, F32_DOTS)
    if K_HAS_RESIDUAL or V_HAS_RESIDUAL:
        m_i, l_i, acc = _attend_tiles(q, m_i, l_i, acc, tl.maximum(lo, tail_lo), hi, pos, before, table_row, open_row, h,
                                      H, qk_scale, dd, d_ok,
                                      k_main, k_scale, k_zero, k_out_vals, k_out_chans, k_residual,
                                      kb_main, kb_scale, kb_zero, kb_out_vals, kb_out_chans, kb_residual,
                                      v_main, v_scale, v_zero, v_out_vals, v_out_chans, v_residual,
                                      vb_main, vb_scale, vb_zero, vb_out_vals, vb_out_chans, vb_residual,
                                      side_map, kf_main, kf_scale, kf_zero, kf_out_vals, kf_out_chans,
                                      kfb_main, kfb_scale, kfb_zero, kfb_out_vals, kfb_out_chans,
                                      vf_main, vf_scale, vf_zero, vf_out_vals, vf_out_chans,
                                      vfb_main, vfb_scale, vfb_zero, vfb_out_vals, vfb_out_chans,
                                      K_KIND, K_BITS, K_GROUP_SIZE, K_HAD, K_NOUT, K_HAS_RESIDUAL,
                                      V_KIND, V_BITS, V_GROUP_SIZE, V_HAD, V_NOUT, V_HAS_RESIDUAL,
                                      KF_KIND, KF_BITS, KF_GROUP_SIZE, KF_HAD, KF_NOUT, VF_KIND, VF_BITS, VF_GROUP_SIZE, VF_HAD, VF_NOUT,
                                      REFINED, D, D_PAD, BLOCK_SIZE, BLOCK_N, PAGES, DOT, F32_DOTS)
    if V_HAD and V_NOUT == 0:
        acc = _rotate(acc, D, tl.float32, F32_DOTS)

    rows = q_rows * (H * GROUP) + head          # the tile's (query, head) rows in the flat [T x Hq] order
    write = True
    if SPLIT:
        idx = split.to(tl.int64) * num_rows + rows
        tl.store(part_acc + idx[:, None] * D_PAD + dd[None, :], acc, mask=row_ok[:, None])
        tl.store(part_m + idx, m_i, mask=row_ok)
        tl.store(part_l + idx, l_i, mask=row_ok)
        write = False
        if MERGE_HERE:
            # every thread's partials stored (barrier) before the ticket is taken (release); the
            # last program's loads of the others' partials after it (acquire, read from L2)
            tl.debug_barrier()
            ticket_ptr = tickets + tl.program_id(0) * H + h
            num_splits = tl.num_programs(2)
            ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel")
            write = ticket == num_splits - 1
            if write:
                m_i, l_i, acc = _merge_splits(part_acc, part_m, part_l, rows.to(tl.int64), row_ok, num_rows,
                                              num_splits, dd, ROWS, D_PAD)
                tl.atomic_xchg(ticket_ptr, 0)       # ready for the next launch
    if write:
        if STATS:      # each row's final max and sum, for ``score``
            tl.store(row_m + rows, m_i, mask=row_ok)
            tl.store(row_l + rows, l_i, mask=row_ok)
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]   # no visible key (l = 0): acc = 0
        tl.store(o_ptr + q_rows[:, None] * so_t + head[:, None] * so_h + dd[None, :],
                 out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


@triton.jit
def _merge_splits(part_acc, part_m, part_l, rows, r_ok, num_rows, num_splits, dd, ROWS: tl.constexpr,
                  D_PAD: tl.constexpr):
    """The splits' (acc, max, sum) of ``rows`` combined, split 0 first: the same operations in
    the same order whichever program merges."""
    m = tl.full((ROWS,), NEG_BIG, tl.float32)
    l_sum = tl.zeros((ROWS,), tl.float32)
    acc = tl.zeros((ROWS, D_PAD), tl.float32)
    for k in range(num_splits):
        idx = k * num_rows + rows
        m_k = tl.load(part_m + idx, mask=r_ok, other=NEG_BIG, cache_modifier=".cg")
        l_k = tl.load(part_l + idx, mask=r_ok, other=0.0, cache_modifier=".cg")
        acc_k = tl.load(part_acc + idx[:, None] * D_PAD + dd[None, :], mask=r_ok[:, None], other=0.0,
                        cache_modifier=".cg")
        m_new = tl.maximum(m, m_k)
        alpha = tl.exp2(m - m_new)
        beta = tl.exp2(m_k - m_new)
        l_sum = l_sum * alpha + l_k * beta
        acc = acc * alpha[:, None] + acc_k * beta[:, None]
        m = m_new
    return m, l_sum, acc


@triton.jit
def merge(part_acc, part_m, part_l, o_ptr, so_t, so_h, num_rows, num_heads, num_splits, row_m, row_l,
          ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, STATS: tl.constexpr):
    """Combine the splits' (acc, max, sum) of ROWS (query, head) rows into the output."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r_ok = r < num_rows
    dd = tl.arange(0, D_PAD)
    m, l_sum, acc = _merge_splits(part_acc, part_m, part_l, r.to(tl.int64), r_ok, num_rows, num_splits, dd, ROWS,
                                  D_PAD)
    if STATS:
        tl.store(row_m + r, m, mask=r_ok)
        tl.store(row_l + r, l_sum, mask=r_ok)
    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    t = (r // num_heads).to(tl.int64)
    head = r % num_heads
    tl.store(o_ptr + t[:, None] * so_t + head[:, None] * so_h + dd[None, :], out.to(o_ptr.dtype.element_ty),
             mask=r_ok[:, None] & (dd < D)[None, :])


@triton.jit
def _score_tiles(q, m_row, l_row, w_row, width, lo, hi, pos, row_ok, table_row, open_row, h, H, qk_scale, dd, d_ok,
                 side_map, k_main, k_scale, k_zero, k_out_vals, k_out_chans, k_residual,
                 kb_main, kb_scale, kb_zero, kb_out_vals, kb_out_chans, kb_residual,
                 kf_main, kf_scale, kf_zero, kf_out_vals, kf_out_chans,
                 kfb_main, kfb_scale, kfb_zero, kfb_out_vals, kfb_out_chans,
                 K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP_SIZE: tl.constexpr, K_HAD: tl.constexpr,
                 K_NOUT: tl.constexpr, KF_KIND: tl.constexpr, KF_BITS: tl.constexpr, KF_GROUP_SIZE: tl.constexpr,
                 KF_HAD: tl.constexpr, KF_NOUT: tl.constexpr, FROM_RESIDUAL: tl.constexpr, REFINED: tl.constexpr,
                 D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                 PAGES: tl.constexpr, DOT: tl.constexpr, F32_DOTS: tl.constexpr):
    """Adds to ``w_row`` (one sequence's weights for one KV head) the softmax weight every key in
    [lo, hi) gets from the rows: exp2(s - m) / l with each row's final max and sum."""
    for t0 in range(lo, hi, BLOCK_N):
        t, t_ok, _, _, _, _, s = _key_tile(
            q, t0, hi, table_row, open_row, h, H, qk_scale, dd, d_ok, side_map,
            k_main, k_scale, k_zero, k_out_vals, k_out_chans, k_residual,
            kb_main, kb_scale, kb_zero, kb_out_vals, kb_out_chans, kb_residual,
            kf_main, kf_scale, kf_zero, kf_out_vals, kf_out_chans, kfb_main, kfb_scale, kfb_zero, kfb_out_vals,
            kfb_out_chans, K_KIND, K_BITS, K_GROUP_SIZE, K_HAD, K_NOUT, KF_KIND, KF_BITS, KF_GROUP_SIZE, KF_HAD,
            KF_NOUT, FROM_RESIDUAL, REFINED, D, D_PAD, BLOCK_SIZE, BLOCK_N, PAGES, DOT, F32_DOTS)
        visible = row_ok[:, None] & t_ok[None, :] & (t[None, :] <= pos[:, None])
        p = tl.where(visible, tl.exp2(s - m_row[:, None]) / l_row[:, None], 0.0)
        w_ok = t_ok & (t < width)
        w = tl.load(w_row + t, mask=w_ok, other=0.0)
        tl.store(w_row + t, w + tl.sum(p, axis=0), mask=w_ok)


@triton.jit
def score(q_ptr, sq_t, sq_h, row_m, row_l, weights, sw_s, sw_h, width, score_from,
          tables, s_table, context_lens, query_starts, open_rows, query_positions, H, qk_scale,
          k_main, k_scale, k_zero, k_out_vals, k_out_chans, k_residual,
          kb_main, kb_scale, kb_zero, kb_out_vals, kb_out_chans, kb_residual,
          side_map, kf_main, kf_scale, kf_zero, kf_out_vals, kf_out_chans,
          kfb_main, kfb_scale, kfb_zero, kfb_out_vals, kfb_out_chans,
          K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_GROUP_SIZE: tl.constexpr, K_HAD: tl.constexpr,
          K_NOUT: tl.constexpr, K_HAS_RESIDUAL: tl.constexpr,
          KF_KIND: tl.constexpr, KF_BITS: tl.constexpr, KF_GROUP_SIZE: tl.constexpr, KF_HAD: tl.constexpr,
          KF_NOUT: tl.constexpr, REFINED: tl.constexpr,
          GROUP: tl.constexpr, QUERIES: tl.constexpr, ROWS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
          BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PAGES: tl.constexpr,
          DOT: tl.constexpr, F32_DOTS: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    """The attention weights one sequence's queries from its row ``score_from`` on give each key,
    summed over the queries and the query heads of one KV head (``AttentionScores``), after
    ``attend`` stored each row's final max and sum: one program per (sequence, KV head), its
    query tiles one after another, so each weight is summed in one order (no atomics)."""
    s_idx = tl.program_id(0)
    h = tl.program_id(1)
    q_start = tl.load(query_starts + s_idx)
    n = tl.load(query_starts + s_idx + 1) - q_start
    first = tl.load(score_from + s_idx)
    if first >= n:
        return
    length = tl.load(context_lens + s_idx)
    open_row = tl.load(open_rows + s_idx)
    tail_lo = _tail_lo(length, open_row, K_HAS_RESIDUAL, BLOCK_SIZE)
    dd = tl.arange(0, D_PAD)
    d_ok = dd < D
    table_row = tables + s_idx.to(tl.int64) * s_table
    w_row = weights + s_idx.to(tl.int64) * sw_s + h * sw_h
    for q_tile in range(first // QUERIES, tl.cdiv(n, QUERIES)):
        j, row_ok, head, pos, q_rows, q = _query_tile(q_ptr, sq_t, sq_h, query_positions, q_start, n, length, q_tile,
                                                      h, dd, d_ok, K_HAD, K_NOUT, GROUP, QUERIES, ROWS, D, DOT,
                                                      F32_DOTS, HAS_POSITIONS)
        row_ok = row_ok & (j >= first)          # the tile's rows before the first scored one add nothing
        m_row = tl.load(row_m + q_rows * (H * GROUP) + head, mask=row_ok, other=0.0)
        l_row = tl.load(row_l + q_rows * (H * GROUP) + head, mask=row_ok, other=1.0)
        _score_tiles(q, m_row, l_row, w_row, width, 0, tail_lo, pos, row_ok, table_row, open_row, h, H, qk_scale,
                     dd, d_ok, side_map, k_main, k_scale, k_zero, k_out_vals, k_out_chans, k_residual,
                     kb_main, kb_scale, kb_zero, kb_out_vals, kb_out_chans, kb_residual,
                     kf_main, kf_scale, kf_zero, kf_out_vals, kf_out_chans,
                     kfb_main, kfb_scale, kfb_zero, kfb_out_vals, kfb_out_chans,
                     K_KIND, K_BITS, K_GROUP_SIZE, K_HAD, K_NOUT, KF_KIND, KF_BITS, KF_GROUP_SIZE, KF_HAD, KF_NOUT,
                     False, REFINED, D, D_PAD, BLOCK_SIZE, BLOCK_N, PAGES, DOT, F32_DOTS)
        if K_HAS_RESIDUAL:
            _score_tiles(q, m_row, l_row, w_row, width, tail_lo, length, pos, row_ok, table_row, open_row, h, H,
                         qk_scale, dd, d_ok, side_map, k_main, k_scale, k_zero, k_out_vals, k_out_chans, k_residual,
                         kb_main, kb_scale, kb_zero, kb_out_vals, kb_out_chans, kb_residual,
                         kf_main, kf_scale, kf_zero, kf_out_vals, kf_out_chans,
                         kfb_main, kfb_scale, kfb_zero, kfb_out_vals, kfb_out_chans,
                         K_KIND, K_BITS, K_GROUP_SIZE, K_HAD, K_NOUT, KF_KIND, KF_BITS, KF_GROUP_SIZE, KF_HAD, KF_NOUT,
                         K_HAS_RESIDUAL, REFINED, D, D_PAD, BLOCK_SIZE, BLOCK_N, PAGES, DOT, F32_DOTS)

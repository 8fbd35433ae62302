// Reading one block of one head of a half (K or V) in its stored format: a HalfView of the
// part tensors (layouts of kvserve/kv/storage/layout.py, each contiguous [num_blocks, ...]),
// the prefetcher that asks for the next block ahead, `rows_in_place` (the block's rows as
// the attention reads them where they lie) and `decode_block` (float32 rows in a small L1
// buffer, block_size x ld floats, ld = head_dim rounded up to 16, padding zero) for layouts
// and tiles that cannot be read in place.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "simd.h"

namespace kvs {

enum Kind : int { PLAIN = 0, INT8 = 1, FP8 = 2, ASYM_TOKEN = 3, ASYM_CHANNEL = 4 };
enum Dtype : int { F32 = 0, F16 = 1, BF16 = 2 };

struct HalfView {
  int kind = PLAIN;
  int dtype = F32;        // PLAIN storage dtype
  int bits = 8;           // ASYM kinds: 2 or 4
  int group = 0;          // ASYM_TOKEN: channels per scale
  int num_outliers = 0;
  bool hadamard = false;
  // With a rotation and no outliers the kernel works in the rotated domain: blocks are
  // read as the inner codec stores them (y = H x), the query is rotated instead (keys) or
  // the output is (values), and residual rows are rotated into that domain.
  bool rotated = false;
  int64_t num_blocks = 0, B = 0, H = 0, D = 0;
  const uint8_t* main = nullptr;      // `data` or `codes`
  const uint16_t* scale = nullptr;    // float16 bits
  const uint16_t* zero = nullptr;
  const uint16_t* out_values = nullptr;
  const uint8_t* out_channels = nullptr;
  const uint8_t* residual = nullptr;  // [rows, B, H, D] plain, `residual_dtype`
  int residual_dtype = F32;
  int64_t residual_rows = 0;
  int64_t row_bytes = 0;              // bytes of `main` per (token, head)
  // Precision by saliency (kv/storage/zip.py): a block with side[block] >= 0 is read from
  // `fine`, the half's finer format, at that slot (same heads and dim; either Hadamard domain).
  const HalfView* fine = nullptr;
  const int64_t* side = nullptr;      // [num_blocks]
  bool rows_only = false;             // every token goes to its residual row first (a zip storage's halves)
};

inline int64_t dtype_size(int dtype) { return dtype == F32 ? 4 : 2; }

// How the attention reads a block's rows of one head (or a residual row): row j starts at
// base + j * stride bytes, W channels at a time in format `code`, and is multiplied by
// scale[j] when given (int8 / fp8: their per-token scale is applied once per key, not per
// element). Packed 4/2-bit codes are dequantized as they are read, with per-channel
// (cs, cz: the block's parameters of KIVI keys) or per-(key, group) (gs, gz [j * gstride + g])
// scale and zero. Codes other than F32 are read straight from the cache; a layout without
// a code (outliers, +had with outliers, odd sizes) is decoded to float32 rows first.
enum Code : int { C_F32 = 0, C_F16, C_BF16, C_I8, C_FP8, C_U4C, C_U2C, C_U4G, C_U2G };

struct Rows {
  const uint8_t* base = nullptr;
  int64_t stride = 0;
  int code = C_F32;
  const float* scale = nullptr;
  const float* cs = nullptr;
  const float* cz = nullptr;
  const float* gs = nullptr;
  const float* gz = nullptr;
  int64_t gstride = 0;   // gs / gz floats from one key to the next
  int group = 0;         // channels per gs / gz entry
};

enum Side : int { KEY = 0, VALUE = 1 };

// Where a half's block is decoded (per thread): rows, and the parameters the reading applies.
struct HalfBuffers {
  float* x;        // [block_size, ld]
  float* rs;       // [pld] per-key scales (finite everywhere)
  float* cs;       // [ld] per-channel scale, zero
  float* cz;
  float* gs;       // [block_size, heads, groups] per (key, head, group) scale, zero of one block,
  float* gz;       //   converted once for all the heads that read it
  int64_t pld;     // block_size rounded up to 16
  int64_t gs_block = -1;  // the block gs / gz hold
};

// int8 / fp8 rows decoded without their per-token scale: the attention applies it once per key.
inline bool folds_rows(const HalfView& v) { return (v.kind == INT8 || v.kind == FP8) && v.num_outliers == 0; }


// Rolling software prefetch of what comes next (the next head of the block, or the next
// block) while the current head is processed. Blocks lie in random order in the pool, so
// each starts with a full memory latency unless asked for ahead; issuing a whole block at
// once stalls on the miss buffers, and asking for more than about one head ahead evicts
// lines from L1 before they are used (a float32 block of SmolLM2 is 24 KiB). The lines are
// spread over `pump()` calls placed in the per-key loops.
class Prefetcher {
 public:
  void clear() {
    n_ = cur_ = 0;
    at_ = nullptr;
    lines_ = 0;
  }
  // `rows` runs of `bytes` bytes, `stride` bytes apart; `far`: into L2 only (blocks further ahead).
  void add(const void* p, int64_t bytes, int64_t rows = 1, int64_t stride = 0, bool far = false) {
    if (bytes <= 0 || rows <= 0 || n_ == kMaxRanges) return;
    ranges_[n_] = Range{static_cast<const char*>(p), bytes, rows, stride, far};
    lines_ += rows * ((bytes + 63) / 64 + 1);
    if (n_++ == 0) start(0);
  }
  // Spread the lines over about `pumps` calls.
  void plan(int64_t pumps) { quota_ = static_cast<int>(pumps > 0 ? (lines_ + pumps - 1) / pumps : lines_); }
  __attribute__((always_inline)) void pump() { issue(quota_); }
  void drain() { issue(std::numeric_limits<int64_t>::max()); }

 private:
  struct Range {
    const char* base;
    int64_t bytes, rows, stride;
    bool far;
  };
  static constexpr int kMaxRanges = 16;
  void start(int i) {
    cur_ = i;
    row_ = 0;
    set_row();
  }
  void set_row() {
    const Range& r = ranges_[cur_];
    const char* p = r.base + row_ * r.stride;
    at_ = reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63});
    end_ = p + r.bytes;
  }
  // Up to `count` lines, a tight loop per run of bytes.
  __attribute__((always_inline)) void issue(int64_t count) {
    while (count > 0 && at_) {
      const int64_t k = std::min<int64_t>(count, (end_ - at_ + 63) / 64);
      if (ranges_[cur_].far) {
        for (int64_t i = 0; i < k; ++i) __builtin_prefetch(at_ + 64 * i, 0, 2);
      } else {
        for (int64_t i = 0; i < k; ++i) __builtin_prefetch(at_ + 64 * i, 0, 3);
      }
      at_ += 64 * k;
      count -= k;
      if (at_ < end_) return;
      if (++row_ < ranges_[cur_].rows) {
        set_row();
      } else if (cur_ + 1 < n_) {
        start(cur_ + 1);
      } else {
        at_ = nullptr;
      }
    }
  }
  Range ranges_[kMaxRanges];
  int n_ = 0, cur_ = 0, quota_ = 1;
  int64_t row_ = 0;
  const char* at_ = nullptr;
  const char* end_ = nullptr;
  int64_t lines_ = 0;
};

// The small parameter parts of `block` (scales, zeros, outliers), all heads.
inline void add_params(Prefetcher& pf, const HalfView& v, int64_t block, bool far = false) {
  const int64_t BH = v.B * v.H;
  int64_t params = 0;  // float16 scale / zero entries per block
  if (v.kind == INT8 || v.kind == FP8) params = BH;
  if (v.kind == ASYM_TOKEN) params = BH * (v.D / v.group);
  if (v.kind == ASYM_CHANNEL) params = v.H * v.D;
  if (params) pf.add(v.scale + block * params, 2 * params, 1, 0, far);
  if (v.zero) pf.add(v.zero + block * params, 2 * params, 1, 0, far);
  if (v.num_outliers) {
    pf.add(v.out_values + block * BH * v.num_outliers, 2 * BH * v.num_outliers, 1, 0, far);
    pf.add(v.out_channels + block * v.H * v.num_outliers, v.H * v.num_outliers, 1, 0, far);
  }
}

// Every byte of `block`, all heads: one contiguous run per part.
inline void add_block(Prefetcher& pf, const HalfView& v, int64_t block, bool far = false) {
  const int64_t BH = v.B * v.H;
  pf.add(v.main + block * BH * v.row_bytes, BH * v.row_bytes, 1, 0, far);
  add_params(pf, v, block, far);
}

// The rows of head `head` of `block` (strided: heads interleave per token).
inline void add_head_rows(Prefetcher& pf, const HalfView& v, int64_t block, int64_t head, bool far = false) {
  pf.add(v.main + (block * v.B * v.H + head) * v.row_bytes, v.row_bytes, v.B, v.H * v.row_bytes, far);
}

// One row of plain storage in `dtype` -> float.
inline void plain_row(const uint8_t* src, int dtype, int D, float* dst) {
  int d = 0;
  if (dtype == F32) {
    const float* s = reinterpret_cast<const float*>(src);
    for (; d < D; ++d) dst[d] = s[d];
    return;
  }
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#ifdef KVS_SIMD
  if (dtype == F16) {
    for (; d + W <= D; d += W) vstore(dst + d, vload_f16(s + d));
  } else {
    for (; d + W <= D; d += W) vstore(dst + d, vload_bf16(s + d));
  }
#endif
  for (; d < D; ++d) dst[d] = dtype == F16 ? f16_to_f32(s[d]) : bf16_to_f32(s[d]);
}

inline void int8_row(const int8_t* c, int D, float* dst) {
  int d = 0;
#ifdef KVS_SIMD
  for (; d + W <= D; d += W) vstore(dst + d, vload_i8(c + d));
#endif
  for (; d < D; ++d) dst[d] = static_cast<float>(c[d]);
}

// fp8 codes / kFp8RowScale (exact: a power of two; the row's scale absorbs it).
#ifdef KVS_SIMD
constexpr float kFp8RowScale = 256.0f;
#else
constexpr float kFp8RowScale = 1.0f;
#endif
inline void fp8_row(const uint8_t* c, int D, float* dst) {
  int d = 0;
#ifdef KVS_SIMD
  for (; d + W <= D; d += W) vstore(dst + d, vload_fp8_div256(c + d));
#endif
  for (; d < D; ++d) dst[d] = fp8_to_f32(c[d]) / kFp8RowScale;
}

inline int code_at(const uint8_t* c, int bits, int d) {
  const int per_byte = 8 / bits;
  return (c[d / per_byte] >> ((d % per_byte) * bits)) & ((1 << bits) - 1);
}

#ifdef KVS_SIMD
// W channels of packed BITS-bit codes starting at channel d (a multiple of W) of a row of D.
template <int BITS>
inline vf vcodes(const uint8_t* c, int d, int D) {
  if constexpr (BITS == 4) {
    return vload_u4(c + d / 2);
  } else {
#if KVS_W == 8
    // two vectors' codes per 32-bit word (d is a constant where the kernels unroll)
    if (d % 16) return vload_u2(c + (d - 8) / 4, true);
    if (d + 16 <= D) return vload_u2(c + d / 4, false);
    return vload_u2_short(c + d / 4);
#else
    (void)D;
    return vload_u2(c + d / 4);
#endif
  }
}
#endif

// Packed asymmetric codes -> code * sc + zr, with per-channel sc / zr (arrays of D floats).
template <int BITS>
inline void asym_row_channels(const uint8_t* c, const float* sc, const float* zr, int D, float* dst) {
  int d = 0;
#ifdef KVS_SIMD
  for (; d + W <= D; d += W) vstore(dst + d, vfma(vcodes<BITS>(c, d, D), vload(sc + d), vload(zr + d)));
#endif
  for (; d < D; ++d) dst[d] = std::fma(static_cast<float>(code_at(c, BITS, d)), sc[d], zr[d]);
}

// Packed asymmetric codes with one (scale, zero) per group of G channels, G a multiple of W.
template <int BITS>
inline void asym_row_groups(const uint8_t* c, const uint16_t* scale, const uint16_t* zero, int G, int D, float* dst) {
  for (int g = 0, d = 0; g < D / G; ++g) {
    const float s = f16_to_f32(scale[g]), z = f16_to_f32(zero[g]);
    const int end = (g + 1) * G;
#ifdef KVS_SIMD
    const vf vs = vset1(s), vz = vset1(z);
    for (; d < end; d += W) vstore(dst + d, vfma(vcodes<BITS>(c, d, D), vs, vz));
#endif
    for (; d < end; ++d) dst[d] = std::fma(static_cast<float>(code_at(c, BITS, d)), s, z);
  }
}

// n float16 values -> float.
inline void f16_array(const uint16_t* src, int n, float* dst) {
  int d = 0;
#ifdef KVS_SIMD
  for (; d + W <= n; d += W) vstore(dst + d, vload_f16(src + d));
#endif
  for (; d < n; ++d) dst[d] = f16_to_f32(src[d]);
}

// Rows of an asymmetric half (codes of BITS bits) -> hb.x; see decode_block.
template <int BITS>
inline void asym_rows(const HalfView& v, int64_t block, int64_t head, int n, int64_t ld, HalfBuffers& hb,
                      Prefetcher& pf) {
  const int D = static_cast<int>(v.D);
  const int64_t first = block * v.B * v.H + head;
  const int64_t stride = v.H * v.row_bytes;
  const uint8_t* row = v.main + first * v.row_bytes;
  float* sc = hb.cs;
  float* zr = hb.cz;
  if (v.kind == ASYM_CHANNEL) {  // one (scale, zero) per channel for the whole block
    const int64_t at = (block * v.H + head) * v.D;
    f16_array(v.scale + at, D, sc);
    f16_array(v.zero + at, D, zr);
    for (int j = 0; j < n; ++j, row += stride) {
      if (j % 4 == 0) pf.pump();
      asym_row_channels<BITS>(row, sc, zr, D, hb.x + j * ld);
    }
    return;
  }
  const int64_t groups = v.D / v.group;
  for (int j = 0; j < n; ++j, row += stride) {
    if (j % 4 == 0) pf.pump();
    const int64_t th = (first + j * v.H) * groups;
    if (v.group % W == 0) {
      asym_row_groups<BITS>(row, v.scale + th, v.zero + th, v.group, D, hb.x + j * ld);
    } else {
      for (int d = 0; d < D; ++d) {
        sc[d] = f16_to_f32(v.scale[th + d / v.group]);
        zr[d] = f16_to_f32(v.zero[th + d / v.group]);
      }
      asym_row_channels<BITS>(row, sc, zr, D, hb.x + j * ld);
    }
  }
}

// Rows [0, n) of `block`, head `head` read where they lie, with the parameters the reader
// applies (filled into hb). Only for layouts without outliers whose rows are whole vectors
// (head_dim a multiple of 16); `convert`: whether codes other than float32 may be read so
// (small tiles, see attend.h). code < 0: decode instead.
inline Rows rows_in_place(const HalfView& v, int64_t block, int64_t head, int n, bool convert, HalfBuffers& hb) {
  Rows out;
  out.code = -1;
  if (v.num_outliers || v.D % 16) return out;
  const int64_t first = block * v.B * v.H + head;
  out.base = v.main + first * v.row_bytes;
  out.stride = v.H * v.row_bytes;
  if (v.kind == PLAIN && v.dtype == F32) {
    out.code = C_F32;
    return out;
  }
#ifdef KVS_SIMD
  if (!convert) return out;
  switch (v.kind) {
    case PLAIN:
      out.code = v.dtype == F16 ? C_F16 : C_BF16;
      break;
    case INT8:
    case FP8:
      out.code = v.kind == INT8 ? C_I8 : C_FP8;
      for (int j = 0; j < n; ++j) hb.rs[j] = f16_to_f32(v.scale[first + j * v.H]) * (v.kind == FP8 ? 256.0f : 1.0f);
      out.scale = hb.rs;
      break;
    case ASYM_CHANNEL: {
      const int64_t at = (block * v.H + head) * v.D;
      f16_array(v.scale + at, static_cast<int>(v.D), hb.cs);
      f16_array(v.zero + at, static_cast<int>(v.D), hb.cz);
      out.code = v.bits == 4 ? C_U4C : C_U2C;
      out.cs = hb.cs;
      out.cz = hb.cz;
      break;
    }
    default: {  // ASYM_TOKEN: a vector must not straddle two groups
      if (v.group % W) return out;
      const int64_t groups = v.D / v.group, per_block = v.B * v.H * groups;
      if (hb.gs_block != block) {
        f16_array(v.scale + block * per_block, static_cast<int>(per_block), hb.gs);
        f16_array(v.zero + block * per_block, static_cast<int>(per_block), hb.gz);
        hb.gs_block = block;
      }
      out.code = v.bits == 4 ? C_U4G : C_U2G;
      out.gs = hb.gs + head * groups;
      out.gz = hb.gz + head * groups;
      out.gstride = v.H * groups;
      out.group = v.group;
    }
  }
#else
  (void)n;
  (void)convert;
  (void)hb;
#endif
  return out;
}

// Rows [0, n) of `block`, head `head` -> float32 rows in hb.x (row stride ld), int8 / fp8
// per-token scales left to the reader (see Rows). The prefetcher is pumped every 4 rows.
inline Rows decode_block(const HalfView& v, int64_t block, int64_t head, int n, int64_t ld, HalfBuffers& hb,
                         Prefetcher& pf) {
  const int D = static_cast<int>(v.D);
  const int64_t first = block * v.B * v.H + head;  // (token 0, head) of the block
  const int64_t stride = v.H * v.row_bytes;         // bytes from one token's row to the next
  const uint8_t* row = v.main + first * v.row_bytes;
  float* buf = hb.x;
  float* rs = hb.rs;
  Rows out{reinterpret_cast<const uint8_t*>(buf), ld * 4, C_F32};
  switch (v.kind) {
    case PLAIN:
      for (int j = 0; j < n; ++j, row += stride) {
        if (j % 4 == 0) pf.pump();
        plain_row(row, v.dtype, D, buf + j * ld);
      }
      break;
    case INT8:
      for (int j = 0; j < n; ++j, row += stride) {
        if (j % 4 == 0) pf.pump();
        int8_row(reinterpret_cast<const int8_t*>(row), D, buf + j * ld);
        rs[j] = f16_to_f32(v.scale[first + j * v.H]);
      }
      break;
    case FP8:
      for (int j = 0; j < n; ++j, row += stride) {
        if (j % 4 == 0) pf.pump();
        fp8_row(row, D, buf + j * ld);
        rs[j] = f16_to_f32(v.scale[first + j * v.H]) * kFp8RowScale;
      }
      break;
    default:  // ASYM_TOKEN, ASYM_CHANNEL
      if (v.bits == 4) {
        asym_rows<4>(v, block, head, n, ld, hb, pf);
      } else {
        asym_rows<2>(v, block, head, n, ld, hb, pf);
      }
  }
  if (ld > D) {
    for (int j = 0; j < n; ++j) std::fill(buf + j * ld + D, buf + (j + 1) * ld, 0.0f);
  }
  if (folds_rows(v)) out.scale = rs;
  if (v.num_outliers == 0) return out;
  // +outN: the inner codec stored the block with its outlier channels zeroed; with +had
  // the rotation applies to the rest only, so it is undone here before the outliers go
  // back in their real channels.
  const int N = v.num_outliers;
  const uint8_t* channels = v.out_channels + (block * v.H + head) * N;
  const bool scaled = v.kind == INT8 || v.kind == FP8;
  for (int j = 0; j < n; ++j) {
    float* dst = buf + j * ld;
    if (scaled) {
      for (int d = 0; d < D; ++d) dst[d] *= rs[j];
    }
    if (v.hadamard) fwht(dst, D);
    const uint16_t* vals = v.out_values + (first + j * v.H) * N;
    for (int i = 0; i < N; ++i) {
      if (channels[i] < D) dst[channels[i]] = f16_to_f32(vals[i]);
    }
  }
  return out;
}

// Rows [0, n) of residual row `row` (an open block kept in the compute dtype) -> buf.
inline void decode_residual(const HalfView& v, int64_t row, int64_t head, int n, float* buf, int64_t ld,
                            Prefetcher& pf) {
  const int D = static_cast<int>(v.D);
  const int64_t es = dtype_size(v.residual_dtype);
  for (int j = 0; j < n; ++j) {
    float* dst = buf + j * ld;
    if (j % 4 == 0) pf.pump();
    plain_row(v.residual + ((row * v.B + j) * v.H + head) * v.D * es, v.residual_dtype, D, dst);
    for (int64_t d = D; d < ld; ++d) dst[d] = 0.0f;
    if (v.rotated) fwht(dst, D);
  }
}

}  // namespace kvs

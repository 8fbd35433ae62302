// Reading one block of one head of a half (K or V) into float32 rows, in its stored format.
//
// A block's rows land in a small buffer (block_size x ld floats, ld = head_dim rounded up
// to 8, padding zero) that stays in L1 while every query row of the tile uses it. Plain
// float32 rows are not copied at all (`direct_rows`). Layouts are those of
// kvserve/attention/layout.py; all part tensors are contiguous [num_blocks, ...].
#pragma once

#include <cstdint>

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
};

inline int64_t dtype_size(int dtype) { return dtype == F32 ? 4 : 2; }

// Plain float32 rows are read where they lie: row j of the block is base + j * ld.
inline const float* direct_rows(const HalfView& v, int64_t block, int64_t head, int64_t* ld) {
  if (v.kind != PLAIN || v.dtype != F32 || v.num_outliers || v.D % 8) return nullptr;
  *ld = v.H * v.D;
  return reinterpret_cast<const float*>(v.main) + (block * v.B * v.H + head) * v.D;
}

inline const float* direct_residual(const HalfView& v, int64_t row, int64_t head, int64_t* ld) {
  if (v.residual_dtype != F32 || v.rotated || v.D % 8) return nullptr;
  *ld = v.H * v.D;
  return reinterpret_cast<const float*>(v.residual) + (row * v.B * v.H + head) * v.D;
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
#ifdef KVS_AVX2
  if (dtype == F16) {
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, load8_f16(s + d));
  } else {
    for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, load8_bf16(s + d));
  }
#endif
  for (; d < D; ++d) dst[d] = dtype == F16 ? f16_to_f32(s[d]) : bf16_to_f32(s[d]);
}

inline void int8_row(const int8_t* c, float s, int D, float* dst) {
  int d = 0;
#ifdef KVS_AVX2
  const __m256 vs = _mm256_set1_ps(s);
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(load8_i8(c + d), vs));
#endif
  for (; d < D; ++d) dst[d] = static_cast<float>(c[d]) * s;
}

inline void fp8_row(const uint8_t* c, float s, int D, float* dst) {
  int d = 0;
#ifdef KVS_AVX2
  const __m256 vs = _mm256_set1_ps(s * 256.0f);  // exact: a power-of-two factor
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(load8_fp8_div256(c + d), vs));
#endif
  for (; d < D; ++d) dst[d] = fp8_to_f32(c[d]) * s;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

inline int code_at(const uint8_t* c, int bits, int d) {
  const int per_byte = 8 / bits;
  return (c[d / per_byte] >> ((d % per_byte) * bits)) & ((1 << bits) - 1);
}

// Packed asymmetric codes -> code * sc + zr, with per-channel sc / zr (arrays of D floats).
inline void asym_row_channels(const uint8_t* c, int bits, const float* sc, const float* zr, int D, float* dst) {
  int d = 0;
#ifdef KVS_AVX2
  const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
  if (bits == 4) {
    const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    for (; d + 8 <= D; d += 8) {
      const __m256 x = unpack8(load_u32(c + d / 2), sh, mask);
      _mm256_storeu_ps(dst + d, _mm256_fmadd_ps(x, _mm256_loadu_ps(sc + d), _mm256_loadu_ps(zr + d)));
    }
  } else {
    const __m256i sh0 = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    const __m256i sh1 = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30);
    for (; d + 16 <= D; d += 16) {
      const uint32_t w = load_u32(c + d / 4);
      _mm256_storeu_ps(dst + d, _mm256_fmadd_ps(unpack8(w, sh0, mask), _mm256_loadu_ps(sc + d),
                                                _mm256_loadu_ps(zr + d)));
      _mm256_storeu_ps(dst + d + 8, _mm256_fmadd_ps(unpack8(w, sh1, mask), _mm256_loadu_ps(sc + d + 8),
                                                    _mm256_loadu_ps(zr + d + 8)));
    }
  }
#endif
  for (; d < D; ++d) dst[d] = std::fma(static_cast<float>(code_at(c, bits, d)), sc[d], zr[d]);
}

// Packed asymmetric codes with one (scale, zero) per group of G channels, G a multiple of 8.
inline void asym_row_groups(const uint8_t* c, int bits, const uint16_t* scale, const uint16_t* zero, int G, int D,
                            float* dst) {
  int d = 0;
#ifdef KVS_AVX2
  const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
  const __m256i sh4 = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  const __m256i sh0 = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  const __m256i sh1 = _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30);
  for (int g = 0; g < D / G; ++g) {
    const __m256 vs = _mm256_set1_ps(f16_to_f32(scale[g]));
    const __m256 vz = _mm256_set1_ps(f16_to_f32(zero[g]));
    const int end = (g + 1) * G;
    if (bits == 4) {
      for (; d < end; d += 8) {
        _mm256_storeu_ps(dst + d, _mm256_fmadd_ps(unpack8(load_u32(c + d / 2), sh4, mask), vs, vz));
      }
    } else {
      for (; d + 16 <= end; d += 16) {
        const uint32_t w = load_u32(c + d / 4);
        _mm256_storeu_ps(dst + d, _mm256_fmadd_ps(unpack8(w, sh0, mask), vs, vz));
        _mm256_storeu_ps(dst + d + 8, _mm256_fmadd_ps(unpack8(w, sh1, mask), vs, vz));
      }
      for (; d < end; ++d) dst[d] = std::fma(static_cast<float>(code_at(c, bits, d)), f16_to_f32(scale[g]),
                                             f16_to_f32(zero[g]));
    }
  }
#endif
  for (; d < D; ++d) {
    dst[d] = std::fma(static_cast<float>(code_at(c, bits, d)), f16_to_f32(scale[d / G]), f16_to_f32(zero[d / G]));
  }
}

// Rows [0, n) of `block`, head `head` -> buf (row stride ld). `tmp` holds 2 * ld floats.
inline void decode_block(const HalfView& v, int64_t block, int64_t head, int n, float* buf, int64_t ld,
                         float* tmp) {
  const int D = static_cast<int>(v.D);
  const int64_t first = block * v.B * v.H + head;  // (token 0, head) of the block
  float* sc = tmp;
  float* zr = tmp + ld;
  if (v.kind == ASYM_CHANNEL) {  // one (scale, zero) per channel for the whole block
    const int64_t at = (block * v.H + head) * v.D;
    for (int d = 0; d < D; ++d) {
      sc[d] = f16_to_f32(v.scale[at + d]);
      zr[d] = f16_to_f32(v.zero[at + d]);
    }
  }
  const int64_t groups = v.kind == ASYM_TOKEN ? v.D / v.group : 0;
  for (int j = 0; j < n; ++j) {
    const int64_t th = first + j * v.H;  // (token j, head)
    const uint8_t* row = v.main + th * v.row_bytes;
    float* dst = buf + j * ld;
    switch (v.kind) {
      case PLAIN: plain_row(row, v.dtype, D, dst); break;
      case INT8: int8_row(reinterpret_cast<const int8_t*>(row), f16_to_f32(v.scale[th]), D, dst); break;
      case FP8: fp8_row(row, f16_to_f32(v.scale[th]), D, dst); break;
      case ASYM_CHANNEL: asym_row_channels(row, v.bits, sc, zr, D, dst); break;
      default:
        if (v.group % 8 == 0) {
          asym_row_groups(row, v.bits, v.scale + th * groups, v.zero + th * groups, v.group, D, dst);
        } else {
          for (int d = 0; d < D; ++d) {
            sc[d] = f16_to_f32(v.scale[th * groups + d / v.group]);
            zr[d] = f16_to_f32(v.zero[th * groups + d / v.group]);
          }
          asym_row_channels(row, v.bits, sc, zr, D, dst);
        }
    }
    for (int64_t d = D; d < ld; ++d) dst[d] = 0.0f;
  }
  if (v.num_outliers == 0) return;
  // +outN: the inner codec stored the block with its outlier channels zeroed; with +had
  // the rotation applies to the rest only, so it is undone here before the outliers go
  // back in their real channels.
  const int N = v.num_outliers;
  const uint8_t* channels = v.out_channels + (block * v.H + head) * N;
  for (int j = 0; j < n; ++j) {
    float* dst = buf + j * ld;
    if (v.hadamard) fwht(dst, D);
    const uint16_t* vals = v.out_values + (first + j * v.H) * N;
    for (int i = 0; i < N; ++i) {
      if (channels[i] < D) dst[channels[i]] = f16_to_f32(vals[i]);
    }
  }
}

// Rows [0, n) of residual row `row` (an open block kept in the compute dtype) -> buf.
inline void decode_residual(const HalfView& v, int64_t row, int64_t head, int n, float* buf, int64_t ld) {
  const int D = static_cast<int>(v.D);
  const int64_t es = dtype_size(v.residual_dtype);
  for (int j = 0; j < n; ++j) {
    float* dst = buf + j * ld;
    plain_row(v.residual + ((row * v.B + j) * v.H + head) * v.D * es, v.residual_dtype, D, dst);
    for (int64_t d = D; d < ld; ++d) dst[d] = 0.0f;
    if (v.rotated) fwht(dst, D);
  }
}

}  // namespace kvs

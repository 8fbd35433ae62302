// Quantize-on-write: a step's new keys and values of one layer stored in each half's format,
// the inverse of dequant.h, with the codes, scales and zeros the torch codecs
// (kvserve/kv/codecs/) store, bit for bit. paged_attention.cpp's `write_kv` checks the
// tensors and calls `write_layer` once per layer for both halves.
//
//   per-token halves (plain, int8, fp8, int4 / int2 per token, +had over them):
//     token t, head h --encode--> slot slots[t] of the parts
//   halves that encode whole blocks (KIVI keys per channel, +outN):
//     token t, head h --copy--> residual_slots[t] of the residual rows
//     then, once every copy is done: row encode_rows[i] --encode--> block encode_block_ids[i]
//
// Bit for bit: the arithmetic is the torch ops' own, one rounding each in float32 (true
// division, no fused multiply-add, round half to even, casts to float16 / bfloat16 / e4m3
// rounding to nearest even), reductions are min / max (exact in any order), and the
// Hadamard rotation runs the same add / subtract stages as kv/codecs/transforms.py. The
// only freedom left is the sign of a zero minimum when a group holds both +0 and -0 (torch's
// amin keeps whichever its reduction order meets): the stored zero point is then 0x0000 or
// 0x8000, and both decode alike.
//
// The halves come as the attention reads them (HalfView, checked by make_half); its pointers
// are const for the reader, and the writes here go through them to the storage's own
// tensors, which write_kv's caller hands over for writing: hence the const_casts.
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "dequant.h"

namespace kvs {

// ---- float32 -> storage types, to nearest even, as torch's casts --------------------------

inline uint32_t f32_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// IEEE half: subnormals, overflow to infinity.
inline uint16_t f32_to_f16(float f) {
#ifdef KVS_SIMD
  return static_cast<uint16_t>(_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT));
#else
  uint32_t x = f32_bits(f);
  const uint16_t sign = static_cast<uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7FFFFFFFu;
  if (x > 0x7F800000u) return sign | 0x7E00u;   // NaN
  if (x >= 0x477FF000u) return sign | 0x7C00u;  // 65520 and up round to infinity
  if (x < 0x38800000u) {
    // below 2^-14 the half grid is 2^-24, the float spacing in [0.5, 1): adding 0.5 rounds to it
    const float magic = 0.5f;
    return sign | static_cast<uint16_t>(f32_bits(bits_to_f32(x) + magic) - f32_bits(magic));
  }
  x += 0xC8000FFFu + ((x >> 13) & 1u);  // exponent bias 127 -> 15, round at bit 13
  return sign | static_cast<uint16_t>(x >> 13);
#endif
}

inline uint16_t f32_to_bf16(float f) {
  const uint32_t x = f32_bits(f);
  if ((x & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;  // NaN, as c10::BFloat16
  return static_cast<uint16_t>((x + 0x7FFFu + ((x >> 16) & 1u)) >> 16);
}

// float8 e4m3fn bits of f, |f| <= 448 (the codec clamps first).
inline uint8_t f32_to_e4m3(float f) {
  uint32_t x = f32_bits(f);
  const uint8_t sign = static_cast<uint8_t>((x >> 24) & 0x80u);
  x &= 0x7FFFFFFFu;
  if (x < (121u << 23)) {
    // below 2^-6 the e4m3 grid is 2^-9, the float spacing in [2^14, 2^15)
    const float magic = 16384.0f;
    return sign | static_cast<uint8_t>(f32_bits(bits_to_f32(x) + magic) - f32_bits(magic));
  }
  x += 0xC407FFFFu + ((x >> 20) & 1u);  // exponent bias 127 -> 7, round at bit 20
  return sign | static_cast<uint8_t>(x >> 20);
}

// ---- vector forms of the same roundings ---------------------------------------------------

#if KVS_W == 16
inline float vhmin(vf v) { return _mm512_reduce_min_ps(v); }
inline vf vdiv(vf a, vf b) { return _mm512_div_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm512_min_ps(a, b); }
inline vf vabs(vf a) { return _mm512_abs_ps(a); }
inline vf vround_even(vf a) { return _mm512_roundscale_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vwhere_positive(vf s, vf x) {  // x where s > 0, else 0
  return _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(s, _mm512_setzero_ps(), _CMP_GT_OQ), x);
}
// W integral floats in [-128, 255] -> W bytes
inline void vstore_bytes(uint8_t* p, vf v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v)));
}
inline void vstore_f16(uint16_t* p, vf v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void vstore_bf16(uint16_t* p, vf v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(0x7FFF)), odd), 16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline void vstore_e4m3(uint8_t* p, vf v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i sign = _mm512_and_si512(_mm512_srli_epi32(u, 24), _mm512_set1_epi32(0x80));
  const __m512i x = _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF));
  const __m512 magic = _mm512_set1_ps(16384.0f);
  const __m512i sub = _mm512_sub_epi32(_mm512_castps_si512(_mm512_add_ps(_mm512_castsi512_ps(x), magic)),
                                       _mm512_castps_si512(magic));
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(x, 20), _mm512_set1_epi32(1));
  const __m512i nrm =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(x, _mm512_set1_epi32(static_cast<int>(0xC407FFFFu))), odd), 20);
  const __mmask16 small = _mm512_cmplt_epi32_mask(x, _mm512_set1_epi32(121 << 23));
  const __m512i r = _mm512_or_si512(_mm512_mask_blend_epi32(small, nrm, sub), sign);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(r));
}
#elif KVS_W == 8
inline float vhmin(vf v) {
  __m128 s = _mm_min_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_min_ps(s, _mm_movehl_ps(s, s));
  s = _mm_min_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf vdiv(vf a, vf b) { return _mm256_div_ps(a, b); }
inline vf vmin(vf a, vf b) { return _mm256_min_ps(a, b); }
inline vf vabs(vf a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), a); }
inline vf vround_even(vf a) { return _mm256_round_ps(a, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline vf vwhere_positive(vf s, vf x) { return _mm256_and_ps(_mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_GT_OQ), x); }
inline __m128i narrow16(__m256i x) {  // 8 int32 -> 8 int16 (values fit)
  return _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
}
inline void vstore_bytes(uint8_t* p, vf v) {
  const __m128i w = narrow16(_mm256_cvtps_epi32(v));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
}
inline void vstore_f16(uint16_t* p, vf v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline void vstore_bf16(uint16_t* p, vf v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(0x7FFF)), odd), 16);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p),
                   _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
}
inline void vstore_e4m3(uint8_t* p, vf v) {
  const __m256i u = _mm256_castps_si256(v);
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
  const __m256i x = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFFFFFF));
  const __m256 magic = _mm256_set1_ps(16384.0f);
  const __m256i sub = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(x), magic)),
                                       _mm256_castps_si256(magic));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 20), _mm256_set1_epi32(1));
  const __m256i nrm =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(x, _mm256_set1_epi32(static_cast<int>(0xC407FFFFu))), odd), 20);
  const __m256i small = _mm256_cmpgt_epi32(_mm256_set1_epi32(121 << 23), x);
  const __m256i r = _mm256_or_si256(_mm256_blendv_epi8(nrm, sub, small), sign);
  const __m128i w = narrow16(r);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packus_epi16(w, w));
}
#endif

// ---- one row of D channels ------------------------------------------------------------------

inline float absmax(const float* x, int n) {
  int d = 0;
  float m = 0.0f;
#ifdef KVS_SIMD
  if (n >= W) {
    vf acc = vabs(vload(x));
    for (d = W; d + W <= n; d += W) acc = vmax(acc, vabs(vload(x + d)));
    m = vhmax(acc);
  }
#endif
  for (; d < n; ++d) m = std::max(m, std::fabs(x[d]));
  return m;
}

inline void minmax(const float* x, int n, float& mn, float& mx) {
  int d = 0;
  mn = x[0];
  mx = x[0];
#ifdef KVS_SIMD
  if (n >= W) {
    vf lo = vload(x), hi = lo;
    for (d = W; d + W <= n; d += W) {
      lo = vmin(lo, vload(x + d));
      hi = vmax(hi, vload(x + d));
    }
    mx = vhmax(hi);
    mn = vhmin(lo);
  }
#endif
  for (; d < n; ++d) {
    mn = std::min(mn, x[d]);
    mx = std::max(mx, x[d]);
  }
}

// float32 row -> plain storage in `dtype`.
inline void store_plain(const float* x, int dtype, int n, uint8_t* dst) {
  if (dtype == F32) {
    std::memcpy(dst, x, 4 * static_cast<size_t>(n));
    return;
  }
  uint16_t* out = reinterpret_cast<uint16_t*>(dst);
  int d = 0;
#ifdef KVS_SIMD
  if (dtype == F16) {
    for (; d + W <= n; d += W) vstore_f16(out + d, vload(x + d));
  } else {
    for (; d + W <= n; d += W) vstore_bf16(out + d, vload(x + d));
  }
#endif
  for (; d < n; ++d) out[d] = dtype == F16 ? f32_to_f16(x[d]) : f32_to_bf16(x[d]);
}

// A row stored in `from` -> `to` (the cast torch's `x.to(dtype)` makes: exact, or one rounding).
inline void convert_row(const uint8_t* src, int from, int to, int n, uint8_t* dst, float* tmp) {
  if (from == to) {
    std::memcpy(dst, src, static_cast<size_t>(n) * dtype_size(from));
    return;
  }
  plain_row(src, from, n, tmp);
  store_plain(tmp, to, n, dst);
}

// A symmetric codec's scale, fp16(absmax / qmax), stored at `scale` and returned as the float
// the codes are divided by; when it is not positive (an all-zero row) the n codes are zeroed.
inline float symmetric_scale(const float* x, int n, float qmax, uint16_t* scale, void* codes) {
  const uint16_t s16 = f32_to_f16(absmax(x, n) / qmax);
  *scale = s16;
  const float s = f16_to_f32(s16);
  if (!(s > 0.0f)) std::memset(codes, 0, static_cast<size_t>(n));
  return s;
}

// int8: s = fp16(absmax / 127), codes = clamp(round(x / s), -127, 127), 0 where s is 0.
inline void encode_int8(const float* x, int n, int8_t* codes, uint16_t* scale) {
  const float s = symmetric_scale(x, n, 127.0f, scale, codes);
  if (!(s > 0.0f)) return;
  int d = 0;
#ifdef KVS_SIMD
  const vf vs = vset1(s), lo = vset1(-127.0f), hi = vset1(127.0f);
  for (; d + W <= n; d += W) {
    const vf q = vmin(vmax(vround_even(vdiv(vload(x + d), vs)), lo), hi);
    vstore_bytes(reinterpret_cast<uint8_t*>(codes + d), q);
  }
#endif
  for (; d < n; ++d) codes[d] = static_cast<int8_t>(std::min(std::max(std::nearbyint(x[d] / s), -127.0f), 127.0f));
}

// fp8: s = fp16(absmax / 448), codes = e4m3(clamp(x / s, -448, 448)), 0 where s is 0.
inline void encode_fp8(const float* x, int n, uint8_t* codes, uint16_t* scale) {
  const float s = symmetric_scale(x, n, 448.0f, scale, codes);
  if (!(s > 0.0f)) return;
  int d = 0;
#ifdef KVS_SIMD
  const vf vs = vset1(s), lo = vset1(-448.0f), hi = vset1(448.0f);
  for (; d + W <= n; d += W) vstore_e4m3(codes + d, vmin(vmax(vdiv(vload(x + d), vs), lo), hi));
#endif
  for (; d < n; ++d) codes[d] = f32_to_e4m3(std::min(std::max(x[d] / s, -448.0f), 448.0f));
}

// q = clamp(round((x - z) / s), 0, levels) where s > 0, else 0; s and z per channel.
inline void asym_codes(const float* x, const float* s, const float* z, float levels, int n, uint8_t* q) {
  int d = 0;
#ifdef KVS_SIMD
  const vf top = vset1(levels);
  for (; d + W <= n; d += W) {
    const vf sv = vload(s + d);
    const vf c = vmin(vmax(vround_even(vdiv(vsub(vload(x + d), vload(z + d)), sv)), vzero()), top);
    vstore_bytes(q + d, vwhere_positive(sv, c));
  }
#endif
  for (; d < n; ++d) {
    q[d] = s[d] > 0.0f ? static_cast<uint8_t>(std::min(std::max(std::nearbyint((x[d] - z[d]) / s[d]), 0.0f), levels))
                       : uint8_t{0};
  }
}

// Codes of `bits` bits packed along the channels, the first channel in the lowest bits.
inline void pack_codes(const uint8_t* q, int bits, int n, uint8_t* out) {
  const int per_byte = 8 / bits;
  for (int k = 0; k < n / per_byte; ++k) {
    uint8_t b = 0;
    for (int i = 0; i < per_byte; ++i) b = static_cast<uint8_t>(b | (q[k * per_byte + i] << (i * bits)));
    out[k] = b;
  }
}

// Per-thread room for one block of one head.
struct EncodeScratch {
  std::vector<float> x;      // [B, D] rows
  std::vector<float> s, z;   // [D] per-channel scale and zero (as float32)
  std::vector<float> lo, hi;  // [D] per-channel min and max over a block (hi: |x| peaks for +outN)
  std::vector<uint8_t> q;    // [D] unpacked codes
  std::vector<uint8_t> taken;  // +outN: channels chosen so far, and which
  std::vector<int> channels;
  EncodeScratch(int64_t B, int64_t D)
      : x(static_cast<size_t>(B * D)), s(D), z(D), lo(D), hi(D), q(D), taken(D), channels(D) {}
};

// One (token, head) row, float32, into slot `slot` of a per-token layout (plain, int8, fp8,
// per-token groups); the inner codec only (+had already applied).
inline void encode_token(const HalfView& v, const float* x, int64_t slot, int64_t head, EncodeScratch& w) {
  const int D = static_cast<int>(v.D);
  const int64_t th = slot * v.H + head;  // (token, head) across the pool
  uint8_t* main = const_cast<uint8_t*>(v.main) + th * v.row_bytes;
  uint16_t* scale = const_cast<uint16_t*>(v.scale);
  switch (v.kind) {
    case PLAIN:
      store_plain(x, v.dtype, D, main);
      return;
    case INT8:
      encode_int8(x, D, reinterpret_cast<int8_t*>(main), scale + th);
      return;
    case FP8:
      encode_fp8(x, D, main, scale + th);
      return;
    default: {  // ASYM_TOKEN: groups of G channels
      const int G = v.group;
      const int groups = D / G;
      const float levels = static_cast<float>((1 << v.bits) - 1);
      uint16_t* zero = const_cast<uint16_t*>(v.zero);
      for (int g = 0; g < groups; ++g) {
        float mn, mx;
        minmax(x + g * G, G, mn, mx);
        const uint16_t s16 = f32_to_f16((mx - mn) / levels), z16 = f32_to_f16(mn);
        scale[th * groups + g] = s16;
        zero[th * groups + g] = z16;
        std::fill(w.s.begin() + g * G, w.s.begin() + (g + 1) * G, f16_to_f32(s16));
        std::fill(w.z.begin() + g * G, w.z.begin() + (g + 1) * G, f16_to_f32(z16));
      }
      asym_codes(x, w.s.data(), w.z.data(), levels, D, w.q.data());
      pack_codes(w.q.data(), v.bits, D, main);
    }
  }
}

// ---- whole blocks ---------------------------------------------------------------------------

// +outN: the N channels of largest |x| over the block's rows (ties to the lower channel, as
// the codec's stable sort), stored ascending with their float16 values, then zeroed in x.
inline void take_outliers(const HalfView& v, float* x, int64_t block, int64_t head, EncodeScratch& w) {
  const int D = static_cast<int>(v.D), B = static_cast<int>(v.B), N = v.num_outliers;
  float* peak = w.hi.data();
  for (int d = 0; d < D; ++d) peak[d] = std::fabs(x[d]);
  for (int j = 1; j < B; ++j) {
    for (int d = 0; d < D; ++d) peak[d] = std::max(peak[d], std::fabs(x[j * D + d]));
  }
  std::fill(w.taken.begin(), w.taken.end(), uint8_t{0});
  for (int i = 0; i < N; ++i) {
    int best = -1;
    for (int d = 0; d < D; ++d) {
      if (!w.taken[d] && (best < 0 || peak[d] > peak[best])) best = d;
    }
    w.taken[best] = 1;
    w.channels[i] = best;
  }
  std::sort(w.channels.begin(), w.channels.begin() + N);
  uint8_t* channels = const_cast<uint8_t*>(v.out_channels) + (block * v.H + head) * N;
  uint16_t* values = const_cast<uint16_t*>(v.out_values);
  for (int i = 0; i < N; ++i) channels[i] = static_cast<uint8_t>(w.channels[i]);
  for (int j = 0; j < B; ++j) {
    uint16_t* row = values + ((block * v.B + j) * v.H + head) * N;
    for (int i = 0; i < N; ++i) {
      float& c = x[j * D + w.channels[i]];
      row[i] = f32_to_f16(c);
      c = 0.0f;
    }
  }
}

// KIVI keys: per channel over the block's B rows, s = fp16((max - min) / L), z = fp16(min).
inline void encode_channels(const HalfView& v, const float* x, int64_t block, int64_t head, EncodeScratch& w) {
  const int D = static_cast<int>(v.D), B = static_cast<int>(v.B);
  const float levels = static_cast<float>((1 << v.bits) - 1);
  float* lo = w.lo.data();
  float* hi = w.hi.data();
  std::memcpy(lo, x, 4 * static_cast<size_t>(D));
  std::memcpy(hi, x, 4 * static_cast<size_t>(D));
  for (int j = 1; j < B; ++j) {
    const float* r = x + j * D;
    int d = 0;
#ifdef KVS_SIMD
    for (; d + W <= D; d += W) {
      vstore(lo + d, vmin(vload(lo + d), vload(r + d)));
      vstore(hi + d, vmax(vload(hi + d), vload(r + d)));
    }
#endif
    for (; d < D; ++d) {
      lo[d] = std::min(lo[d], r[d]);
      hi[d] = std::max(hi[d], r[d]);
    }
  }
  const int64_t at = (block * v.H + head) * v.D;
  uint16_t* scale = const_cast<uint16_t*>(v.scale) + at;
  uint16_t* zero = const_cast<uint16_t*>(v.zero) + at;
  for (int d = 0; d < D; ++d) {
    scale[d] = f32_to_f16((hi[d] - lo[d]) / levels);
    zero[d] = f32_to_f16(lo[d]);
    w.s[d] = f16_to_f32(scale[d]);
    w.z[d] = f16_to_f32(zero[d]);
  }
  uint8_t* main = const_cast<uint8_t*>(v.main);
  for (int j = 0; j < B; ++j) {
    asym_codes(x + j * D, w.s.data(), w.z.data(), levels, D, w.q.data());
    pack_codes(w.q.data(), v.bits, D, main + ((block * v.B + j) * v.H + head) * v.row_bytes);
  }
}

// Block `block`, head `head` of a half that encodes whole blocks, from its residual row `row`.
inline void encode_block(const HalfView& v, int64_t row, int64_t block, int64_t head, EncodeScratch& w) {
  const int D = static_cast<int>(v.D), B = static_cast<int>(v.B);
  const int64_t es = dtype_size(v.residual_dtype);
  float* x = w.x.data();
  for (int j = 0; j < B; ++j) {
    plain_row(v.residual + ((row * v.B + j) * v.H + head) * v.D * es, v.residual_dtype, D, x + j * D);
  }
  if (v.num_outliers) take_outliers(v, x, block, head, w);
  if (v.hadamard) {
    for (int j = 0; j < B; ++j) fwht(x + j * D, D);
  }
  if (v.kind == ASYM_CHANNEL) {
    encode_channels(v, x, block, head, w);
  } else {
    for (int j = 0; j < B; ++j) encode_token(v, x + j * D, block * v.B + j, head, w);
  }
}

// ---- one layer ------------------------------------------------------------------------------

inline bool encodes_whole_blocks(const HalfView& v) {
  return v.kind == ASYM_CHANNEL || v.num_outliers > 0 || v.rows_only;
}

// A [T, H, D] tensor of new keys or values, channels contiguous.
struct TokenRows {
  const uint8_t* base;
  int dtype;
  int64_t token_stride, head_stride;  // bytes
  const uint8_t* row(int64_t t, int64_t h) const { return base + t * token_stride + h * head_stride; }
};

struct LayerWrites {
  int64_t num_tokens;
  const int64_t* slots;           // [num_tokens], for per-token halves
  const int64_t* residual_slots;  // [num_tokens], for halves that encode whole blocks
  int64_t num_encodes;
  const int64_t* encode_rows;     // [num_encodes] residual rows of the blocks the step filled
  const int64_t* encode_blocks;   // [num_encodes] those blocks
};

// Below this many elements a write runs on the calling thread (a decode step's few tokens:
// waking the team would cost more than the work).
constexpr int64_t kParallelElements = 1 << 15;

// Token t, head h of one half: encoded into its slot, or copied into its residual row.
inline void write_token(const HalfView& v, const TokenRows& src, const LayerWrites& w, int64_t t, int64_t h,
                        EncodeScratch& sc) {
  const int D = static_cast<int>(v.D);
  const uint8_t* in = src.row(t, h);
  if (encodes_whole_blocks(v)) {
    const int64_t es = dtype_size(v.residual_dtype);
    uint8_t* dst = const_cast<uint8_t*>(v.residual) + (w.residual_slots[t] * v.H + h) * v.D * es;
    convert_row(in, src.dtype, v.residual_dtype, D, dst, sc.x.data());
    return;
  }
  const int64_t slot = w.slots[t];
  if (v.kind == PLAIN && v.dtype == src.dtype) {
    std::memcpy(const_cast<uint8_t*>(v.main) + (slot * v.H + h) * v.row_bytes, in, static_cast<size_t>(v.row_bytes));
    return;
  }
  float* x = sc.x.data();
  plain_row(in, src.dtype, D, x);
  if (v.hadamard) fwht(x, D);
  encode_token(v, x, slot, h, sc);
}

// Both halves of one layer: every token first (rows of open blocks included), then the
// blocks the step filled, from their rows. Items interleave the halves, so a static split of
// the items over the threads gives each thread its share of both.
inline void write_layer(const HalfView& K, const HalfView& V, const TokenRows& key, const TokenRows& value,
                        const LayerWrites& w) {
  const HalfView* halves[2] = {&K, &V};
  const TokenRows* srcs[2] = {&key, &value};
  const HalfView* whole[2] = {nullptr, nullptr};  // the halves that encode whole blocks
  int num_whole = 0;
  for (const HalfView* v : halves) {
    if (encodes_whole_blocks(*v)) whole[num_whole++] = v;
  }
  const int64_t H = K.H, B = K.B, D = K.D;
  const int64_t token_items = 2 * w.num_tokens * H;          // (token, head, half)
  const int64_t block_items = num_whole * w.num_encodes * H;  // (block, head, half)
  const bool parallel = (token_items + block_items * B) * D >= kParallelElements && omp_get_max_threads() > 1;
#pragma omp parallel if (parallel)
  {
    EncodeScratch sc(B, D);
#pragma omp for schedule(static)
    for (int64_t i = 0; i < token_items; ++i) {
      const int half = static_cast<int>(i % 2);
      const int64_t th = i / 2;
      write_token(*halves[half], *srcs[half], w, th / H, th % H, sc);
    }
    // (the implicit barrier above: every residual row holds its tokens before blocks are encoded)
#pragma omp for schedule(static)
    for (int64_t i = 0; i < block_items; ++i) {
      const int64_t eh = i / num_whole;
      encode_block(*whole[i % num_whole], w.encode_rows[eh / H], w.encode_blocks[eh / H], eh % H, sc);
    }
  }
}

}  // namespace kvs

// Scalar conversions and the few vector primitives the kernel is built from.
//
// One vector type `vf` of W float lanes: W = 16 with AVX-512 (F, BW, VL, DQ), W = 8 with
// AVX2 + FMA + F16C, chosen by the compiler flags (see kvserve/extensions.py: the build matches
// what this CPU runs). Without either, KVS_SIMD is undefined and the kernel's scalar loops
// are the whole implementation. Scalar helpers below serve every build (and vector tails).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__FMA__) && defined(__F16C__)
#define KVS_SIMD 1
#define KVS_W 16
#include <immintrin.h>
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVS_SIMD 1
#define KVS_W 8
#include <immintrin.h>
#else
#define KVS_W 1
#endif

namespace kvs {

constexpr int W = KVS_W;  // float lanes per vector
constexpr float kLog2e = 1.4426950408889634f;

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint32_t load_u32(const uint8_t* p) {
  uint32_t w;
  std::memcpy(&w, p, 4);
  return w;
}

// IEEE half -> float, exact (subnormals, inf, nan included).
inline float f16_to_f32(uint16_t h) {
#ifdef KVS_SIMD
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  if (exp == 0) {  // zero or subnormal: man * 2^-24
    const float v = static_cast<float>(man) * 5.9604644775390625e-08f;
    return sign ? -v : v;
  }
  if (exp == 31) return bits_to_f32(sign | 0x7F800000u | (man << 13));
  return bits_to_f32(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

inline float bf16_to_f32(uint16_t b) { return bits_to_f32(static_cast<uint32_t>(b) << 16); }

// float8 e4m3fn bits -> float: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities,
// S.1111.111 is NaN; exponent 0 holds the subnormals m * 2^-9.
inline float fp8_to_f32(uint8_t x) {
  const uint32_t exp = (x >> 3) & 0xFu;
  const uint32_t man = x & 0x7u;
  float v;
  if (exp == 0xFu && man == 0x7u) {
    v = NAN;
  } else if (exp == 0) {
    v = static_cast<float>(man) * 0.001953125f;
  } else {
    v = bits_to_f32(((exp + 120u) << 23) | (man << 20));
  }
  return (x & 0x80u) ? -v : v;
}

// In-place orthonormal fast Walsh-Hadamard transform of n floats (n a power of two), the
// same add/subtract stages and final 1/sqrt(n) scaling as kv/codecs/transforms.py. `fwht`
// (below) runs the stages in vectors where it can, with the same sums.
inline void fwht_scalar(float* x, int n) {
  for (int h = 1; h < n; h *= 2) {
    for (int i = 0; i < n; i += 2 * h) {
      for (int k = i; k < i + h; ++k) {
        const float a = x[k], b = x[k + h];
        x[k] = a + b;
        x[k + h] = a - b;
      }
    }
  }
  const float s = static_cast<float>(1.0 / std::sqrt(static_cast<double>(n)));
  for (int k = 0; k < n; ++k) x[k] *= s;
}

#ifdef KVS_SIMD
// ---- 8-lane helpers (both builds use them for groups of 8 keys) ----
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane k of the result is the sum of the lanes of a[k]: eight dot products finished at once.
inline __m256 transpose_sum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // [s0 s1 s2 s3 | s0' s1' s2' s3'] (low / high halves)
  const __m256 u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// Lane k of the result is the sum of the lanes of a[k], for four vectors.
inline __m128 transpose_sum4(const __m256* a) {
  const __m256 u = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(u), _mm256_extractf128_ps(u, 1));
}

// Eight e4m3 codes as halves worth code / 256: the 7 exponent+mantissa bits move to a
// half's bits 7..13 (exponent bias 15 instead of 7; subnormals map to subnormals, which
// F16C converts exactly). NaN codes are not produced by the codec (it clamps to +-448).
inline __m128i fp8x8_as_f16(__m128i bytes) {
  const __m128i b = _mm_cvtepu8_epi16(bytes);
  const __m128i sign = _mm_and_si128(_mm_slli_epi16(b, 8), _mm_set1_epi16(static_cast<short>(0x8000)));
  return _mm_or_si128(sign, _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(0x3F80)));
}
#endif

#if KVS_W == 16
using vf = __m512;
inline vf vzero() { return _mm512_setzero_ps(); }
inline vf vset1(float x) { return _mm512_set1_ps(x); }
inline vf vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm512_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm512_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm512_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm512_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm512_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm512_max_ps(a, b); }
inline bool vany_gt(vf a, vf b) { return _mm512_cmp_ps_mask(a, b, _CMP_GT_OQ) != 0; }
inline bool vany_nan(vf a) { return _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q) != 0; }
inline float vhsum(vf v) { return _mm512_reduce_add_ps(v); }
inline float vhmax(vf v) { return _mm512_reduce_max_ps(v); }
inline vf vload_f16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
inline vf vload_bf16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
inline vf vload_i8(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline vf vload_fp8_div256(const uint8_t* p) {  // as fp8x8_as_f16, 16 at a time
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i sign = _mm256_and_si256(_mm256_slli_epi16(b, 8), _mm256_set1_epi16(static_cast<short>(0x8000)));
  // (b << 7) & 0x3F80 | sign in one ternary-logic op: (A & C) | B
  const __m256i h = _mm256_ternarylogic_epi32(_mm256_slli_epi16(b, 7), sign, _mm256_set1_epi16(0x3F80), 0xEC);
  return _mm512_cvtph_ps(h);
}
// 16 channels of 4-bit codes from 8 bytes (lowest nibble first).
#ifdef __AVX512VBMI__
// With VBMI: the 8 bytes in every 64-bit lane, and one multishift puts nibble k (bits 4k..)
// in the low byte of 32-bit lane k.
inline vf vload_u4(const uint8_t* p) {
  uint64_t word;
  std::memcpy(&word, p, 8);
  const __m512i w = _mm512_set1_epi64(static_cast<long long>(word));
  const __m512i ctrl = _mm512_set_epi64(0x3C3C3C3C38383838LL, 0x3434343430303030LL, 0x2C2C2C2C28282828LL,
                                        0x2424242420202020LL, 0x1C1C1C1C18181818LL, 0x1414141410101010LL,
                                        0x0C0C0C0C08080808LL, 0x0404040400000000LL);
  const __m512i x = _mm512_multishift_epi64_epi8(ctrl, w);
  return _mm512_cvtepi32_ps(_mm512_and_si512(x, _mm512_set1_epi32(15)));
}
#else
inline vf vload_u4(const uint8_t* p) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m128i twice = _mm_shuffle_epi8(b, _mm_setr_epi8(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7));
  const __m512i w = _mm512_cvtepu8_epi32(twice);
  const __m512i sh = _mm512_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4, 0, 4);
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(w, sh), _mm512_set1_epi32(15)));
}
#endif
// 16 channels of 2-bit codes from 4 bytes.
inline vf vload_u2(const uint8_t* p) {
  const __m512i w = _mm512_set1_epi32(static_cast<int>(load_u32(p)));
  const __m512i sh = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
  return _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srlv_epi32(w, sh), _mm512_set1_epi32(3)));
}
// Fold a 16-lane partial sum to 8 lanes (same total).
inline __m256 fold8(vf v) { return _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1)); }
#elif KVS_W == 8
using vf = __m256;
inline vf vzero() { return _mm256_setzero_ps(); }
inline vf vset1(float x) { return _mm256_set1_ps(x); }
inline vf vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vf v) { _mm256_storeu_ps(p, v); }
inline vf vfma(vf a, vf b, vf c) { return _mm256_fmadd_ps(a, b, c); }
inline vf vmul(vf a, vf b) { return _mm256_mul_ps(a, b); }
inline vf vadd(vf a, vf b) { return _mm256_add_ps(a, b); }
inline vf vsub(vf a, vf b) { return _mm256_sub_ps(a, b); }
inline vf vmax(vf a, vf b) { return _mm256_max_ps(a, b); }
inline bool vany_gt(vf a, vf b) { return _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)) != 0; }
inline bool vany_nan(vf a) { return _mm256_movemask_ps(_mm256_cmp_ps(a, a, _CMP_UNORD_Q)) != 0; }
inline float vhsum(vf v) { return hsum8(v); }
inline float vhmax(vf v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vf vload_f16(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline vf vload_bf16(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}
inline vf vload_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline vf vload_fp8_div256(const uint8_t* p) {
  return _mm256_cvtph_ps(fp8x8_as_f16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
// 8 channels of 4-bit codes from 4 bytes (lowest nibble first).
inline vf vload_u4(const uint8_t* p) {
  const __m256i w = _mm256_set1_epi32(static_cast<int>(load_u32(p)));
  const __m256i sh = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, sh), _mm256_set1_epi32(15)));
}
// 8 channels of 2-bit codes: the first (`upper` false) or the second 8 of the 16 the 32-bit
// word at p holds. The whole word is broadcast straight from memory, one load, where 16 bits
// would pass through a general register first (three operations, one of them a shuffle).
inline vf vload_u2(const uint8_t* p, bool upper) {
  const __m256i w = _mm256_set1_epi32(static_cast<int>(load_u32(p)));
  const __m256i sh = upper ? _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30)
                           : _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, sh), _mm256_set1_epi32(3)));
}
// The same from the 2 bytes at p alone (a row's last 8 channels where its width is not a
// multiple of 16: a word would read past the row).
inline vf vload_u2_short(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  const __m256i w = _mm256_set1_epi32(h);
  const __m256i sh = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, sh), _mm256_set1_epi32(3)));
}
inline __m256 fold8(vf v) { return v; }
#endif

#ifdef KVS_SIMD
// 2^x for x <= 0 (log2-domain softmax weights): x = n + f, |f| <= 1/2, 2^f by its Taylor
// series in f*ln2 to degree 7 (relative error < 1e-8, below float rounding), 2^n from the
// exponent bits. x < -126 gives exactly 0 (and -inf does too).
inline vf vexp2_neg(vf x) {
  const vf lo = vset1(-126.0f);
#if KVS_W == 16
  const __mmask16 ok = _mm512_cmp_ps_mask(x, lo, _CMP_GE_OQ);
  x = _mm512_max_ps(x, lo);
  const vf n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#else
  const vf ok = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
  x = _mm256_max_ps(x, lo);
  const vf n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  const vf t = vmul(vsub(x, n), vset1(0.6931471805599453f));
  vf p = vset1(1.0f / 5040.0f);
  p = vfma(p, t, vset1(1.0f / 720.0f));
  p = vfma(p, t, vset1(1.0f / 120.0f));
  p = vfma(p, t, vset1(1.0f / 24.0f));
  p = vfma(p, t, vset1(1.0f / 6.0f));
  p = vfma(p, t, vset1(0.5f));
  p = vfma(p, t, vset1(1.0f));
  p = vfma(p, t, vset1(1.0f));
#if KVS_W == 16
  const __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_maskz_mul_ps(ok, p, _mm512_castsi512_ps(e));
#else
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(ok, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
#endif
}
#endif

#ifdef KVS_SIMD
// Lane l of v replaced by lane l ^ h (h < W, a power of two), and the butterfly's sign: +1 in
// the lanes whose bit h is clear (they take a + b), -1 where it is set (a - b).
#if KVS_W == 16
inline vf vswap_lanes(vf v, int h) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_permutexvar_ps(_mm512_xor_si512(lane, _mm512_set1_epi32(h)), v);
}
inline vf vbutterfly_sign(int h) {
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_mask_blend_ps(_mm512_test_epi32_mask(lane, _mm512_set1_epi32(h)), vset1(1.0f), vset1(-1.0f));
}
#else
inline vf vswap_lanes(vf v, int h) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_permutevar8x32_ps(v, _mm256_xor_si256(lane, _mm256_set1_epi32(h)));
}
inline vf vbutterfly_sign(int h) {
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i clear = _mm256_cmpeq_epi32(_mm256_and_si256(lane, _mm256_set1_epi32(h)), _mm256_setzero_si256());
  return _mm256_blendv_ps(vset1(-1.0f), vset1(1.0f), _mm256_castsi256_ps(clear));
}
#endif
#endif

// fwht_scalar's transform, bit for bit: the stages of stride h < W inside each vector (lane l
// takes lane l ^ h: x[l] + x[l ^ h] where bit h of l is clear, x[l ^ h] - x[l] where it is set;
// times +-1 and one rounded add, the scalar sums exactly), the wider ones between vectors.
inline void fwht(float* x, int n) {
#ifdef KVS_SIMD
  if (n >= W && n % W == 0) {
    for (int i = 0; i < n; i += W) {
      vf v = vload(x + i);
      for (int h = 1; h < W; h *= 2) v = vfma(v, vbutterfly_sign(h), vswap_lanes(v, h));
      vstore(x + i, v);
    }
    for (int h = W; h < n; h *= 2) {
      for (int i = 0; i < n; i += 2 * h) {
        for (int k = i; k < i + h; k += W) {
          const vf a = vload(x + k), b = vload(x + k + h);
          vstore(x + k, vadd(a, b));
          vstore(x + k + h, vsub(a, b));
        }
      }
    }
    const vf s = vset1(static_cast<float>(1.0 / std::sqrt(static_cast<double>(n))));
    for (int k = 0; k < n; k += W) vstore(x + k, vmul(vload(x + k), s));
    return;
  }
#endif
  fwht_scalar(x, n);
}

}  // namespace kvs

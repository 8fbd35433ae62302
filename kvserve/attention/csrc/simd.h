// Scalar conversions and the few vector primitives the kernel is built from.
//
// Built with -mavx2 -mfma -mf16c when the CPU has them (KVS_AVX2 is then defined by the
// compiler flags' __AVX2__/__FMA__/__F16C__); every function has a portable scalar
// version, used by the fallback build and for the tails of vector loops.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KVS_AVX2 1
#include <immintrin.h>
#endif

namespace kvs {

constexpr float kLog2e = 1.4426950408889634f;

inline float bits_to_f32(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// IEEE half -> float, exact (subnormals, inf, nan included).
inline float f16_to_f32(uint16_t h) {
#ifdef KVS_AVX2
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
// same add/subtract stages and final 1/sqrt(n) scaling as kv/codecs/transforms.py.
inline void fwht(float* x, int n) {
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

#ifdef KVS_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Lane k of the result is the sum of the lanes of a[k]: eight dot products finished at once.
inline __m256 hsum8(const __m256* a) {
  const __m256 t0 = _mm256_hadd_ps(a[0], a[1]);
  const __m256 t1 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 t2 = _mm256_hadd_ps(a[4], a[5]);
  const __m256 t3 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1);  // [s0 s1 s2 s3 | s0' s1' s2' s3'] (low / high halves)
  const __m256 u1 = _mm256_hadd_ps(t2, t3);
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// 2^x for x <= 0 (log2-domain softmax weights): x = n + f, |f| <= 1/2, 2^f by its Taylor
// series in f*ln2 to degree 7 (relative error < 1e-8, below float rounding), 2^n from the
// exponent bits. x < -126 gives exactly 0 (and -inf does too).
inline __m256 exp2_neg(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-126.0f);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_max_ps(x, lo);
  const __m256 n = _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 t = _mm256_mul_ps(_mm256_sub_ps(x, n), _mm256_set1_ps(0.6931471805599453f));
  __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.0f / 720.0f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.0f / 120.0f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.0f / 24.0f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.0f / 6.0f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, t, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}

inline __m256 load8_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline __m256 load8_bf16(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

inline __m256 load8_i8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

// Eight e4m3 codes -> float / 256: the 7 exponent+mantissa bits are moved to a half's
// bits 7..13 (a half with exponent bias 15 instead of 7, subnormals included, which
// F16C converts exactly); the caller multiplies by 256 * scale. NaN codes are not
// produced by the codec (it clamps to +-448) and are not special-cased here.
inline __m256 load8_fp8_div256(const uint8_t* p) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i sign = _mm_and_si128(_mm_slli_epi16(b, 8), _mm_set1_epi16(static_cast<short>(0x8000)));
  const __m128i body = _mm_and_si128(_mm_slli_epi16(b, 7), _mm_set1_epi16(0x3F80));
  return _mm256_cvtph_ps(_mm_or_si128(sign, body));
}

// Codes of 4 or 2 bits packed lowest-first: the 32 bits at p hold 8 (4-bit) or 16
// (2-bit) consecutive channels; `shift` selects each lane's field.
inline __m256 unpack8(uint32_t word, __m256i shift, __m256i mask) {
  const __m256i w = _mm256_set1_epi32(static_cast<int>(word));
  return _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srlv_epi32(w, shift), mask));
}
#endif

}  // namespace kvs

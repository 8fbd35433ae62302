// Sixteen lanes, one per output row of a weight tile, in whatever this build's registers are.
//
// The kernel (qkernel.h) is written once against these types: with AVX-512 + VNNI each is
// one 512-bit register; with AVX2 a pair of 256-bit ones; in the scalar build, arrays. All
// three give the same integer dot products; the float steps run in the same order (fused
// multiply-adds everywhere), so results differ between builds only where a horizontal sum
// (the activation's block sums) is taken in another order.
//
// Codes: 64 bytes, lane n holding 4 consecutive codes of row n (bytes 4n .. 4n+3): the
// operand layout of VNNI's vpdpbusd, so one instruction adds 4 products to each lane.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#include "simd.h"

namespace kvs {
namespace q {

// GELU's tanh form: x/2 (1 + tanh(kGeluC (x + kGeluA x^3)))
constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2 / pi)
constexpr float kGeluA = 0.044715f;

inline int32_t load_i32(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

#if defined(__AVX512VNNI__) && KVS_W == 16
#define KVS_Q_VNNI 1
struct I16 { __m512i v; };
struct F16 { __m512 v; };
struct Codes { __m512i v; };

inline I16 izero() { return {_mm512_setzero_si512()}; }
inline F16 fzero() { return {_mm512_setzero_ps()}; }
inline F16 fset1(float x) { return {_mm512_set1_ps(x)}; }
inline Codes load_codes(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline void store_codes(uint8_t* p, Codes c) { _mm512_storeu_si512(p, c.v); }
inline Codes low_nibbles(Codes c) { return {_mm512_and_si512(c.v, _mm512_set1_epi8(0x0F))}; }
inline Codes high_nibbles(Codes c) { return {_mm512_and_si512(_mm512_srli_epi16(c.v, 4), _mm512_set1_epi8(0x0F))}; }
// bits 4 and 5 of every byte from bits (2s, 2s+1) of h: Q6_K's high bits above its low nibble
template <int S>
inline Codes with_high2(Codes lo, Codes h) {
  __m512i x = S == 0 ? _mm512_slli_epi16(h.v, 4) : S == 1 ? _mm512_slli_epi16(h.v, 2) : S == 2 ? h.v : _mm512_srli_epi16(h.v, 2);
  return {_mm512_or_si512(lo.v, _mm512_and_si512(x, _mm512_set1_epi8(0x30)))};
}
// bit 4 of every byte from bit S of h: a 5-bit code's fifth bit above its low nibble (the
// 16-bit shifts move no bit across a byte into bit 4); lo | (x & 0x10) in one ternary op
template <int S>
inline Codes with_high1(Codes lo, Codes h) {
  const __m512i x = S < 4 ? _mm512_slli_epi16(h.v, 4 - S) : S == 4 ? h.v : _mm512_srli_epi16(h.v, S - 4);
  return {_mm512_ternarylogic_epi32(lo.v, x, _mm512_set1_epi8(0x10), 0xF8)};
}
// acc + per lane sum over its 4 bytes of code (unsigned) x a4 (4 signed bytes, the same for every lane)
inline I16 dot4_u(I16 acc, Codes w, int32_t a4) { return {_mm512_dpbusd_epi32(acc.v, w.v, _mm512_set1_epi32(a4))}; }
// the same for signed codes: VNNI multiplies unsigned by signed, so the codes are offset by
// 128 (x ^ 0x80) and 128 x sum(a) is taken off once per block by the caller (dot_s8)
inline I16 dot4_s(I16 acc, Codes w, int32_t a4) {
  return {_mm512_dpbusd_epi32(acc.v, _mm512_xor_si512(w.v, _mm512_set1_epi8(static_cast<char>(0x80))), _mm512_set1_epi32(a4))};
}
constexpr int kSignedOffset = 128;
// A half block's products before they are widened (see Part below): VNNI's are int32 already.
using Part = I16;
inline Part pzero() { return izero(); }
inline Part pdot(Part acc, Codes w, int32_t a4) { return dot4_u(acc, w, a4); }
inline I16 widen(Part p) { return p; }
inline I16 iadd(I16 a, I16 b) { return {_mm512_add_epi32(a.v, b.v)}; }
inline I16 isub_scalar(I16 a, int32_t x) { return {_mm512_sub_epi32(a.v, _mm512_set1_epi32(x))}; }
inline I16 imul(I16 a, I16 b) { return {_mm512_mullo_epi32(a.v, b.v)}; }
inline F16 to_float(I16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
inline F16 fmul(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 fadd(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F16 ffma(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F16 fneg(F16 a) { return {_mm512_sub_ps(_mm512_setzero_ps(), a.v)}; }
inline F16 load_f32(const float* p) { return {_mm512_loadu_ps(p)}; }
inline F16 load_f16(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline F16 load_u8f(const uint8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline I16 load_s8i(const int8_t* p) { return {_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))}; }
inline void store_f32(float* p, F16 a, int n) {
  if (n == 16) _mm512_storeu_ps(p, a.v);
  else _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), a.v);
}
inline void add_store_f32(float* p, F16 a, int n) {
  const __mmask16 m = static_cast<__mmask16>(n == 16 ? 0xFFFFu : (1u << n) - 1);
  _mm512_mask_storeu_ps(p, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, p), a.v));
}

inline F16 fabs16(F16 a) { return {_mm512_abs_ps(a.v)}; }
inline F16 fmax16(F16 a, F16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float hsum(F16 a) { return _mm512_reduce_add_ps(a.v); }
inline float hmax(F16 a) { return _mm512_reduce_max_ps(a.v); }
inline void store_f32_all(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
// round(a x id) to int8 (nearest, ties to even), stored at p; returns the sum of the 16 codes
inline int32_t quantize16(F16 a, float id, int8_t* p) {
  const __m512i i = _mm512_cvtps_epi32(_mm512_mul_ps(a.v, _mm512_set1_ps(id)));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtsepi32_epi8(i));
  return _mm512_reduce_add_epi32(i);
}
// x sigmoid(x) = x / (1 + e^-x), with e^-|x| from the kernel's exp2 (never overflows)
inline F16 silu16(F16 x) {
  const __m512 e = vexp2_neg(_mm512_mul_ps(_mm512_abs_ps(x.v), _mm512_set1_ps(-kLog2e)));
  const __m512 one = _mm512_set1_ps(1.0f);
  const __mmask16 neg = _mm512_cmp_ps_mask(x.v, _mm512_setzero_ps(), _CMP_LT_OQ);
  const __m512 num = _mm512_mask_mov_ps(one, neg, e);
  return {_mm512_mul_ps(x.v, _mm512_div_ps(num, _mm512_add_ps(one, e)))};
}
// GELU, tanh form: x/2 (1 + tanh(z)), z = sqrt(2/pi) (x + 0.044715 x^3); tanh(|z|) = (1 - e) / (1 + e)
// with e = e^-2|z| from the kernel's exp2, signed as z
inline F16 gelu_tanh16(F16 x) {
  const __m512 z = _mm512_mul_ps(_mm512_set1_ps(kGeluC), _mm512_fmadd_ps(_mm512_set1_ps(kGeluA),
                                                                         _mm512_mul_ps(x.v, _mm512_mul_ps(x.v, x.v)), x.v));
  const __m512 e = vexp2_neg(_mm512_mul_ps(_mm512_abs_ps(z), _mm512_set1_ps(-2.0f * kLog2e)));
  const __m512 one = _mm512_set1_ps(1.0f);
  __m512 t = _mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e));
  t = _mm512_mask_sub_ps(t, _mm512_cmp_ps_mask(z, _mm512_setzero_ps(), _CMP_LT_OQ), _mm512_setzero_ps(), t);
  return {_mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(0.5f), x.v), _mm512_add_ps(one, t))};
}

#elif KVS_W == 8
struct I16 { __m256i lo, hi; };
struct F16 { __m256 lo, hi; };
struct Codes { __m256i lo, hi; };

inline I16 izero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline F16 fzero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 fset1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline Codes load_codes(const uint8_t* p) {
  return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32))};
}
inline void store_codes(uint8_t* p, Codes c) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), c.lo);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32), c.hi);
}
inline Codes low_nibbles(Codes c) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(c.lo, m), _mm256_and_si256(c.hi, m)};
}
inline Codes high_nibbles(Codes c) {
  const __m256i m = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(_mm256_srli_epi16(c.lo, 4), m), _mm256_and_si256(_mm256_srli_epi16(c.hi, 4), m)};
}
template <int S>
inline __m256i high2_half(__m256i lo, __m256i h) {
  __m256i x = S == 0 ? _mm256_slli_epi16(h, 4) : S == 1 ? _mm256_slli_epi16(h, 2) : S == 2 ? h : _mm256_srli_epi16(h, 2);
  return _mm256_or_si256(lo, _mm256_and_si256(x, _mm256_set1_epi8(0x30)));
}
template <int S>
inline Codes with_high2(Codes lo, Codes h) { return {high2_half<S>(lo.lo, h.lo), high2_half<S>(lo.hi, h.hi)}; }
template <int S>
inline __m256i high1_half(__m256i lo, __m256i h) {
  const __m256i x = S < 4 ? _mm256_slli_epi16(h, 4 - S) : S == 4 ? h : _mm256_srli_epi16(h, S - 4);
  return _mm256_or_si256(lo, _mm256_and_si256(x, _mm256_set1_epi8(0x10)));
}
template <int S>
inline Codes with_high1(Codes lo, Codes h) { return {high1_half<S>(lo.lo, h.lo), high1_half<S>(lo.hi, h.hi)}; }
// maddubs adds pairs of u8 x s8 products into int16 (saturating: codes stay below 64 here,
// so |sum| <= 2 x 63 x 128), madd with ones adds the pairs into the lane's int32
inline __m256i dot4_half(__m256i w, __m256i a) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1));
}
inline I16 dot4_u(I16 acc, Codes w, int32_t a4) {
  const __m256i a = _mm256_set1_epi32(a4);
  return {_mm256_add_epi32(acc.lo, dot4_half(w.lo, a)), _mm256_add_epi32(acc.hi, dot4_half(w.hi, a))};
}
// signed codes: |w| x (a with w's sign), so no pair of products can saturate (127 x 127 x 2)
inline I16 dot4_s(I16 acc, Codes w, int32_t a4) {
  const __m256i a = _mm256_set1_epi32(a4);
  return {_mm256_add_epi32(acc.lo, dot4_half(_mm256_abs_epi8(w.lo), _mm256_sign_epi8(a, w.lo))),
          _mm256_add_epi32(acc.hi, dot4_half(_mm256_abs_epi8(w.hi), _mm256_sign_epi8(a, w.hi)))};
}
// Products of unsigned codes summed as maddubs leaves them, int16 pairs per lane, and widened
// to int32 once for several (one madd instead of one each). The caller bounds the sum: with
// activation codes |a| <= 128, four pairs of 5-bit codes (4 x 2 x 31 x 128) or two of 6-bit
// codes stay under 2^15, so the result is exact, the same integers as widening each.
struct Part { __m256i lo, hi; };
inline Part pzero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline Part pdot(Part acc, Codes w, int32_t a4) {
  const __m256i a = _mm256_set1_epi32(a4);
  return {_mm256_add_epi16(acc.lo, _mm256_maddubs_epi16(w.lo, a)), _mm256_add_epi16(acc.hi, _mm256_maddubs_epi16(w.hi, a))};
}
inline I16 widen(Part p) {
  const __m256i one = _mm256_set1_epi16(1);
  return {_mm256_madd_epi16(p.lo, one), _mm256_madd_epi16(p.hi, one)};
}
constexpr int kSignedOffset = 0;
inline I16 iadd(I16 a, I16 b) { return {_mm256_add_epi32(a.lo, b.lo), _mm256_add_epi32(a.hi, b.hi)}; }
inline I16 isub_scalar(I16 a, int32_t x) {
  const __m256i v = _mm256_set1_epi32(x);
  return {_mm256_sub_epi32(a.lo, v), _mm256_sub_epi32(a.hi, v)};
}
inline I16 imul(I16 a, I16 b) { return {_mm256_mullo_epi32(a.lo, b.lo), _mm256_mullo_epi32(a.hi, b.hi)}; }
inline F16 to_float(I16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline F16 fmul(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 fadd(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F16 ffma(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 fneg(F16 a) {
  const __m256 z = _mm256_setzero_ps();
  return {_mm256_sub_ps(z, a.lo), _mm256_sub_ps(z, a.hi)};
}
inline F16 load_f32(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline F16 load_f16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline F16 load_u8f(const uint8_t* p) {
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))),
          _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8))))};
}
inline I16 load_s8i(const int8_t* p) {
  return {_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void store_f32(float* p, F16 a, int n) {
  alignas(32) float t[16];
  _mm256_store_ps(t, a.lo);
  _mm256_store_ps(t + 8, a.hi);
  std::memcpy(p, t, sizeof(float) * n);
}
inline void add_store_f32(float* p, F16 a, int n) {
  alignas(32) float t[16];
  _mm256_store_ps(t, a.lo);
  _mm256_store_ps(t + 8, a.hi);
  for (int i = 0; i < n; ++i) p[i] += t[i];
}

inline F16 fabs16(F16 a) {
  const __m256 m = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  return {_mm256_and_ps(a.lo, m), _mm256_and_ps(a.hi, m)};
}
inline F16 fmax16(F16 a, F16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float hsum(F16 a) { return hsum8(_mm256_add_ps(a.lo, a.hi)); }
inline float hmax(F16 a) {
  const __m256 v = _mm256_max_ps(a.lo, a.hi);
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline void store_f32_all(float* p, F16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline int32_t quantize16(F16 a, float id, int8_t* p) {
  const __m256 s = _mm256_set1_ps(id);
  const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(a.lo, s));
  const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(a.hi, s));
  alignas(32) int32_t t[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(t), lo);
  _mm256_store_si256(reinterpret_cast<__m256i*>(t + 8), hi);
  int32_t sum = 0;
  for (int i = 0; i < 16; ++i) {
    const int32_t v = t[i] > 127 ? 127 : t[i] < -128 ? -128 : t[i];
    p[i] = static_cast<int8_t>(v);
    sum += v;
  }
  return sum;
}
inline __m256 silu8(__m256 x) {
  const __m256 ax = _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  const __m256 e = vexp2_neg(_mm256_mul_ps(ax, _mm256_set1_ps(-kLog2e)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 num = _mm256_blendv_ps(one, e, _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ));
  return _mm256_mul_ps(x, _mm256_div_ps(num, _mm256_add_ps(one, e)));
}
inline F16 silu16(F16 x) { return {silu8(x.lo), silu8(x.hi)}; }
inline __m256 gelu_tanh8(__m256 x) {
  const __m256 z = _mm256_mul_ps(_mm256_set1_ps(kGeluC), _mm256_fmadd_ps(_mm256_set1_ps(kGeluA),
                                                                         _mm256_mul_ps(x, _mm256_mul_ps(x, x)), x));
  const __m256 az = _mm256_and_ps(z, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF)));
  const __m256 e = vexp2_neg(_mm256_mul_ps(az, _mm256_set1_ps(-2.0f * kLog2e)));
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
  const __m256 signed_t = _mm256_blendv_ps(t, _mm256_sub_ps(_mm256_setzero_ps(), t),
                                           _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ));
  return _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(0.5f), x), _mm256_add_ps(one, signed_t));
}
inline F16 gelu_tanh16(F16 x) { return {gelu_tanh8(x.lo), gelu_tanh8(x.hi)}; }

#else
struct I16 { int32_t v[16]; };
struct F16 { float v[16]; };
struct Codes { uint8_t v[64]; };

inline I16 izero() { return I16{}; }
inline F16 fzero() { return F16{}; }
inline F16 fset1(float x) {
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = x;
  return r;
}
inline Codes load_codes(const uint8_t* p) {
  Codes c;
  std::memcpy(c.v, p, 64);
  return c;
}
inline void store_codes(uint8_t* p, Codes c) { std::memcpy(p, c.v, 64); }
inline Codes low_nibbles(Codes c) {
  for (auto& b : c.v) b &= 0x0F;
  return c;
}
inline Codes high_nibbles(Codes c) {
  for (auto& b : c.v) b = static_cast<uint8_t>(b >> 4);
  return c;
}
template <int S>
inline Codes with_high2(Codes lo, Codes h) {
  for (int i = 0; i < 64; ++i) lo.v[i] = static_cast<uint8_t>(lo.v[i] | (((h.v[i] >> (2 * S)) & 3) << 4));
  return lo;
}
template <int S>
inline Codes with_high1(Codes lo, Codes h) {
  for (int i = 0; i < 64; ++i) lo.v[i] = static_cast<uint8_t>(lo.v[i] | (((h.v[i] >> S) & 1) << 4));
  return lo;
}
inline I16 dot4_u(I16 acc, Codes w, int32_t a4) {
  int8_t a[4];
  std::memcpy(a, &a4, 4);
  for (int n = 0; n < 16; ++n)
    for (int i = 0; i < 4; ++i) acc.v[n] += static_cast<int32_t>(w.v[4 * n + i]) * a[i];
  return acc;
}
inline I16 dot4_s(I16 acc, Codes w, int32_t a4) {
  int8_t a[4];
  std::memcpy(a, &a4, 4);
  for (int n = 0; n < 16; ++n)
    for (int i = 0; i < 4; ++i) acc.v[n] += static_cast<int32_t>(static_cast<int8_t>(w.v[4 * n + i])) * a[i];
  return acc;
}
using Part = I16;
inline Part pzero() { return izero(); }
inline Part pdot(Part acc, Codes w, int32_t a4) { return dot4_u(acc, w, a4); }
inline I16 widen(Part p) { return p; }
constexpr int kSignedOffset = 0;
inline I16 iadd(I16 a, I16 b) {
  for (int i = 0; i < 16; ++i) a.v[i] += b.v[i];
  return a;
}
inline I16 isub_scalar(I16 a, int32_t x) {
  for (auto& v : a.v) v -= x;
  return a;
}
inline I16 imul(I16 a, I16 b) {
  for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i];
  return a;
}
inline F16 to_float(I16 a) {
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(a.v[i]);
  return r;
}
inline F16 fmul(F16 a, F16 b) {
  for (int i = 0; i < 16; ++i) a.v[i] *= b.v[i];
  return a;
}
inline F16 fadd(F16 a, F16 b) {
  for (int i = 0; i < 16; ++i) a.v[i] += b.v[i];
  return a;
}
inline F16 ffma(F16 a, F16 b, F16 c) {
  for (int i = 0; i < 16; ++i) c.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
  return c;
}
inline F16 fneg(F16 a) {
  for (auto& v : a.v) v = -v;
  return a;
}
inline F16 load_f32(const float* p) {
  F16 r;
  std::memcpy(r.v, p, sizeof r.v);
  return r;
}
inline F16 load_f16(const uint16_t* p) {
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = f16_to_f32(p[i]);
  return r;
}
inline F16 load_u8f(const uint8_t* p) {
  F16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = static_cast<float>(p[i]);
  return r;
}
inline I16 load_s8i(const int8_t* p) {
  I16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = p[i];
  return r;
}
inline void store_f32(float* p, F16 a, int n) { std::memcpy(p, a.v, sizeof(float) * n); }
inline void add_store_f32(float* p, F16 a, int n) {
  for (int i = 0; i < n; ++i) p[i] += a.v[i];
}

inline F16 fabs16(F16 a) {
  for (auto& v : a.v) v = std::fabs(v);
  return a;
}
inline F16 fmax16(F16 a, F16 b) {
  for (int i = 0; i < 16; ++i) a.v[i] = a.v[i] > b.v[i] ? a.v[i] : b.v[i];
  return a;
}
inline float hsum(F16 a) {
  float s = 0.0f;
  for (float v : a.v) s += v;
  return s;
}
inline float hmax(F16 a) {
  float m = a.v[0];
  for (float v : a.v) m = v > m ? v : m;
  return m;
}
inline void store_f32_all(float* p, F16 a) { std::memcpy(p, a.v, sizeof a.v); }
inline int32_t quantize16(F16 a, float id, int8_t* p) {
  int32_t sum = 0;
  for (int i = 0; i < 16; ++i) {
    float r = std::nearbyint(a.v[i] * id);
    r = r > 127.0f ? 127.0f : r < -128.0f ? -128.0f : r;
    p[i] = static_cast<int8_t>(r);
    sum += static_cast<int32_t>(r);
  }
  return sum;
}
inline F16 silu16(F16 x) {
  for (auto& v : x.v) {
    const float e = std::exp(-std::fabs(v));
    v = v * ((v < 0.0f ? e : 1.0f) / (1.0f + e));
  }
  return x;
}
inline F16 gelu_tanh16(F16 x) {
  for (auto& v : x.v) v = 0.5f * v * (1.0f + std::tanh(kGeluC * (v + kGeluA * v * v * v)));
  return x;
}
#endif

}  // namespace q
}  // namespace kvs

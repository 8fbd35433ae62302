// RMSNorm where a layer's torch ops would cost more than their arithmetic (a decode step's few
// rows): a norm added into the residual (Gemma's norms after attention and after the MLP), and
// each head's query and key normed then rotated (Gemma's q/k norms before RoPE).
//
//     y = w * (x * r),  r = 1 / sqrt(mean(x^2) + eps)      (the two products rounded as torch's
//                                                            rms_norm then its weight round them)
#pragma once

#include <cmath>
#include <cstdint>

#include "rope.h"
#include "simd.h"

namespace kvs {
namespace norms {

inline float inv_rms(const float* x, int64_t n, float eps) {
  float sum = 0.0f;
  int64_t j = 0;
#ifdef KVS_SIMD
  vf acc = vset1(0.0f);
  for (; j + W <= n; j += W) {
    const vf v = vload(x + j);
    acc = vfma(v, v, acc);
  }
  sum = vhsum(acc);
#endif
  for (; j < n; ++j) sum += x[j] * x[j];
  return 1.0f / std::sqrt(sum / static_cast<float>(n) + eps);
}

// y = w * (x * r) (y may be x)
inline void scale(const float* x, const float* w, float r, float* y, int64_t n) {
  int64_t j = 0;
#ifdef KVS_SIMD
  const vf vr = vset1(r);
  for (; j + W <= n; j += W) vstore(y + j, vmul(vload(w + j), vmul(vload(x + j), vr)));
#endif
  for (; j < n; ++j) y[j] = w[j] * (x[j] * r);
}

// h += w * (x * r)
inline void add_scaled(float* h, const float* x, const float* w, float r, int64_t n) {
  int64_t j = 0;
#ifdef KVS_SIMD
  const vf vr = vset1(r);
  for (; j + W <= n; j += W) vstore(h + j, vadd(vload(h + j), vmul(vload(w + j), vmul(vload(x + j), vr))));
#endif
  for (; j < n; ++j) h[j] += w[j] * (x[j] * r);
}

// h[t] += rms_norm(x[t]) * w for T rows of n
inline void norm_add(float* h, const float* x, const float* w, int64_t T, int64_t n, float eps) {
  for (int64_t t = 0; t < T; ++t) add_scaled(h + t * n, x + t * n, w, inv_rms(x + t * n, n, eps), n);
}

// qkv: T rows (stride ld) of [q (H x D) | k (Hkv x D) | v]; each head normed (weights qw / kw, D
// each) into `tmp` (D floats), then rotated into q_out [T, H, D] / k_out [T, Hkv, D] at the
// token's angles (rope.h).
inline void qk_norm_rope(const float* qkv, int64_t ld, int64_t T, int64_t H, int64_t Hkv, int64_t D,
                         const int64_t* positions, const float* cos, const float* sin, const float* qw, const float* kw,
                         float eps, float* tmp, float* q_out, float* k_out) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float* row = qkv + t * ld;
    const float* c = cos + positions[t] * half;
    const float* s = sin + positions[t] * half;
    for (int64_t h = 0; h < H + Hkv; ++h) {
      const float* x = row + h * D;
      const bool is_q = h < H;
      scale(x, is_q ? qw : kw, inv_rms(x, D, eps), tmp, D);
      rope::rotate_heads(tmp, is_q ? q_out + (t * H + h) * D : k_out + (t * Hkv + h - H) * D, 1, D, c, s);
    }
  }
}

}  // namespace norms
}  // namespace kvs

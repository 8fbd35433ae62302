// Rotary position embedding of a step's queries and keys in one call, read straight from the
// fused Q/K/V product's rows.
//
// Half-split layout (GPT-NeoX, Hugging Face Llama): channel j pairs with j + D/2,
//     out[j] = x[j] cos - x[j + D/2] sin,   out[j + D/2] = x[j + D/2] cos + x[j] sin,
// each product rounded before the add, as torch computes kvserve.model.llama.apply_rope, so
// the two agree bit for bit (tested).
#pragma once

#include <cstdint>

#include "simd.h"

namespace kvs {
namespace rope {

// Rotate `heads` heads of one token: src rows of D floats (stride D), dst likewise.
inline void rotate_heads(const float* src, float* dst, int64_t heads, int64_t D, const float* cos, const float* sin) {
  const int64_t half = D / 2;
  for (int64_t h = 0; h < heads; ++h) {
    const float* x = src + h * D;
    float* y = dst + h * D;
    int64_t j = 0;
#ifdef KVS_SIMD
    for (; j + W <= half; j += W) {
      const vf x1 = vload(x + j), x2 = vload(x + half + j), c = vload(cos + j), s = vload(sin + j);
      vstore(y + j, vsub(vmul(x1, c), vmul(x2, s)));
      vstore(y + half + j, vadd(vmul(x2, c), vmul(x1, s)));
    }
#endif
    for (; j < half; ++j) {
      const float x1 = x[j], x2 = x[half + j];
      const float a = x1 * cos[j], b = x2 * sin[j], c = x2 * cos[j], d = x1 * sin[j];
      y[j] = a - b;
      y[half + j] = c + d;
    }
  }
}

// qkv: T rows (stride ld) of [q (H x D) | k (Hkv x D) | v]; q_out [T, H, D], k_out [T, Hkv, D];
// the angles of token t are row positions[t] of the cos / sin tables [*, D/2].
inline void rope_qk(const float* qkv, int64_t ld, int64_t T, int64_t H, int64_t Hkv, int64_t D, const int64_t* positions,
                    const float* cos, const float* sin, float* q_out, float* k_out) {
  const int64_t half = D / 2;
  for (int64_t t = 0; t < T; ++t) {
    const float* row = qkv + t * ld;
    const float* c = cos + positions[t] * half;
    const float* s = sin + positions[t] * half;
    rotate_heads(row, q_out + t * H * D, H, D, c, s);
    rotate_heads(row + H * D, k_out + t * Hkv * D, Hkv, D, c, s);
  }
}

}  // namespace rope
}  // namespace kvs

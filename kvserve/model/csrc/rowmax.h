// Each row's largest value and the index of its first occurrence: what greedy sampling draws
// (torch.max(dim=-1)'s result, bit for bit, infinities included). torch's CPU kernel walks a row
// one element at a time with its index (130 us for Qwen2.5's 151,936 logits on this project's
// EPYC box); here one vectorized pass finds the maximum and a second the first block holding it
// (23 us). A row holding a NaN is left to the caller (the sampler asks torch, then fails the row).
#pragma once

#include <cstdint>
#include <limits>

#include "simd.h"

namespace kvs {
namespace rowmax {

// The row's maximum and its first index; false (nothing written) when the row holds a NaN.
inline bool argmax_unless_nan(const float* x, int64_t n, float* value, int64_t* index) {
  if (n <= 0) return false;
  float m = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t j = 0;
#ifdef KVS_SIMD
  vf vm = vset1(m);
  for (; j + W <= n; j += W) {
    const vf v = vload(x + j);
    nan = nan || vany_nan(v);
    vm = vmax(vm, v);
  }
  m = vhmax(vm);
#endif
  for (; j < n; ++j) {
    nan = nan || x[j] != x[j];
    m = x[j] > m ? x[j] : m;
  }
  if (nan) return false;
  // the first block whose maximum is m holds the first occurrence (every value is <= m; an
  // all -inf row's is its first)
  j = 0;
#ifdef KVS_SIMD
  for (; j + W <= n; j += W)
    if (vhmax(vload(x + j)) == m) break;
#endif
  for (; j < n; ++j)
    if (x[j] == m) break;
  *value = x[j];   // (+0 and -0 compare equal: the first of them, as torch returns it)
  *index = j;
  return true;
}

}  // namespace rowmax
}  // namespace kvs

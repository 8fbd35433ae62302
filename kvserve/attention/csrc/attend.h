// One tile of query rows against one block of keys and values (float32 rows in L1):
// logits, online softmax in the log2 domain, accumulation of the values.
//
//   tile rows r = (query i, head g of the KV head's group): q[r] pre-scaled by scale*log2(e)
//   row r sees keys t < visible[r] (causal: its position + 1)
//   state per row: running max m[r] (log2 domain), sum l[r], accumulator acc[r][0..ld)
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "simd.h"

namespace kvs {

struct Tile {
  int rows = 0;
  int64_t ld = 0;            // floats per row of q / acc (head_dim rounded up to 8)
  const float* q = nullptr;  // [rows, ld]
  const int64_t* visible = nullptr;
  float* m = nullptr;
  float* l = nullptr;
  float* acc = nullptr;      // [rows, ld]
  float* logits = nullptr;   // scratch [block_size + 8]
};

// logits[j] = q . k_j for j < n (k_j = K + j * ldk).
inline void row_logits(const float* q, const float* K, int64_t ldk, int n, int64_t ld, float* out) {
  int j = 0;
#ifdef KVS_AVX2
  for (; j + 8 <= n; j += 8) {
    __m256 a[8];
    for (int k = 0; k < 8; ++k) a[k] = _mm256_setzero_ps();
    const float* kj = K + j * ldk;
    for (int64_t d = 0; d < ld; d += 8) {
      const __m256 qv = _mm256_loadu_ps(q + d);
      for (int k = 0; k < 8; ++k) a[k] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + k * ldk + d), a[k]);
    }
    _mm256_storeu_ps(out + j, hsum8(a));
  }
  for (; j < n; ++j) {
    __m256 a = _mm256_setzero_ps();
    for (int64_t d = 0; d < ld; d += 8) a = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), _mm256_loadu_ps(K + j * ldk + d), a);
    out[j] = hsum(a);
  }
#else
  for (; j < n; ++j) {
    float s = 0.0f;
    for (int64_t d = 0; d < ld; ++d) s += q[d] * K[j * ldk + d];
    out[j] = s;
  }
#endif
}

// acc += sum_j p[j] * v_j over j < n, for NV vectors of 8 channels starting at channel c0.
#ifdef KVS_AVX2
template <int NV>
inline void accumulate_chunk(float* acc, const float* p, const float* V, int64_t ldv, int n) {
  __m256 a[NV];
  for (int v = 0; v < NV; ++v) a[v] = _mm256_loadu_ps(acc + 8 * v);
  for (int j = 0; j < n; ++j) {
    const __m256 pj = _mm256_broadcast_ss(p + j);
    const float* vj = V + j * ldv;
    for (int v = 0; v < NV; ++v) a[v] = _mm256_fmadd_ps(pj, _mm256_loadu_ps(vj + 8 * v), a[v]);
  }
  for (int v = 0; v < NV; ++v) _mm256_storeu_ps(acc + 8 * v, a[v]);
}
#endif

inline void accumulate(float* acc, const float* p, const float* V, int64_t ldv, int n, int64_t ld) {
#ifdef KVS_AVX2
  int64_t c = 0;
  for (; c + 64 <= ld; c += 64) accumulate_chunk<8>(acc + c, p, V + c, ldv, n);
  switch ((ld - c) / 8) {
    case 7: accumulate_chunk<7>(acc + c, p, V + c, ldv, n); break;
    case 6: accumulate_chunk<6>(acc + c, p, V + c, ldv, n); break;
    case 5: accumulate_chunk<5>(acc + c, p, V + c, ldv, n); break;
    case 4: accumulate_chunk<4>(acc + c, p, V + c, ldv, n); break;
    case 3: accumulate_chunk<3>(acc + c, p, V + c, ldv, n); break;
    case 2: accumulate_chunk<2>(acc + c, p, V + c, ldv, n); break;
    case 1: accumulate_chunk<1>(acc + c, p, V + c, ldv, n); break;
    default: break;
  }
#else
  for (int j = 0; j < n; ++j) {
    for (int64_t d = 0; d < ld; ++d) acc[d] += p[j] * V[j * ldv + d];
  }
#endif
}

// p[j] = 2^(p[j] - m) in place for j < n; returns their sum.
inline float exp2_shifted(float* p, int n, float m) {
  int j = 0;
  float sum = 0.0f;
#ifdef KVS_AVX2
  const __m256 vm = _mm256_set1_ps(m);
  __m256 vs = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp2_neg(_mm256_sub_ps(_mm256_loadu_ps(p + j), vm));
    _mm256_storeu_ps(p + j, e);
    vs = _mm256_add_ps(vs, e);
  }
  sum = hsum(vs);
#endif
  for (; j < n; ++j) {
    p[j] = std::exp2(p[j] - m);
    sum += p[j];
  }
  return sum;
}

inline void scale_row(float* acc, float c, int64_t ld) {
#ifdef KVS_AVX2
  const __m256 vc = _mm256_set1_ps(c);
  for (int64_t d = 0; d < ld; d += 8) _mm256_storeu_ps(acc + d, _mm256_mul_ps(_mm256_loadu_ps(acc + d), vc));
#else
  for (int64_t d = 0; d < ld; ++d) acc[d] *= c;
#endif
}

// The tile attends to keys key0 .. key0 + n - 1 (rows j of K and V).
inline void attend_block(const Tile& t, const float* K, int64_t ldk, const float* V, int64_t ldv, int n,
                         int64_t key0) {
  for (int r = 0; r < t.rows; ++r) {
    const int64_t vis = std::min<int64_t>(n, t.visible[r] - key0);
    if (vis <= 0) continue;  // every key of the block lies after this row's query
    const int nv = static_cast<int>(vis);
    float* s = t.logits;
    row_logits(t.q + r * t.ld, K, ldk, nv, t.ld, s);
    float mx = s[0];
    for (int j = 1; j < nv; ++j) mx = std::max(mx, s[j]);
    const float m_old = t.m[r];
    const float m_new = std::max(m_old, mx);
    const float sum = exp2_shifted(s, nv, m_new);
    float* acc = t.acc + r * t.ld;
    if (m_new > m_old) {
      const float c = std::exp2(m_old - m_new);  // 0 for the first block (m_old = -inf)
      t.l[r] *= c;
      scale_row(acc, c, t.ld);
      t.m[r] = m_new;
    }
    t.l[r] += sum;
    accumulate(acc, s, V, ldv, nv, t.ld);
  }
}

}  // namespace kvs

// One tile of query rows against one block of keys and values (float32 rows in L1):
// logits, online softmax in the log2 domain, accumulation of the values.
//
//   tile rows r = (query i, head g of the KV head's group): q[r] pre-scaled by scale*log2(e)
//   row r sees keys t < visible[r] (causal: its position + 1)
//   state per row: running max m[r] (log2 domain), sum l[r], accumulator acc[r][0..ld)
//   key j of the block: k_j = kscale[j] * K[j], v_j = vscale[j] * V[j] (scales optional:
//   int8 / fp8 rows are decoded without their per-token scale, applied here once per key)
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "dequant.h"
#include "simd.h"

namespace kvs {

struct Tile {
  int rows = 0;
  int64_t ld = 0;            // floats per row of q / acc (head_dim rounded up to 16)
  const float* q = nullptr;  // [rows, ld]
  const int64_t* visible = nullptr;
  float* m = nullptr;
  float* l = nullptr;
  float* acc = nullptr;      // [rows, ld]
  float* p = nullptr;        // scratch [rows, pld]: logits, then weights
  int64_t pld = 0;           // >= block_size rounded up to 16
};

#ifdef KVS_SIMD
// out[j] = q . k_j for j < n, q held in NV registers; keys in groups of KG (4 or 8, as the
// registers allow), each key row a memory operand of its FMAs.
template <int NV, int KG>
inline void row_logits(const float* qrow, const float* K, int64_t ldk, int n, float* out, Prefetcher& pf) {
  vf q[NV];
  #pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) q[v] = vload(qrow + v * W);
  int j = 0;
  for (; j + KG <= n; j += KG) {
    if (KG == 8 || j % 8 == 0) pf.pump();
    vf a[KG];
    const float* kp = K + j * ldk;
    #pragma GCC unroll 16
    for (int k = 0; k < KG; ++k, kp += ldk) {
      a[k] = vmul(q[0], vload(kp));
      #pragma GCC unroll 16
      for (int v = 1; v < NV; ++v) a[k] = vfma(q[v], vload(kp + v * W), a[k]);
    }
    __m256 f[KG];
    #pragma GCC unroll 16
    for (int k = 0; k < KG; ++k) f[k] = fold8(a[k]);
    if constexpr (KG == 8) {
      _mm256_storeu_ps(out + j, transpose_sum8(f));
    } else {
      _mm_storeu_ps(out + j, transpose_sum4(f));
    }
  }
  for (; j < n; ++j) {
    vf a = vmul(q[0], vload(K + j * ldk));
    #pragma GCC unroll 16
    for (int v = 1; v < NV; ++v) a = vfma(q[v], vload(K + j * ldk + v * W), a);
    out[j] = vhsum(a);
  }
}

// Any width: q and keys through memory.
inline void row_logits_any(const float* q, const float* K, int64_t ldk, int n, int64_t ld, float* out,
                           Prefetcher& pf) {
  for (int j = 0; j < n; ++j) {
    if (j % 8 == 0) pf.pump();
    vf a = vzero();
    for (int64_t d = 0; d < ld; d += W) a = vfma(vload(q + d), vload(K + j * ldk + d), a);
    out[j] = vhsum(a);
  }
}

// acc[r][0 .. NV*W) += sum_j p[r][j] * v_j for RC rows at once: each V vector is loaded once.
template <int RC, int NV>
inline void accumulate_rows(float* acc, int64_t ld, const float* p, int64_t pld, const float* V, int64_t ldv,
                            int n) {
  vf a[RC][NV];
  #pragma GCC unroll 16
  for (int r = 0; r < RC; ++r) {
    #pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) a[r][v] = vload(acc + r * ld + v * W);
  }
  for (int j = 0; j < n; ++j) {
    const float* vj = V + j * ldv;
    #pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const vf x = vload(vj + v * W);
      #pragma GCC unroll 16
      for (int r = 0; r < RC; ++r) a[r][v] = vfma(x, vset1(p[r * pld + j]), a[r][v]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < RC; ++r) {
    #pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) vstore(acc + r * ld + v * W, a[r][v]);
  }
}

// Rows [r0, r1) over channel chunks of up to 8 vectors; rows in groups sized to the registers.
template <int NV>
inline void accumulate_chunk(float* acc, int64_t ld, const float* p, int64_t pld, const float* V, int64_t ldv, int n,
                             int rows) {
  constexpr int RC = (W == 16 ? 16 : 8) / NV > 0 ? (W == 16 ? 16 : 8) / NV : 1;
  int r = 0;
  for (; r + RC <= rows; r += RC) accumulate_rows<RC, NV>(acc + r * ld, ld, p + r * pld, pld, V, ldv, n);
  for (; r < rows; ++r) accumulate_rows<1, NV>(acc + r * ld, ld, p + r * pld, pld, V, ldv, n);
}
#endif

// acc[r] += sum_j p[r][j] * v_j for every row (p zero where a row does not see key j).
inline void accumulate(const Tile& t, const float* V, int64_t ldv, int n) {
#ifdef KVS_SIMD
  for (int64_t c = 0; c < t.ld; c += 8 * W) {
    float* acc = t.acc + c;
    const float* v = V + c;
    switch (std::min<int64_t>(8, (t.ld - c) / W)) {
      case 8: accumulate_chunk<8>(acc, t.ld, t.p, t.pld, v, ldv, n, t.rows); break;
      case 7: accumulate_chunk<7>(acc, t.ld, t.p, t.pld, v, ldv, n, t.rows); break;
      case 6: accumulate_chunk<6>(acc, t.ld, t.p, t.pld, v, ldv, n, t.rows); break;
      case 5: accumulate_chunk<5>(acc, t.ld, t.p, t.pld, v, ldv, n, t.rows); break;
      case 4: accumulate_chunk<4>(acc, t.ld, t.p, t.pld, v, ldv, n, t.rows); break;
      case 3: accumulate_chunk<3>(acc, t.ld, t.p, t.pld, v, ldv, n, t.rows); break;
      case 2: accumulate_chunk<2>(acc, t.ld, t.p, t.pld, v, ldv, n, t.rows); break;
      default: accumulate_chunk<1>(acc, t.ld, t.p, t.pld, v, ldv, n, t.rows); break;
    }
  }
#else
  for (int r = 0; r < t.rows; ++r) {
    for (int j = 0; j < n; ++j) {
      const float pj = t.p[r * t.pld + j];
      for (int64_t d = 0; d < t.ld; ++d) t.acc[r * t.ld + d] += pj * V[j * ldv + d];
    }
  }
#endif
}

inline void logits(const Tile& t, int r, const float* K, int64_t ldk, int n, float* out, Prefetcher& pf) {
  const float* q = t.q + r * t.ld;
#ifdef KVS_SIMD
  switch (t.ld / W) {
#if KVS_W == 16
    case 4: row_logits<4, 8>(q, K, ldk, n, out, pf); return;
    case 8: row_logits<8, 8>(q, K, ldk, n, out, pf); return;
#else
    case 8: row_logits<8, 4>(q, K, ldk, n, out, pf); return;
    case 2: row_logits<2, 8>(q, K, ldk, n, out, pf); return;
#endif
    default: row_logits_any(q, K, ldk, n, t.ld, out, pf); return;
  }
#else
  pf.pump();
  for (int j = 0; j < n; ++j) {
    float s = 0.0f;
    for (int64_t d = 0; d < t.ld; ++d) s += q[d] * K[j * ldk + d];
    out[j] = s;
  }
#endif
}

// Softmax step of one row over its logits p[0 .. np) (np a multiple of 16; entries past
// the row's visible keys are -inf): p *= kscale, new running max, p = 2^(p - max) * vscale,
// returns the sum of 2^(p - max) (before vscale). kscale / vscale may be null.
inline float softmax_row(float* p, int np, const float* kscale, const float* vscale, float m_old, float* m_new) {
#ifdef KVS_SIMD
  vf mx = vset1(-std::numeric_limits<float>::infinity());
  for (int j = 0; j < np; j += W) {
    vf x = vload(p + j);
    if (kscale) {
      x = vmul(x, vload(kscale + j));
      vstore(p + j, x);
    }
    mx = vmax(mx, x);
  }
  const float m = std::max(m_old, vhmax(mx));
  const vf vm = vset1(m);
  vf sum = vzero();
  for (int j = 0; j < np; j += W) {
    const vf e = vexp2_neg(vsub(vload(p + j), vm));
    sum = vadd(sum, e);
    vstore(p + j, vscale ? vmul(e, vload(vscale + j)) : e);
  }
  *m_new = m;
  return vhsum(sum);
#else
  float m = m_old;
  for (int j = 0; j < np; ++j) {
    if (kscale && p[j] != -std::numeric_limits<float>::infinity()) p[j] *= kscale[j];
    m = std::max(m, p[j]);
  }
  float sum = 0.0f;
  for (int j = 0; j < np; ++j) {
    const float e = std::exp2(p[j] - m);
    sum += e;
    p[j] = vscale ? e * vscale[j] : e;
  }
  *m_new = m;
  return sum;
#endif
}

inline void scale_acc(float* acc, float c, int64_t ld) {
#ifdef KVS_SIMD
  const vf vc = vset1(c);
  for (int64_t d = 0; d < ld; d += W) vstore(acc + d, vmul(vload(acc + d), vc));
#else
  for (int64_t d = 0; d < ld; ++d) acc[d] *= c;
#endif
}

// The tile attends to keys key0 .. key0 + n - 1 (rows j of K and V). Scales, when given,
// hold finite values up to n rounded up to 16.
inline void attend_block(const Tile& t, const Rows& k, const Rows& v, int n, int64_t key0, Prefetcher& pf) {
  const int np = (n + 15) / 16 * 16;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < t.rows; ++r) {
    float* p = t.p + r * t.pld;
    const int64_t vis = std::min<int64_t>(n, t.visible[r] - key0);
    if (vis <= 0) {  // every key of the block lies after this row's query
      std::fill(p, p + np, 0.0f);
      continue;
    }
    const int nv = static_cast<int>(vis);
    logits(t, r, k.x, k.ld, nv, p, pf);
    const float* kscale = k.scale;
    if (nv < np) {  // a partial block or a causal edge: scale the visible keys, mask the rest
      if (kscale) {
        for (int j = 0; j < nv; ++j) p[j] *= kscale[j];
        kscale = nullptr;  // (-inf * a zero scale would be NaN)
      }
      std::fill(p + nv, p + np, kNegInf);
    }
    float m_new;
    const float m_old = t.m[r];
    const float sum = softmax_row(p, np, kscale, v.scale, m_old, &m_new);
    if (m_new > m_old) {
      const float c = std::exp2(m_old - m_new);  // 0 for the first block (m_old = -inf)
      t.l[r] *= c;
      scale_acc(t.acc + r * t.ld, c, t.ld);
      t.m[r] = m_new;
    }
    t.l[r] += sum;
  }
  accumulate(t, v.x, v.ld, n);
}

}  // namespace kvs

// One tile of query rows against one block of keys and values: logits, online softmax in
// the log2 domain, accumulation of the values.
//
//   tile rows r = (query i, head g of the KV head's group): q[r] pre-scaled by scale*log2(e)
//   row r sees keys t < visible[r] (causal: its position + 1), and t >= first[r] under a sliding window
//   state per row: running max m[r] (log2 domain), sum l[r] (kept as W partial sums),
//   accumulator acc[r][0..ld)
//
// Keys and values are read through Rows (dequant.h): in place in their stored format, each
// vector converted once and used for every row of the tile held in registers (RQ rows for
// logits, RC for values), or as float32 rows a decode pass wrote (large prefill tiles,
// outlier layouts). Measured on the development machine (AMD EPYC, 2 vCPUs), vector
// operations of every kind retire at about the same rate (2.5-3 per ns), so what counts is
// the number of operations per key: no store and reload of converted rows for small tiles,
// no horizontal max or sum per block where it can be avoided.
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
  float* m = nullptr;        // [rows]
  float* l = nullptr;        // [rows, W] partial sums
  float* acc = nullptr;      // [rows, ld]
  float* p = nullptr;        // scratch [rows, pld]: logits, then weights
  int64_t pld = 0;           // >= block_size rounded up to 16
  const int64_t* first = nullptr;  // a sliding window's first key of each row (else every key from 0)
};

#ifdef KVS_SIMD
// Head dims with their own instances: NV vectors of W channels.
constexpr bool fast_width(int nv) { return nv == 4 || nv == 8 || nv == 16; }
// Rows whose accumulators the registers hold (16 registers with AVX2, 32 with AVX-512):
// logits RQ rows x 4 keys; values RC rows x kValueVectors vectors (+ RC broadcasts). Tiles
// of at most this many rows read keys and values in place; larger ones decode first. Head dim
// 128 with AVX-512 takes 6 rows (24 accumulators + 6 broadcasts): a group of 6 query heads
// per KV head (Qwen2.5-1.5B) converts each key and value vector once (fp16 / int8 KV 10-17% faster
// than 4 + 2 rows at 4,000 tokens, python -m kvserve.bench.attention_kernels --model-shape qwen2.5-1.5b).
constexpr int kValueVectors = 4;
constexpr int logit_rows(int nv) { return fast_width(nv) ? (W == 16 ? (nv == 4 ? 3 : nv == 8 ? 6 : 4) : 3) : 0; }
constexpr int value_rows(int nv) { return fast_width(nv) ? (W == 16 ? (nv == 8 ? 6 : 4) : 3) : 0; }

// The end of the pair of vectors v belongs to: the fast widths are an even number of vectors,
// so a pair never passes the row's end (vcodes reads a pair's 2-bit codes in one word).
constexpr int pair_end(int v) { return (v / 2 + 1) * 2 * W; }

// Vector v (channels v*W ..) of key / value row j (at `row`), dequantized but for scale[j].
// Group codes: VPG vectors per group when known at compile time (then the group's scale
// and zero are loaded once per row), else `g` is v's group index.
template <int CODE, int VPG>
inline vf load_row(const Rows& s, const uint8_t* row, int v, int j, int64_t g) {
  if constexpr (CODE == C_F32) {
    return vload(reinterpret_cast<const float*>(row) + v * W);
  } else if constexpr (CODE == C_F16) {
    return vload_f16(reinterpret_cast<const uint16_t*>(row) + v * W);
  } else if constexpr (CODE == C_BF16) {
    return vload_bf16(reinterpret_cast<const uint16_t*>(row) + v * W);
  } else if constexpr (CODE == C_I8) {
    return vload_i8(reinterpret_cast<const int8_t*>(row) + v * W);
  } else if constexpr (CODE == C_FP8) {
    return vload_fp8_div256(row + v * W);
  } else if constexpr (CODE == C_U4C || CODE == C_U2C) {
    return vfma(vcodes<CODE == C_U4C ? 4 : 2>(row, v * W, pair_end(v)), vload(s.cs + v * W), vload(s.cz + v * W));
  } else {
    const int64_t at = j * s.gstride + (VPG ? v / (VPG ? VPG : 1) : g);
    return vfma(vcodes<CODE == C_U4G ? 4 : 2>(row, v * W, pair_end(v)), vset1(s.gs[at]), vset1(s.gz[at]));
  }
}

// Group index of vectors v0 .. v0 + NV (runtime group sizes).
template <int NV>
inline void group_offsets(const Rows& s, int v0, int64_t* goff) {
  for (int v = 0; v < NV; ++v) goff[v] = s.group ? (v0 + v) * W / s.group : 0;
}

// out[r * pld + j] = q[r] . k_j for RQ rows and keys j < n, keys in groups of KG, each key
// vector converted once for all rows; q comes from memory as the FMAs' operand (no extra
// operation), so the registers hold only the RQ x KG accumulators.
template <int RQ, int NV, int KG, int CODE, int VPG>
inline void logits_rows(const float* q, int64_t ldq, const Rows& k, int n, float* out, int64_t pld, Prefetcher& pf) {
  // With 32 registers (AVX-512) small tiles keep q in registers after all: fewer loads.
  constexpr bool kQinRegs = W == 16 && RQ * NV + RQ * KG <= 28;
  vf qr[kQinRegs ? RQ : 1][kQinRegs ? NV : 1];
  if constexpr (kQinRegs) {
    #pragma GCC unroll 16
    for (int r = 0; r < RQ; ++r) {
      #pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) qr[r][v] = vload(q + r * ldq + v * W);
    }
  }
  int64_t goff[NV];
  group_offsets<NV>(k, 0, goff);
  int j = 0;
  for (; j + KG <= n; j += KG) {
    pf.pump();
    vf a[RQ][KG];
    const uint8_t* row = k.base + j * k.stride;
    #pragma GCC unroll 16
    for (int kk = 0; kk < KG; ++kk, row += k.stride) {
      #pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) {
        const vf x = load_row<CODE, VPG>(k, row, v, j + kk, goff[v]);
        #pragma GCC unroll 16
        for (int r = 0; r < RQ; ++r) {
          const vf qv = kQinRegs ? qr[kQinRegs ? r : 0][kQinRegs ? v : 0] : vload(q + r * ldq + v * W);
          a[r][kk] = v == 0 ? vmul(qv, x) : vfma(qv, x, a[r][kk]);
        }
      }
    }
    #pragma GCC unroll 16
    for (int r = 0; r < RQ; ++r) {
      __m256 f[KG];
      #pragma GCC unroll 16
      for (int kk = 0; kk < KG; ++kk) f[kk] = fold8(a[r][kk]);
      if constexpr (KG == 8) {
        _mm256_storeu_ps(out + r * pld + j, transpose_sum8(f));
      } else {
        _mm_storeu_ps(out + r * pld + j, transpose_sum4(f));
      }
    }
  }
  for (; j < n; ++j) {
    const uint8_t* row = k.base + j * k.stride;
    vf a[RQ];
    #pragma GCC unroll 16
    for (int v = 0; v < NV; ++v) {
      const vf x = load_row<CODE, VPG>(k, row, v, j, goff[v]);
      #pragma GCC unroll 16
      for (int r = 0; r < RQ; ++r) {
        const vf qv = kQinRegs ? qr[kQinRegs ? r : 0][kQinRegs ? v : 0] : vload(q + r * ldq + v * W);
        a[r] = v == 0 ? vmul(qv, x) : vfma(qv, x, a[r]);
      }
    }
    // the same order of additions as the key groups' transposed sums (lane 0 of
    // transpose_sum4 is a function of its first vector alone), so a key's logit is the same
    // bits whether it falls in a group or in the tail, which depends on the tile's last row
    #pragma GCC unroll 16
    for (int r = 0; r < RQ; ++r) {
      const __m256 f = fold8(a[r]);
      const __m256 four[4] = {f, f, f, f};
      out[r * pld + j] = _mm_cvtss_f32(transpose_sum4(four));
    }
  }
}

// acc[r][channels of vectors V0 .. V0 + VC) += sum_j p[r * pld + j] * v_j for RC rows, each
// value vector converted once for all rows; the accumulators stay in registers.
template <int RC, int VC, int V0, int CODE, int VPG>
inline void accumulate_rows(float* acc, int64_t ld, const float* p, int64_t pld, const Rows& s, int n, Prefetcher& pf) {
  vf a[RC][VC];
  #pragma GCC unroll 16
  for (int r = 0; r < RC; ++r) {
    #pragma GCC unroll 16
    for (int v = 0; v < VC; ++v) a[r][v] = vload(acc + r * ld + (V0 + v) * W);
  }
  int64_t goff[VC];
  group_offsets<VC>(s, V0, goff);
  const uint8_t* row = s.base;
  for (int j = 0; j < n; ++j, row += s.stride) {
    if (j % 4 == 0) pf.pump();
    vf pr[RC];
    #pragma GCC unroll 16
    for (int r = 0; r < RC; ++r) pr[r] = vset1(p[r * pld + j]);
    #pragma GCC unroll 16
    for (int v = 0; v < VC; ++v) {
      const vf x = load_row<CODE, VPG>(s, row, V0 + v, j, goff[v]);
      #pragma GCC unroll 16
      for (int r = 0; r < RC; ++r) a[r][v] = vfma(x, pr[r], a[r][v]);
    }
  }
  #pragma GCC unroll 16
  for (int r = 0; r < RC; ++r) {
    #pragma GCC unroll 16
    for (int v = 0; v < VC; ++v) vstore(acc + r * ld + (V0 + v) * W, a[r][v]);
  }
}

// Every row of the tile, RQ rows at a time: F32 rows may come in any number of chunks,
// other codes only for tiles within logit_rows (see kernel.h).
template <int NV, int CODE, int VPG>
inline void logits_all(const Tile& t, const Rows& k, int n, Prefetcher& pf) {
  constexpr int RQ = logit_rows(NV);
  int r = 0;
  if (t.rows == 1) {
    logits_rows<1, NV, 8, CODE, VPG>(t.q, t.ld, k, n, t.p, t.pld, pf);
    return;
  }
  for (; r + RQ <= t.rows; r += RQ) {
    logits_rows<RQ, NV, 4, CODE, VPG>(t.q + r * t.ld, t.ld, k, n, t.p + r * t.pld, t.pld, pf);
  }
  const int rest = t.rows - r;
  if constexpr (RQ > 5) {
    if (rest == 5) logits_rows<5, NV, 4, CODE, VPG>(t.q + r * t.ld, t.ld, k, n, t.p + r * t.pld, t.pld, pf);
  }
  if constexpr (RQ > 4) {
    if (rest == 4) logits_rows<4, NV, 4, CODE, VPG>(t.q + r * t.ld, t.ld, k, n, t.p + r * t.pld, t.pld, pf);
  }
  if constexpr (RQ > 3) {
    if (rest == 3) logits_rows<3, NV, 4, CODE, VPG>(t.q + r * t.ld, t.ld, k, n, t.p + r * t.pld, t.pld, pf);
  }
  if (rest == 2) logits_rows<2, NV, 4, CODE, VPG>(t.q + r * t.ld, t.ld, k, n, t.p + r * t.pld, t.pld, pf);
  if (rest == 1) logits_rows<1, NV, 4, CODE, VPG>(t.q + r * t.ld, t.ld, k, n, t.p + r * t.pld, t.pld, pf);
}

// Every row, RC rows at a time, for the channels of vectors V0 .. V0 + kValueVectors, then
// the next chunk of channels.
template <int NV, int V0, int CODE, int VPG>
inline void accumulate_chunk(const Tile& t, const Rows& s, int n, Prefetcher& pf) {
  constexpr int RC = value_rows(NV), VC = kValueVectors;
  int r = 0;
  for (; r + RC <= t.rows; r += RC) {
    accumulate_rows<RC, VC, V0, CODE, VPG>(t.acc + r * t.ld, t.ld, t.p + r * t.pld, t.pld, s, n, pf);
  }
  const int rest = t.rows - r;
  float* acc = t.acc + r * t.ld;
  const float* p = t.p + r * t.pld;
  if constexpr (RC > 5) {
    if (rest == 5) accumulate_rows<5, VC, V0, CODE, VPG>(acc, t.ld, p, t.pld, s, n, pf);
  }
  if constexpr (RC > 4) {
    if (rest == 4) accumulate_rows<4, VC, V0, CODE, VPG>(acc, t.ld, p, t.pld, s, n, pf);
  }
  if constexpr (RC > 3) {
    if (rest == 3) accumulate_rows<3, VC, V0, CODE, VPG>(acc, t.ld, p, t.pld, s, n, pf);
  }
  if (rest == 2) accumulate_rows<2, VC, V0, CODE, VPG>(acc, t.ld, p, t.pld, s, n, pf);
  if (rest == 1) accumulate_rows<1, VC, V0, CODE, VPG>(acc, t.ld, p, t.pld, s, n, pf);
  if constexpr (V0 + VC < NV) accumulate_chunk<NV, V0 + VC, CODE, VPG>(t, s, n, pf);
}

template <int NV, int CODE, int VPG>
inline void accumulate_all(const Tile& t, const Rows& s, int n, Prefetcher& pf) {
  accumulate_chunk<NV, 0, CODE, VPG>(t, s, n, pf);
}

// Group codes with 1, 2 or 4 vectors per group get their own instances.
template <int NV, int CODE>
inline void logits_groups(const Tile& t, const Rows& k, int n, Prefetcher& pf) {
  switch (k.group / W) {
    case 1: logits_all<NV, CODE, 1>(t, k, n, pf); break;
    case 2: logits_all<NV, CODE, 2>(t, k, n, pf); break;
    case 4: logits_all<NV, CODE, 4>(t, k, n, pf); break;
    default: logits_all<NV, CODE, 0>(t, k, n, pf); break;
  }
}

template <int NV, int CODE>
inline void accumulate_groups(const Tile& t, const Rows& s, int n, Prefetcher& pf) {
  switch (s.group / W) {
    case 1: accumulate_all<NV, CODE, 1>(t, s, n, pf); break;
    case 2: accumulate_all<NV, CODE, 2>(t, s, n, pf); break;
    case 4: accumulate_all<NV, CODE, 4>(t, s, n, pf); break;
    default: accumulate_all<NV, CODE, 0>(t, s, n, pf); break;
  }
}

template <int NV>
inline void logits_code(const Tile& t, const Rows& k, int n, Prefetcher& pf) {
  switch (k.code) {
    case C_F32: logits_all<NV, C_F32, 0>(t, k, n, pf); break;
    case C_F16: logits_all<NV, C_F16, 0>(t, k, n, pf); break;
    case C_BF16: logits_all<NV, C_BF16, 0>(t, k, n, pf); break;
    case C_I8: logits_all<NV, C_I8, 0>(t, k, n, pf); break;
    case C_FP8: logits_all<NV, C_FP8, 0>(t, k, n, pf); break;
    case C_U4C: logits_all<NV, C_U4C, 0>(t, k, n, pf); break;
    case C_U2C: logits_all<NV, C_U2C, 0>(t, k, n, pf); break;
    case C_U4G: logits_groups<NV, C_U4G>(t, k, n, pf); break;
    default: logits_groups<NV, C_U2G>(t, k, n, pf); break;
  }
}

template <int NV>
inline void accumulate_code(const Tile& t, const Rows& s, int n, Prefetcher& pf) {
  switch (s.code) {
    case C_F32: accumulate_all<NV, C_F32, 0>(t, s, n, pf); break;
    case C_F16: accumulate_all<NV, C_F16, 0>(t, s, n, pf); break;
    case C_BF16: accumulate_all<NV, C_BF16, 0>(t, s, n, pf); break;
    case C_I8: accumulate_all<NV, C_I8, 0>(t, s, n, pf); break;
    case C_FP8: accumulate_all<NV, C_FP8, 0>(t, s, n, pf); break;
    case C_U4C: accumulate_all<NV, C_U4C, 0>(t, s, n, pf); break;
    case C_U2C: accumulate_all<NV, C_U2C, 0>(t, s, n, pf); break;
    case C_U4G: accumulate_groups<NV, C_U4G>(t, s, n, pf); break;
    default: accumulate_groups<NV, C_U2G>(t, s, n, pf); break;
  }
}
#else
constexpr int logit_rows(int) { return 0; }
constexpr int value_rows(int) { return 0; }
#endif

// Prefetch pumps one head's attend_block makes (the kernels pump every few keys), so the
// next block's lines can be spread evenly over them.
inline int64_t attend_pumps(int rows, int n, int64_t ld) {
#ifdef KVS_SIMD
  const int nv = static_cast<int>(ld / W);
  if (!fast_width(nv)) return rows;  // logits_any: once per row
  const int rq = logit_rows(nv), rc = value_rows(nv);
  const int64_t logit_calls = rows == 1 ? 1 : (rows + rq - 1) / rq, kg = rows == 1 ? 8 : 4;
  return logit_calls * (n / kg) + (rows + rc - 1) / rc * (nv / kValueVectors) * ((n + 3) / 4);
#else
  (void)n;
  (void)ld;
  return rows;
#endif
}

// Any head_dim, float32 rows only (the decode pass made them): one row at a time.
inline void logits_any(const Tile& t, const Rows& k, int n, Prefetcher& pf) {
  for (int r = 0; r < t.rows; ++r) {
    const float* q = t.q + r * t.ld;
    pf.pump();
    for (int j = 0; j < n; ++j) {
      const float* kj = reinterpret_cast<const float*>(k.base + j * k.stride);
      float s = 0.0f;
      int64_t d = 0;
#ifdef KVS_SIMD
      vf a = vzero();
      for (; d < t.ld; d += W) a = vfma(vload(q + d), vload(kj + d), a);
      s = vhsum(a);
#endif
      for (; d < t.ld; ++d) s += q[d] * kj[d];
      t.p[r * t.pld + j] = s;
    }
  }
}

inline void accumulate_any(const Tile& t, const Rows& s, int n) {
  for (int r = 0; r < t.rows; ++r) {
    float* acc = t.acc + r * t.ld;
    const float* p = t.p + r * t.pld;
    for (int j = 0; j < n; ++j) {
      const float* vj = reinterpret_cast<const float*>(s.base + j * s.stride);
      int64_t d = 0;
#ifdef KVS_SIMD
      const vf pj = vset1(p[j]);
      for (; d < t.ld; d += W) vstore(acc + d, vfma(vload(vj + d), pj, vload(acc + d)));
#endif
      for (; d < t.ld; ++d) acc[d] += p[j] * vj[d];
    }
  }
}

// Softmax step of row r over its logits p[0 .. np) (entries past the visible keys -inf):
// p *= kscale; a new running max only when some logit exceeds the old one (then the sum and
// the accumulator are rescaled); p = 2^(p - max), added to the sum, then times vscale.
inline void softmax_row(const Tile& t, int r, float* p, int np, const float* kscale, const float* vscale) {
  float m = t.m[r];
  float* l = t.l + r * W;
#ifdef KVS_SIMD
  bool exceeds = false;
  const vf vm = vset1(m);
  for (int j = 0; j < np; j += W) {
    vf x = vload(p + j);
    if (kscale) {
      x = vmul(x, vload(kscale + j));
      vstore(p + j, x);
    }
    exceeds |= vany_gt(x, vm);
  }
  if (exceeds) {
    vf mx = vload(p);
    for (int j = W; j < np; j += W) mx = vmax(mx, vload(p + j));
    const float m_new = vhmax(mx);
    const float c = std::exp2(m - m_new);  // 0 for the first block (m = -inf)
    vstore(l, vmul(vload(l), vset1(c)));
    float* acc = t.acc + r * t.ld;
    const vf vc = vset1(c);
    for (int64_t d = 0; d < t.ld; d += W) vstore(acc + d, vmul(vload(acc + d), vc));
    m = t.m[r] = m_new;
  }
  const vf vmn = vset1(m);
  vf sum = vload(l);
  for (int j = 0; j < np; j += W) {
    const vf e = vexp2_neg(vsub(vload(p + j), vmn));
    sum = vadd(sum, e);
    vstore(p + j, vscale ? vmul(e, vload(vscale + j)) : e);
  }
  vstore(l, sum);
#else
  float mx = m;
  for (int j = 0; j < np; ++j) {
    if (kscale && p[j] != -std::numeric_limits<float>::infinity()) p[j] *= kscale[j];
    mx = std::max(mx, p[j]);
  }
  if (mx > m) {
    const float c = std::exp2(m - mx);
    l[0] *= c;
    for (int64_t d = 0; d < t.ld; ++d) t.acc[r * t.ld + d] *= c;
    m = t.m[r] = mx;
  }
  for (int j = 0; j < np; ++j) {
    const float e = std::exp2(p[j] - m);
    l[0] += e;
    p[j] = vscale ? e * vscale[j] : e;
  }
#endif
}

// The tile attends to keys key0 .. key0 + n - 1 (rows j of K and V, see Rows). Per-key
// scales hold finite values up to n rounded up to 16. `lg` (when given): each row's logits of
// its visible keys (log2 domain, key scales applied) are also written at lg[r * lgld + key0 + j],
// for the attention weights a caller sums afterwards (kernel.h, scores).
inline void attend_block(const Tile& t, const Rows& k, const Rows& v, int n, int64_t key0, Prefetcher& pf,
                         float* lg = nullptr, int64_t lgld = 0) {
  const int np = (n + 15) / 16 * 16;
  const int nv_max = static_cast<int>(std::min<int64_t>(n, t.visible[t.rows - 1] - key0));  // rows ascend
#ifdef KVS_SIMD
  switch (t.ld / W) {
    case 4: logits_code<4>(t, k, nv_max, pf); break;
    case 8: logits_code<8>(t, k, nv_max, pf); break;
    case 16: logits_code<16>(t, k, nv_max, pf); break;
    default: logits_any(t, k, nv_max, pf);
  }
#else
  logits_any(t, k, nv_max, pf);
#endif
  for (int r = 0; r < t.rows; ++r) {
    float* p = t.p + r * t.pld;
    const int64_t vis = std::min<int64_t>(n, t.visible[r] - key0);
    if (vis <= 0) {  // every key of the block lies after this row's query
      std::fill(p, p + np, 0.0f);
      continue;
    }
    const int nv = static_cast<int>(vis);
    const int lo = t.first ? static_cast<int>(std::clamp<int64_t>(t.first[r] - key0, 0, n)) : 0;
    if (lo >= nv) {  // every key of the block lies before this row's window
      std::fill(p, p + np, 0.0f);
      continue;
    }
    const float* kscale = k.scale;
    if (kscale && (nv < np || lo > 0 || lg)) {  // scale the visible keys here (-inf * a zero scale would be NaN)
      for (int j = lo; j < nv; ++j) p[j] *= kscale[j];
      kscale = nullptr;
    }
    if (lo > 0) std::fill(p, p + lo, -std::numeric_limits<float>::infinity());  // before the window
    if (nv < np) std::fill(p + nv, p + np, -std::numeric_limits<float>::infinity());  // mask the rest
    if (lg) std::copy(p, p + nv, lg + r * lgld + key0);
    softmax_row(t, r, p, np, kscale, v.scale);
  }
#ifdef KVS_SIMD
  switch (t.ld / W) {
    case 4: accumulate_code<4>(t, v, n, pf); return;
    case 8: accumulate_code<8>(t, v, n, pf); return;
    case 16: accumulate_code<16>(t, v, n, pf); return;
    default: accumulate_any(t, v, n);
  }
#else
  accumulate_any(t, v, n);
#endif
}

}  // namespace kvs

// Products with quantized weights read in place: y = x W^T for W in GGUF's blocks (Q4_0, Q4_1,
// Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K) or kvserve's int8 / int4 groups, never expanded into a
// float copy.
//
// Weights. A matrix's rows are cut into tiles of 16 rows; along K a tile is a run of blocks of
// 32 columns. For each (tile, block) the 16 x 32 codes are stored as 8 vectors of 64 bytes,
// vector j holding, for each row n of the tile, its codes 4j .. 4j+3 at bytes 4n .. 4n+3:
//
//     vector j:  | row 0: k=4j..4j+3 | row 1: k=4j..4j+3 | ... | row 15: k=4j..4j+3 |
//
// 4-bit codes pack two vectors in one (j in the low nibbles, j + 4 in the high ones: 256
// bytes); 8-bit codes are the 512 bytes as they are; Q6_K adds a 128-byte plane of its two
// high bits, the Q5 kinds a 64-byte plane of their fifth bits (byte x: vector j's at bit j).
// Scales and minimums are per tile and group, 16 lanes each. This is the GGUF
// file's own bits, moved (kvserve/model/formats/packing.py), so the bytes stay as few.
//
// Activations are quantized per row and half block of 16 to int8 with a float scale (llama.cpp's
// q8 formats use 32: halving it takes the rounding's cost in perplexity on SmolLM2 from about
// +0.5% to +0.2%), and each block's integer dot products run 4 codes per lane per instruction
// (VNNI's vpdpbusd, or AVX2's maddubs), all 16 rows of a tile at once, so no horizontal sum
// is ever taken: a lane is one output. Float work is per (row, tile, block): one or two fused
// multiply-adds. A row's result never depends on the other rows of the batch (tested).
//
// With AVX2 (no VNNI) a half block's products of unsigned codes are summed as int16 pairs, as
// maddubs leaves them, and widened to int32 once (exact, see Part in qvec.h).
//
// Decode (up to kMaxRows rows) unpacks each block and uses it for every row: up to kStreamRows
// rows (all of AVX2's, 7 of AVX-512's 8) take its codes pair of vectors by pair of vectors as
// they are unpacked, in registers (a whole unpacked block is 16 vectors, all the registers AVX2
// has: it spilled to the stack and was read back). Up to kRegroupRows rows (a verify step, a small batch) every group of kMaxRows rows
// does the same in turn; longer batches (prefill chunks) unpack a whole tile once into L1-sized
// scratch and run the rows over it kMaxRows at a time. Every path does the same integer sums and the same float operations in the same order,
// so a row's result never depends on its batch. Tiles are spread over the OpenMP threads
// (torch's runtime).
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "qvec.h"
#include "amx.h"
#include "rate.h"

namespace kvs {
namespace q {

enum Kind : int { Q4_0 = 0, Q4_1 = 1, Q8_0 = 2, Q4_K = 3, Q6_K = 4, Q5_0 = 5, Q5_1 = 6, Q5_K = 7 };
enum Prologue : int { NONE = 0, RMSNORM = 1, SWIGLU = 2, GEGLU = 3 };
constexpr int kLanes = 16;
constexpr int kBlock = 32;
constexpr int kSuper = 256;   // the K-quants' super-block
// How far ahead a decode product asks for its weights, and into which cache: with AVX-512 (an
// AMD EPYC Zen 4, 2 threads, Qwen2.5-1.5B's Q4_K / Q6_K products at one row) 32 blocks ahead into
// L2 streamed 6-10% faster than 16 into L1 in three runs of both (4 rows: 5%, 8 rows: the same);
// AVX2 keeps what was measured on its Zen 3 box.
#if KVS_W == 16
constexpr int64_t kPrefetchBlocks = 32;
constexpr int kPrefetchLocality = 2;   // prefetcht1
#else
constexpr int64_t kPrefetchBlocks = 16;
constexpr int kPrefetchLocality = 3;   // prefetcht0
#endif
#if KVS_W == 16
constexpr int kMaxRows = 8;
#else
constexpr int kMaxRows = 4;   // 16-lane values take two registers (or memory): fewer rows at once
#endif

constexpr int64_t code_bytes(int kind) { return kind == Q8_0 ? 512 : 256; }
// one scale (and minimum) per group of 32 x group_blocks columns; else the K-quants' super-blocks
constexpr bool is_grouped(int kind) {
  return kind == Q4_0 || kind == Q4_1 || kind == Q8_0 || kind == Q5_0 || kind == Q5_1;
}
// w = scale x code + min (the minimum multiplies the block's activation sum)
constexpr bool has_min(int kind) { return kind == Q4_1 || kind == Q4_K || kind == Q5_1 || kind == Q5_K; }
// bytes of the high-bit plane per (tile, block): Q6_K's two bits, the Q5 kinds' fifth bit
constexpr int64_t high_bytes(int kind) {
  return kind == Q6_K ? 128 : (kind == Q5_0 || kind == Q5_1 || kind == Q5_K) ? 64 : 0;
}
// what is taken off an unsigned code: w = scale x (code - offset)
constexpr int code_offset(int kind) { return kind == Q4_0 ? 8 : kind == Q5_0 ? 16 : kind == Q6_K ? 32 : 0; }

// One weight matrix's rows (several matrices sharing an input, such as Q, K and V, are
// segments of one Weight, each in its own format).
struct Segment {
  int kind = Q4_0;
  int64_t rows = 0, tiles = 0, K = 0;
  int64_t group_blocks = 1;              // grouped kinds: blocks of 32 per scale group
  int64_t col0 = 0;                      // first output column
  int64_t tile0 = 0;                     // first tile in the Weight's tile order (outlier rows)
  const uint8_t* codes = nullptr;        // [tiles][K/32][code_bytes]
  const uint8_t* high = nullptr;         // Q6_K, Q5_*: [tiles][K/32][high_bytes]
  const uint16_t* scale = nullptr;       // f16 [tiles][K/32/group_blocks][16]
  const uint16_t* min = nullptr;         // f16, Q4_1 / Q5_1
  const uint8_t* sub_scale = nullptr;    // Q4_K / Q5_K: u8 [tiles][K/32][16]; Q6_K: int8 [tiles][K/16][16]
  const uint8_t* sub_min = nullptr;      // Q4_K / Q5_K: u8 [tiles][K/32][16]
  const uint16_t* super_scale = nullptr; // Q4_K, Q5_K, Q6_K: f16 [tiles][K/256][16]
  const uint16_t* super_min = nullptr;   // Q4_K, Q5_K: f16 [tiles][K/256][16]
};

struct Weight {
  std::vector<Segment> segments;
  int64_t N = 0, K = 0, tiles = 0;
  const float* bias = nullptr;              // [N]
  int64_t num_outliers = 0;                 // input channels multiplied in float32, apart
  const int32_t* outlier_channels = nullptr;  // [num_outliers]
  const float* outlier_weight = nullptr;      // [tiles][num_outliers][16]
};

// The step's activations, quantized: per row, K int8 codes, a scale and the codes' sum per
// half block of 16, the dequantized sum per block of 32; the outlier channels' values apart.
struct Acts {
  int64_t M = 0, K = 0, KB = 0;
  bool amx = false;   // the tiles take this batch (q, d, s and isum by groups: row_start)
  std::vector<int8_t> q;
  std::vector<float> d, s, outl;
  std::vector<int32_t> isum;
};

// Where row m's values start in q, d, s and isum, in units of one row-block's values (32 codes,
// 2 scales, 1 sum, 2 code sums), and the units from one of its blocks to the next: row by row
// ([row][block]), or for AMX by groups of 16 rows and block, row by row ([group][block][row]; M
// rounded up to 16 rows, the missing ones zero), so that a block's codes are one run of 512
// bytes and its float steps find every row's scalars at fixed offsets.
inline int64_t row_start(const Acts& A, int64_t m) {
  return A.amx ? (m / kLanes * A.KB * kLanes + m % kLanes) : m * A.KB;
}
inline int64_t block_step(const Acts& A) { return A.amx ? kLanes : 1; }

// ---- activations --------------------------------------------------------------------

inline F16 silu_mul(const float* g, const float* u) { return fmul(silu16(load_f32(g)), load_f32(u)); }
inline F16 gelu_mul(const float* g, const float* u) { return fmul(gelu_tanh16(load_f32(g)), load_f32(u)); }

// Row m of x through the prologue into `y` (K floats), outlier channels moved to `outl`.
inline void transform_row(const float* x, int64_t K, int prologue, const float* norm, float eps, const Weight& W,
                          float* y, float* outl) {
  if (prologue == RMSNORM) {
    F16 ss = fzero();
    for (int64_t k = 0; k < K; k += kLanes) {
      const F16 v = load_f32(x + k);
      ss = ffma(v, v, ss);
    }
    const float inv = 1.0f / std::sqrt(hsum(ss) / static_cast<float>(K) + eps);
    const F16 vinv = fset1(inv);
    for (int64_t k = 0; k < K; k += kLanes) store_f32_all(y + k, fmul(load_f32(norm + k), fmul(load_f32(x + k), vinv)));
  } else if (prologue == SWIGLU) {
    for (int64_t k = 0; k < K; k += kLanes) store_f32_all(y + k, silu_mul(x + k, x + K + k));
  } else if (prologue == GEGLU) {
    for (int64_t k = 0; k < K; k += kLanes) store_f32_all(y + k, gelu_mul(x + k, x + K + k));
  } else {
    std::memcpy(y, x, sizeof(float) * K);
  }
  for (int64_t j = 0; j < W.num_outliers; ++j) {
    const int32_t c = W.outlier_channels[j];
    outl[j] = y[c];
    y[c] = 0.0f;
  }
}

// Per half block of 16: a scale d = amax / 127 and codes round(y 127 / amax); per block of
// 32 the sum of its dequantized activations (sum d x codes: what the minimum multiplies, so
// that a block's rounding errors meet the weights as stored, centered, not their codes). Block
// b's 32 codes go to q + b x qs, its two halves' scales and code sums to d, isum + b x ds, its
// sum to s + b x ss (a row's own arrays: 32, 2, 1; AMX's groups of 16 rows: see Acts).
inline void quantize_row(const float* y, int64_t K, int8_t* q, float* d, float* s, int32_t* isum,
                         int64_t qs = kBlock, int64_t ds = 2, int64_t ss = 1) {
  for (int64_t b = 0; b < K / kBlock; ++b) {
    float* db = d + b * ds;
    int32_t* ib = isum + b * ds;
    for (int h = 0; h < 2; ++h) {
      const F16 v = load_f32(y + b * kBlock + h * kLanes);
      const float amax = hmax(fabs16(v));
      db[h] = amax / 127.0f;
      ib[h] = quantize16(v, amax > 0.0f ? 127.0f / amax : 0.0f, q + b * qs + h * kLanes);
    }
    s[b * ss] = db[0] * static_cast<float>(ib[0]) + db[1] * static_cast<float>(ib[1]);
  }
}

// ---- one (tile, block) of weights, unpacked ----------------------------------------

struct Scales {
  F16 scale;   // per lane: grouped kinds the scale; Q4_K / Q5_K d x sc; Q6_K d
  F16 min;     // Q4_1 / Q5_1 the minimum; Q4_K / Q5_K -(dmin x m)
  I16 sc0, sc1;  // Q6_K: the two 16-column sub-blocks' integer scales
};

struct Prepared {
  Codes w[8];
  Scales sc;
};

// Vectors J and J + 4 of a (tile, block) as 8-bit codes: c its codes, hp the vectors of its
// high-bit plane (Q6_K two, the Q5 kinds one).
template <int KIND, int J>
inline void unpack_pair(const uint8_t* c, const Codes* hp, Codes& lo, Codes& hi) {
  if constexpr (KIND == Q8_0) {
    lo = load_codes(c + 64 * J);
    hi = load_codes(c + 64 * (J + 4));
  } else {
    const Codes packed = load_codes(c + 64 * J);
    lo = low_nibbles(packed);
    hi = high_nibbles(packed);
    if constexpr (KIND == Q6_K) {
      lo = with_high2<J>(lo, hp[0]);
      hi = with_high2<J>(hi, hp[1]);
    } else if constexpr (high_bytes(KIND) == 64) {
      lo = with_high1<J>(lo, hp[0]);
      hi = with_high1<J + 4>(hi, hp[0]);
    }
  }
}

template <int KIND>
inline void load_high(const Segment& s, int64_t tb, Codes* hp) {
  if constexpr (KIND == Q6_K) {
    hp[0] = load_codes(s.high + tb * 128);
    hp[1] = load_codes(s.high + tb * 128 + 64);
  } else if constexpr (high_bytes(KIND) == 64) {
    hp[0] = load_codes(s.high + tb * 64);
  }
}

template <int KIND>
inline void prepare_scales(const Segment& s, int64_t t, int64_t b, Scales& p) {
  const int64_t KB = s.K / kBlock;
  const int64_t tb = t * KB + b;
  if (is_grouped(KIND)) {
    const int64_t g = t * (KB / s.group_blocks) + b / s.group_blocks;
    p.scale = load_f16(s.scale + g * kLanes);
    if (has_min(KIND)) p.min = load_f16(s.min + g * kLanes);
  } else {
    const int64_t sup = t * (s.K / kSuper) + b / (kSuper / kBlock);
    const F16 d = load_f16(s.super_scale + sup * kLanes);
    if (KIND == Q4_K || KIND == Q5_K) {
      p.scale = fmul(d, load_u8f(s.sub_scale + tb * kLanes));
      p.min = fneg(fmul(load_f16(s.super_min + sup * kLanes), load_u8f(s.sub_min + tb * kLanes)));
    } else {
      p.scale = d;
      const int8_t* sc = reinterpret_cast<const int8_t*>(s.sub_scale) + (2 * tb) * kLanes;
      p.sc0 = load_s8i(sc);
      p.sc1 = load_s8i(sc + kLanes);
    }
  }
}

template <int KIND>
inline void prepare(const Segment& s, int64_t t, int64_t b, Prepared& p) {
  const int64_t tb = t * (s.K / kBlock) + b;
  const uint8_t* c = s.codes + tb * code_bytes(KIND);
  Codes hp[2];
  load_high<KIND>(s, tb, hp);
  unpack_pair<KIND, 0>(c, hp, p.w[0], p.w[4]);
  unpack_pair<KIND, 1>(c, hp, p.w[1], p.w[5]);
  unpack_pair<KIND, 2>(c, hp, p.w[2], p.w[6]);
  unpack_pair<KIND, 3>(c, hp, p.w[3], p.w[7]);
  prepare_scales<KIND>(s, t, b, p.sc);
}

// One activation row's integer products with a (tile, block)'s codes, pair by pair (add<J>
// with vectors J and J + 4): a0 over the block's first 16 columns, a1 over the rest. Unsigned
// codes' products stay Parts until a half's four pairs (Q6_K: two) are in.
template <int KIND>
struct Dots {
  I16 a0 = izero(), a1 = izero();
  Part p0 = pzero(), p1 = pzero();
  template <int J>
  inline void add(Codes lo, Codes hi, const int8_t* a) {
    if constexpr (KIND == Q8_0) {
      a0 = dot4_s(a0, lo, load_i32(a + 4 * J));
      a1 = dot4_s(a1, hi, load_i32(a + 16 + 4 * J));
    } else {
      p0 = pdot(p0, lo, load_i32(a + 4 * J));
      p1 = pdot(p1, hi, load_i32(a + 16 + 4 * J));
      if constexpr (J == 3 || (KIND == Q6_K && J == 1)) {
        a0 = iadd(a0, widen(p0));
        a1 = iadd(a1, widen(p1));
        p0 = pzero();
        p1 = pzero();
      }
    }
  }
};

// f += this block's share of one activation row from its integer products a0, a1: d2 the
// scales of the row's two halves, sa the sum of its dequantized values, is16 the codes' two
// half sums.
template <int KIND>
inline void finish(const Scales& p, I16 a0, I16 a1, const float* d2, float sa, const int32_t* is16, F16& f) {
  // the codes' integer offsets come off per half (Q4_0: 8, Q5_0: 16, Q6_K: 32, Q8_0 on VNNI: 128)
  if (KIND == Q4_0 || KIND == Q5_0) {
    a0 = isub_scalar(a0, code_offset(KIND) * is16[0]);
    a1 = isub_scalar(a1, code_offset(KIND) * is16[1]);
  } else if (KIND == Q8_0 && kSignedOffset) {
    a0 = isub_scalar(a0, kSignedOffset * is16[0]);
    a1 = isub_scalar(a1, kSignedOffset * is16[1]);
  } else if (KIND == Q6_K) {   // two 16-column sub-blocks, each its own integer scale
    a0 = imul(isub_scalar(a0, 32 * is16[0]), p.sc0);
    a1 = imul(isub_scalar(a1, 32 * is16[1]), p.sc1);
  }
  const F16 t = ffma(to_float(a1), fset1(d2[1]), fmul(to_float(a0), fset1(d2[0])));
  f = ffma(t, p.scale, f);
  if (has_min(KIND)) f = ffma(p.min, fset1(sa), f);
}

// A prepared block (its codes unpacked in memory) against one activation row.
template <int KIND>
inline void accumulate(const Prepared& p, const int8_t* a, const float* d2, float sa, const int32_t* is16, F16& f) {
  Dots<KIND> d;
  d.template add<0>(p.w[0], p.w[4], a);
  d.template add<1>(p.w[1], p.w[5], a);
  d.template add<2>(p.w[2], p.w[6], a);
  d.template add<3>(p.w[3], p.w[7], a);
  finish<KIND>(p.sc, d.a0, d.a1, d2, sa, is16, f);
}

// Pair J of a block unpacked in registers and used at once by each of MR rows.
template <int KIND, int J, int MR>
inline void stream_pair(const uint8_t* c, const Codes* hp, const int8_t* const* a, Dots<KIND>* d) {
  Codes lo, hi;
  unpack_pair<KIND, J>(c, hp, lo, hi);
  for (int r = 0; r < MR; ++r) d[r].template add<J>(lo, hi, a[r]);
}

// Rows a decode streams (each block's codes unpacked pair by pair in registers, no Prepared
// copy: with AVX2's 16 vector registers the 16 vectors of one spill to the stack and are read
// back). Measured with AVX2 (python -m kvserve.bench.qlinear --rows 1,2,3,4): Q4_K's batch-4
// products 19.1 -> 16.8 ms, Q6_K's 23.1 -> 18.8, against a block prepared once for the 4 rows.
// With AVX-512 up to 7 rows (8 rows' Dots alone take the 32 registers): Qwen2.5-0.5B's layer
// products, the two paths interleaved in one process (Zen 4, 2 threads), Q4_K / Q6_K 1 row
// 4-13% / 1-2% faster, 3-4 rows 14-16%, 5-7 rows 1-13%, a 9-row step's last row 9-10%; 8 rows
// streamed were 2-6% slower for Q4_K.
constexpr int kStreamRows = KVS_W == 8 ? kMaxRows : kMaxRows - 1;

inline void store_row(const Weight& W, const Segment& s, int64_t t, const Acts& A, int64_t m, F16 f, float* out,
                      int64_t ldo, bool add) {
  const int64_t col = s.col0 + t * kLanes;
  const int n = static_cast<int>(std::min<int64_t>(kLanes, s.rows - t * kLanes));
  const int64_t gt = s.tile0 + t;
  for (int64_t j = 0; j < W.num_outliers; ++j)
    f = ffma(load_f32(W.outlier_weight + (gt * W.num_outliers + j) * kLanes), fset1(A.outl[m * W.num_outliers + j]), f);
  if (W.bias != nullptr) {
    float b[kLanes] = {};
    std::memcpy(b, W.bias + col, sizeof(float) * n);
    f = fadd(f, load_f32(b));
  }
  float* o = out + m * ldo + col;
  if (add) add_store_f32(o, f, n);
  else store_f32(o, f, n);
}

// Rows m0 .. m0+MR-1 of one tile; `pre` holds the tile's prepared blocks (or is null: each
// block is prepared here, in registers).
template <int KIND, int MR>
inline void tile_rows(const Weight& W, const Segment& s, int64_t t, const Acts& A, int64_t m0, const Prepared* pre,
                      float* out, int64_t ldo, bool add) {
  F16 f[MR];
  for (int r = 0; r < MR; ++r) f[r] = fzero();
  const int64_t KB = A.KB;
  for (int64_t b = 0; b < KB; ++b) {
    Prepared local;
    if (pre == nullptr) {
      // the weights stream from memory once: ask for them kPrefetchBlocks ahead (a tile's
      // blocks and the next tile's follow each other in every plane; a prefetch never faults)
      const int64_t ahead = t * KB + b + kPrefetchBlocks;
      const uint8_t* c = s.codes + ahead * code_bytes(KIND);
      for (int64_t off = 0; off < code_bytes(KIND); off += 64) __builtin_prefetch(c + off, 0, kPrefetchLocality);
      const uint8_t* h = s.high + ahead * high_bytes(KIND);
      for (int64_t off = 0; off < high_bytes(KIND); off += 64) __builtin_prefetch(h + off, 0, kPrefetchLocality);
      if (s.scale != nullptr) __builtin_prefetch(s.scale + (ahead / s.group_blocks) * kLanes, 0, kPrefetchLocality);
      if (s.min != nullptr) __builtin_prefetch(s.min + (ahead / s.group_blocks) * kLanes, 0, kPrefetchLocality);
      if (s.sub_scale != nullptr)
        __builtin_prefetch(s.sub_scale + ahead * kLanes * (KIND == Q6_K ? 2 : 1), 0, kPrefetchLocality);
      if constexpr (MR <= kStreamRows) {
        const int64_t tb = t * KB + b;
        Scales sc;
        prepare_scales<KIND>(s, t, b, sc);
        Codes hp[2];
        load_high<KIND>(s, tb, hp);
        const uint8_t* codes = s.codes + tb * code_bytes(KIND);
        const int8_t* a[MR];
        for (int r = 0; r < MR; ++r) a[r] = A.q.data() + (m0 + r) * A.K + b * kBlock;
        Dots<KIND> d[MR];
        stream_pair<KIND, 0, MR>(codes, hp, a, d);
        stream_pair<KIND, 1, MR>(codes, hp, a, d);
        stream_pair<KIND, 2, MR>(codes, hp, a, d);
        stream_pair<KIND, 3, MR>(codes, hp, a, d);
        for (int r = 0; r < MR; ++r) {
          const int64_t m = m0 + r;
          finish<KIND>(sc, d[r].a0, d[r].a1, A.d.data() + m * 2 * KB + 2 * b, A.s[m * KB + b],
                       A.isum.data() + m * 2 * KB + 2 * b, f[r]);
        }
        continue;
      }
      prepare<KIND>(s, t, b, local);
    }
    const Prepared& p = pre == nullptr ? local : pre[b];
    for (int r = 0; r < MR; ++r) {
      const int64_t m = m0 + r;
      accumulate<KIND>(p, A.q.data() + m * A.K + b * kBlock, A.d.data() + m * 2 * KB + 2 * b, A.s[m * KB + b],
                       A.isum.data() + m * 2 * KB + 2 * b, f[r]);
    }
  }
  for (int r = 0; r < MR; ++r) store_row(W, s, t, A, m0 + r, f[r], out, ldo, add);
}

template <int KIND>
inline void rows_of_tile(const Weight& W, const Segment& s, int64_t t, const Acts& A, int64_t m0, int64_t mr,
                         const Prepared* pre, float* out, int64_t ldo, bool add) {
  switch (mr) {
    case 1: return tile_rows<KIND, 1>(W, s, t, A, m0, pre, out, ldo, add);
    case 2: return tile_rows<KIND, 2>(W, s, t, A, m0, pre, out, ldo, add);
    case 3: return tile_rows<KIND, 3>(W, s, t, A, m0, pre, out, ldo, add);
    case 4: return tile_rows<KIND, 4>(W, s, t, A, m0, pre, out, ldo, add);
#if KVS_W == 16
    case 5: return tile_rows<KIND, 5>(W, s, t, A, m0, pre, out, ldo, add);
    case 6: return tile_rows<KIND, 6>(W, s, t, A, m0, pre, out, ldo, add);
    case 7: return tile_rows<KIND, 7>(W, s, t, A, m0, pre, out, ldo, add);
    case 8: return tile_rows<KIND, 8>(W, s, t, A, m0, pre, out, ldo, add);
#endif
    default: throw std::logic_error("rows_of_tile: bad row count");
  }
}

// Up to this many rows, groups of kMaxRows each take the tile's blocks as a decode does
// (unpacked in registers; after the first group the tile's weights come from L1 / L2) rather
// than unpacking the tile once into scratch and reading it back for every group: the same bits,
// and faster at a verify step's or a small batch's row counts. Measured over four of
// Qwen2.5-1.5B's layers (Q4_K, Q6_K; 2 threads, AMD EPYC Zen 4), interleaved: AVX-512 9-16 rows
// 19-22% faster, 17-24 10%, 32 6%, 48 the same; the AVX2 build on that CPU 5-16 rows 8-29%
// faster, 24 5%, 32 the same, 48 1% slower.
constexpr int64_t kRegroupRows = 4 * kMaxRows;
// From this many rows a batch takes AMX's tiles where the CPU has them (amx.h). Measured on an
// Intel Xeon with AMX (2 threads, python -m kvserve.bench.qlinear: Qwen2.5-0.5B's layer
// products, both paths in the same repeats): 512 rows Q4_K 1.24x, Q6_K 1.23x, Q8_0 1.16x; 64
// rows 0.99-1.10x; an ad hoc run at 16-32 rows 0.83-1.05x (a half block's product on the tile
// unit, its sums stored and read back, costs about what the vector unit's four instructions a
// row do).
constexpr int64_t kAmxRows = 64;

#if defined(KVS_Q_AMX)
// One block's float steps for 16 rows from their integer sums s0, s1 (row r at 16 r), in the
// order every other path takes them (finish), so the bits are theirs.
template <int KIND>
inline void finish_rows(const Acts& A, int64_t g, int64_t b, const Scales& sc, const int32_t* s0, const int32_t* s1,
                        F16* f) {
  const int64_t at = row_start(A, g * kLanes) + b * block_step(A);
  const float* gd = A.d.data() + 2 * at;
  const float* gs = A.s.data() + at;
  const int32_t* gi = A.isum.data() + 2 * at;
#pragma GCC unroll 16
  for (int r = 0; r < kLanes; ++r) {
    I16 a0 = {_mm512_load_si512(s0 + r * kLanes)}, a1 = {_mm512_load_si512(s1 + r * kLanes)};
    if constexpr (KIND == Q8_0) {   // signed by signed: the offset finish takes off is not in
      a0 = isub_scalar(a0, -kSignedOffset * gi[2 * r]);
      a1 = isub_scalar(a1, -kSignedOffset * gi[2 * r + 1]);
    }
    finish<KIND>(sc, a0, a1, gd + 2 * r, gs[r], gi + 2 * r, f[r]);
  }
}

// Every row of a tile through AMX (amx.h), 16 rows at a time (the last group padded with zero
// rows, whose results no output takes). Two blocks are in flight: block b + 1's products start
// before block b's are stored and take their float steps.
template <int KIND>
inline void tile_rows_amx(const Weight& W, const Segment& s, int64_t t, const Acts& A, const Prepared* pre,
                          float* out, int64_t ldo, bool add) {
  constexpr bool kSigned = KIND == Q8_0;
  alignas(64) int32_t sums[2][2][kLanes * kLanes];   // [pair][half][row x 16 + lane]
  const int64_t KB = A.KB;
  const auto codes = [&](int64_t b) { return reinterpret_cast<const uint8_t*>(pre[b].w); };
  for (int64_t m0 = 0; m0 < A.M; m0 += kLanes) {
    F16 f[kLanes];
    for (int r = 0; r < kLanes; ++r) f[r] = fzero();
    const int64_t g = m0 / kLanes;
    const int8_t* a = A.q.data() + row_start(A, m0) * kBlock;   // block b at a + b x 512
    amx::issue<kSigned, 0>(a, kBlock, codes(0));
    for (int64_t b = 0; b < KB; b += 2) {   // even blocks in pair 0, odd in pair 1
      if (b + 1 < KB) amx::issue<kSigned, 1>(a + (b + 1) * kLanes * kBlock, kBlock, codes(b + 1));
      amx::collect<0>(sums[0][0], sums[0][1]);
      finish_rows<KIND>(A, g, b, pre[b].sc, sums[0][0], sums[0][1], f);
      if (b + 1 >= KB) break;
      if (b + 2 < KB) amx::issue<kSigned, 0>(a + (b + 2) * kLanes * kBlock, kBlock, codes(b + 2));
      amx::collect<1>(sums[1][0], sums[1][1]);
      finish_rows<KIND>(A, g, b + 1, pre[b + 1].sc, sums[1][0], sums[1][1], f);
    }
    // every index a constant (the rows unrolled), so that f stays in registers
#pragma GCC unroll 16
    for (int r = 0; r < kLanes; ++r)
      if (m0 + r < A.M) store_row(W, s, t, A, m0 + r, f[r], out, ldo, add);
  }
}
#endif

template <int KIND>
inline void run_tile(const Weight& W, const Segment& s, int64_t t, const Acts& A, std::vector<Prepared>& scratch,
                     float* out, int64_t ldo, bool add) {
  const Prepared* pre = nullptr;   // up to kRegroupRows: each group unpacks the blocks in registers
  if (A.M > kRegroupRows || A.amx) {
    scratch.resize(static_cast<size_t>(A.KB));
    for (int64_t b = 0; b < A.KB; ++b) prepare<KIND>(s, t, b, scratch[b]);
    pre = scratch.data();
  }
#if defined(KVS_Q_AMX)
  if (A.amx) return tile_rows_amx<KIND>(W, s, t, A, pre, out, ldo, add);
#endif
  for (int64_t m0 = 0; m0 < A.M; m0 += kMaxRows)
    rows_of_tile<KIND>(W, s, t, A, m0, std::min<int64_t>(kMaxRows, A.M - m0), pre, out, ldo, add);
}

inline void run_tile_any(const Weight& W, const Segment& s, int64_t t, const Acts& A, std::vector<Prepared>& scratch,
                         float* out, int64_t ldo, bool add) {
  switch (s.kind) {
    case Q4_0: return run_tile<Q4_0>(W, s, t, A, scratch, out, ldo, add);
    case Q4_1: return run_tile<Q4_1>(W, s, t, A, scratch, out, ldo, add);
    case Q8_0: return run_tile<Q8_0>(W, s, t, A, scratch, out, ldo, add);
    case Q4_K: return run_tile<Q4_K>(W, s, t, A, scratch, out, ldo, add);
    case Q6_K: return run_tile<Q6_K>(W, s, t, A, scratch, out, ldo, add);
    case Q5_0: return run_tile<Q5_0>(W, s, t, A, scratch, out, ldo, add);
    case Q5_1: return run_tile<Q5_1>(W, s, t, A, scratch, out, ldo, add);
    case Q5_K: return run_tile<Q5_K>(W, s, t, A, scratch, out, ldo, add);
    default: throw std::logic_error("unknown weight kind");
  }
}

// out[M, N] (row stride ldo) = (or +=, with `add`) prologue(x)[M, K] W^T + bias + outliers.
// x has row stride ldx (2K columns are read for SWIGLU and GEGLU: gate then up).
inline void linear(const Weight& W, const float* x, int64_t M, int64_t ldx, int prologue, const float* norm, float eps,
                   float* out, int64_t ldo, bool add) {
  static thread_local Acts caller_acts;   // grows to the largest batch, then is reused
  Acts& A = caller_acts;                  // (named here: inside the parallel region the
                                          // thread_local itself would be each thread's own)
  const int64_t K = W.K, KB = K / kBlock;
  A.M = M;
  A.K = K;
  A.KB = KB;
  A.amx = M >= kAmxRows && amx::enabled();
  const int64_t held = A.amx ? (M + kLanes - 1) / kLanes * kLanes : M;   // the tiles read 16 rows at once
  A.q.resize(static_cast<size_t>(held * K));
  A.d.resize(static_cast<size_t>(held * 2 * KB));
  A.s.resize(static_cast<size_t>(held * KB));
  A.isum.resize(static_cast<size_t>(held * 2 * KB));
  const int64_t step = block_step(A);
  A.outl.resize(static_cast<size_t>(M * W.num_outliers));
  // tile index -> (segment, tile): segments are few, so a linear walk per item is cheap
  const int64_t items = W.tiles;
  const int threads = std::max(1, omp_get_max_threads());
  const int use = static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(items, M)));
#pragma omp parallel num_threads(use)
  {
    static thread_local std::vector<float> row;
    static thread_local std::vector<Prepared> scratch;
    row.resize(static_cast<size_t>(K));
    if (A.amx) amx::configure();
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
      transform_row(x + m * ldx, K, prologue, norm, eps, W, row.data(), A.outl.data() + m * W.num_outliers);
      const int64_t at = row_start(A, m);
      quantize_row(row.data(), K, A.q.data() + at * kBlock, A.d.data() + 2 * at, A.s.data() + at,
                   A.isum.data() + 2 * at, step * kBlock, 2 * step, step);
    }
#pragma omp for schedule(static)
    for (int64_t m = M; m < held; ++m)   // AMX's last group's missing rows
      for (int64_t b = 0, at = row_start(A, m); b < KB; ++b, at += step) {
        std::memset(A.q.data() + at * kBlock, 0, kBlock);
        A.d[2 * at] = A.d[2 * at + 1] = A.s[at] = 0.0f;
        A.isum[2 * at] = A.isum[2 * at + 1] = 0;
      }
#pragma omp for schedule(static)
    for (int64_t it = 0; it < items; ++it) {
      size_t si = 0;
      while (it >= W.segments[si].tile0 + W.segments[si].tiles) ++si;
      const Segment& s = W.segments[si];
      run_tile_any(W, s, it - s.tile0, A, scratch, out, ldo, add);
    }
    if (A.amx) amx::release();
  }
}

// ---- the box's integer peak (benchmarks) --------------------------------------------------

// Multiply-adds a second of the products' 4-product instruction (pdot: VNNI's vpdpbusd, 64 a
// call; AVX2's maddubs pair and adds) on every OpenMP thread, from registers: 8 independent
// accumulator chains a thread, each call's activations broadcast from memory as the kernel's
// are (so none is loop-invariant), `iters` rounds. The ceiling a product's arithmetic is held to.
inline double int8_peak(int64_t iters) {
  constexpr int kChains = 8;
  return every_thread_rate(static_cast<double>(iters) * kChains * kLanes * 4, [iters]() -> int64_t {
    alignas(64) uint8_t bytes[64];
    for (int i = 0; i < 64; ++i) bytes[i] = static_cast<uint8_t>(i * 7 + omp_get_thread_num());
    const Codes w = load_codes(bytes);
    alignas(64) int8_t acts[256];
    for (int i = 0; i < 256; ++i) acts[i] = static_cast<int8_t>(i * 13 - 100);
    Part p[kChains];
    for (int k = 0; k < kChains; ++k) p[k] = pzero();
    for (int64_t i = 0; i < iters; ++i) {
      const int8_t* a = acts + (i & 7) * 32;
#pragma GCC unroll 8
      for (int k = 0; k < kChains; ++k) p[k] = pdot(p[k], w, load_i32(a + 4 * k));
    }
    I16 total = widen(p[0]);
    for (int k = 1; k < kChains; ++k) total = iadd(total, widen(p[k]));
    alignas(64) float lanes[kLanes];
    store_f32_all(lanes, to_float(total));
    return static_cast<int64_t>(lanes[0]);
  });
}

// ---- dequantization (embedding rows, tests): the same values the products use ----------

inline float dequant_value(const Segment& s, int64_t row, int64_t k) {
  const int64_t KB = s.K / kBlock, t = row / kLanes, lane = row % kLanes, b = k / kBlock, kk = k % kBlock;
  const int64_t tb = t * KB + b, j = kk / 4, byte = 4 * lane + kk % 4;
  int32_t c;
  if (s.kind == Q8_0) {
    c = static_cast<int8_t>(s.codes[tb * 512 + 64 * j + byte]);
  } else {
    c = (s.codes[tb * 256 + 64 * (j % 4) + byte] >> (4 * (j / 4))) & 15;
    if (s.kind == Q6_K) c |= ((s.high[tb * 128 + 64 * (j / 4) + byte] >> (2 * (j % 4))) & 3) << 4;
    if (high_bytes(s.kind) == 64) c |= ((s.high[tb * 64 + byte] >> j) & 1) << 4;
  }
  if (is_grouped(s.kind)) {
    const int64_t g = t * (KB / s.group_blocks) + b / s.group_blocks;
    const float d = f16_to_f32(s.scale[g * kLanes + lane]);
    if (s.kind == Q8_0) return d * static_cast<float>(c);
    if (!has_min(s.kind)) return d * static_cast<float>(c - code_offset(s.kind));
    return d * static_cast<float>(c) + f16_to_f32(s.min[g * kLanes + lane]);
  }
  const int64_t sup = t * (s.K / kSuper) + b / (kSuper / kBlock);
  const float d = f16_to_f32(s.super_scale[sup * kLanes + lane]);
  if (s.kind == Q4_K || s.kind == Q5_K) {
    const float sc = d * static_cast<float>(s.sub_scale[tb * kLanes + lane]);
    const float mn = f16_to_f32(s.super_min[sup * kLanes + lane]) * static_cast<float>(s.sub_min[tb * kLanes + lane]);
    return sc * static_cast<float>(c) - mn;
  }
  const int8_t sc = reinterpret_cast<const int8_t*>(s.sub_scale)[(2 * tb + kk / 16) * kLanes + lane];
  return (d * static_cast<float>(sc)) * static_cast<float>(c - 32);
}

inline void dequant_row(const Weight& W, int64_t n, float* out) {
  size_t si = 0;
  while (n >= W.segments[si].col0 + W.segments[si].rows) ++si;
  const Segment& s = W.segments[si];
  for (int64_t k = 0; k < W.K; ++k) out[k] = dequant_value(s, n - s.col0, k);
}

}  // namespace q
}  // namespace kvs

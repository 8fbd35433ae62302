// The CPU paged attention kernel without torch: plan the work, run it over OpenMP.
//
// Work items are (sequence, query tile, chunk of KV heads, context split). An item walks its
// blocks in order and reads each block's parts for all its heads at once (contiguous in the
// pool), prefetching the next block while it works, since blocks lie in random order. Rows
// of a tile are (query, query head of the KV head's group): the `group` heads sharing a KV
// head use each decoded K/V row once, and a prefill chunk reuses each decoded block for all
// of the tile's queries (up to kMaxRows rows over the item's heads). Long contexts are split
// (split-K) so a single sequence still keeps every core busy; splits leave (max, sum,
// accumulator) partials that a second pass merges. Items are handed out dynamically over
// OpenMP (the runtime torch itself uses: same libgomp, so no second thread pool).
//
//   sequence s, tile t:  keys 0 ........................ nkeys-1      (nkeys = last query pos + 1)
//                        | split 0 | split 1 | ... | split n-1 |      each a run of whole blocks
//
// A sequence's n queries are its last n positions (len - n + i), or, with query positions
// (`qpos`), any ascending positions ending at len - 1: a prefill with gaps (a blend's rows,
// kvserve/attention/batch.py), each query seeing the keys up to its own position. A sliding
// window W (`window` > 0: a sliding-window layer) hides the keys more than W - 1 positions
// before the query; blocks and splits no row of an item sees are never read:
//
//   query at p:  keys 0 ... p-W | p-W+1 ........ p        splits wholly left of the tile's
//                   (skipped)   |  (attended, W keys)     first row's window are not planned
#pragma once

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "attend.h"
#include "dequant.h"

namespace kvs {

constexpr int kMaxRows = 128;         // query rows per item (acc + q: 2 x 64 KiB at head_dim 128)
// Contexts are split (split-K) at every kSplitKeys keys, counted from the first key: where a
// split ends depends on nothing but the key's position, so a query's result is the same
// whatever else is in the batch and however its prompt was cut into chunks (a prefix-cache
// hit gives exactly the cold run's output; quantized weights, which round activations to int8,
// would otherwise turn last-bit differences into different tokens).
constexpr int64_t kSplitKeys = 256;
// With query positions, a tile ends where the next query lies more than kTileGap positions
// past the one before it: every row of a tile attends to the keys up to its last row (the rest
// masked), so a tile spanning a gap would compute its first rows over the gap's keys for nothing
// (a blend's rows: a few at each document's start and end, hundreds of positions apart).
constexpr int64_t kTileGap = 32;

// Throws std::invalid_argument (pybind11 raises ValueError); the message is only built on failure.
#define KVS_REQUIRE(ok, msg)                                  \
  do {                                                    \
    if (!(ok)) throw std::invalid_argument(std::string(msg)); \
  } while (0)

namespace detail {

struct Group {  // (sequence, query tile, KV heads [h0, h1)): one run over the context
  int64_t s, q0, q1, h0, h1, nkeys, nblocks, chunk, splits;
  int64_t kb_first = 0;  // the first block a row of the tile sees (a sliding window's)
  int64_t split0 = 0;    // the split holding it: splits before it are not planned
  int64_t lg = -1;    // scored groups: offset of their rows' logits [heads][rows][nkeys] (else -1)
  int64_t norm = -1;  // ... and of each row's final (max, sum)
};
struct Item {
  int64_t group, split, partial;  // partial: offset of its (m, l, acc) in the scratch, or -1 (final)
};

struct Batch {
  const int32_t* tables;
  int64_t max_blocks;
  const int32_t* lens;
  const int32_t* starts;
  const int32_t* open;
  int64_t B, group, Hq, D, ld;
  float scale_log2;
  // attention weights (optional): scores[s][h][j] += the weight key j gets from every query i >=
  // score_from[s] of sequence s and every query head of KV head h
  float* scores = nullptr;
  const int32_t* score_from = nullptr;
  int64_t score_ld = 0;
  const int32_t* qpos = nullptr;   // [T] each query's position (optional; see the top of this file)
  int64_t window = 0;              // a sliding window's keys (0: every key up to the query)
};

// Keys query i of sequence s (n queries, len context tokens) sees: those up to its position.
inline int64_t visible_keys(const Batch& b, int64_t s, int64_t n, int64_t len, int64_t i) {
  return b.qpos != nullptr ? int64_t{b.qpos[b.starts[s] + i]} + 1 : len - n + i + 1;
}

// The first key it sees: its window's (else key 0).
inline int64_t first_key(const Batch& b, int64_t s, int64_t n, int64_t len, int64_t i) {
  return b.window > 0 ? std::max<int64_t>(0, visible_keys(b, s, n, len, i) - b.window) : 0;
}

inline bool in_residual(const HalfView& v, const Batch& b, int64_t s, int64_t kb) {
  const int64_t len = b.lens[s];
  return v.residual && b.open[s] >= 0 && len % b.B && kb == (len - 1) / b.B;
}

// The view a block of a half is stored in, and (in `block`) where: its finer copy when it has one.
inline const HalfView& stored(const HalfView& v, int64_t& block) {
  if (v.fine != nullptr && v.side[block] >= 0) {
    block = v.side[block];
    return *v.fine;
  }
  return v;
}

// Block kb of sequence s, head h of a half: read in place when the layout and the tile's
// `rows` allow it (see attend.h), else decoded to float32 rows.
inline Rows rows_of(const HalfView& v, int side, const Batch& b, int64_t s, int64_t kb, int64_t h, int n, int rows,
                    HalfBuffers& hb, Prefetcher& pf) {
  const int limit = side == KEY ? logit_rows(static_cast<int>(b.ld / W)) : value_rows(static_cast<int>(b.ld / W));
  const bool convert = rows <= limit;
  if (in_residual(v, b, s, kb)) {
    const int64_t es = dtype_size(v.residual_dtype);
    if (v.D % 16 == 0 && !v.rotated && (v.residual_dtype == F32 || convert)) {
      Rows r;
      r.base = v.residual + ((b.open[s] * v.B) * v.H + h) * v.D * es;
      r.stride = v.H * v.D * es;
      r.code = v.residual_dtype == F32 ? C_F32 : v.residual_dtype == F16 ? C_F16 : C_BF16;
      return r;
    }
    decode_residual(v, b.open[s], h, n, hb.x, b.ld, pf);
    return Rows{reinterpret_cast<const uint8_t*>(hb.x), b.ld * 4, C_F32};
  }
  int64_t block = b.tables[s * b.max_blocks + kb];
  const HalfView& u = stored(v, block);
  if (u.rotated != v.rotated) {  // a finer copy in the other domain: decoded, then rotated into v's
    const Rows r = decode_block(u, block, h, n, b.ld, hb, pf);
    for (int j = 0; j < n; ++j) fwht(hb.x + j * b.ld, static_cast<int>(v.D));
    return r;
  }
  const Rows r = rows_in_place(u, block, h, n, convert, hb);
  if (r.code >= 0) return r;
  return decode_block(u, block, h, n, b.ld, hb, pf);
}

// Whether rows_of decodes an encoded block of this half for a tile of `rows` rows.
inline bool decodes_block(const HalfView& v, int side, const Batch& b, int64_t rows) {
  if (v.num_outliers || v.D % 16) return true;
  if (v.kind == PLAIN && v.dtype == F32) return false;
  const int limit = side == KEY ? logit_rows(static_cast<int>(b.ld / W)) : value_rows(static_cast<int>(b.ld / W));
  return rows > limit || (v.kind == ASYM_TOKEN && v.group % W);
}

// Add heads [h0, h1) of block kb of both halves to what `pf` prefetches (the parameters come
// with the item's first head `first`); `far`: into L2 (the far stream: blocks lie in random
// order, so the hardware prefetchers cannot find them; L1 gets them later, a head or a block
// ahead). A residual row is one per sequence: not worth it.
inline void queue(Prefetcher& pf, const HalfView& K, const HalfView& V, const Batch& b, int64_t s, int64_t kb,
                  int64_t h0, int64_t h1, int64_t first, bool far = false) {
  for (const HalfView* v : {&K, &V}) {
    if (in_residual(*v, b, s, kb)) continue;
    int64_t block = b.tables[s * b.max_blocks + kb];
    const HalfView& u = stored(*v, block);
    if (h0 == 0 && h1 == u.H) {
      add_block(pf, u, block, far);
      continue;
    }
    for (int64_t h = h0; h < h1; ++h) add_head_rows(pf, u, block, h, far);
    if (h0 == first) add_params(pf, u, block, far);
  }
}

// Bytes of one block of a half, all heads; where the half has a finer format, the larger of
// the two (a prefetch distance must fit either: a zip block read from int8 is 2.4x its KIVI-2 base).
inline int64_t block_bytes(const HalfView& v) {
  int64_t params = 0;
  if (v.kind == INT8 || v.kind == FP8) params = v.B * v.H;
  if (v.kind == ASYM_TOKEN) params = v.B * v.H * (v.D / v.group);
  if (v.kind == ASYM_CHANNEL) params = v.H * v.D;
  const int64_t bytes = v.B * v.H * (v.row_bytes + 2 * v.num_outliers) + 2 * params * (v.zero ? 2 : 1) +
                        v.H * v.num_outliers;
  return v.fine != nullptr ? std::max(bytes, block_bytes(*v.fine)) : bytes;
}

// How far ahead to prefetch: about this many bytes (more evicts L1 lines before their use).
constexpr int64_t kPrefetchBytes = 12 * 1024;
// How far ahead the far stream asks for whole blocks into L2.
constexpr int64_t kFarBytes = 96 * 1024;

// out rows of head h (a tile of `rows` = queries x group rows) = acc / l, rotated back if
// the values were read in the rotated domain.
inline void write_rows(const Batch& b, const Group& g, int64_t h, const float* acc, const float* l, const HalfView& V,
                float* out) {
  for (int64_t i = g.q0; i < g.q1; ++i) {
    for (int64_t k = 0; k < b.group; ++k) {
      const int64_t r = (i - g.q0) * b.group + k;
      float* dst = out + ((b.starts[g.s] + i) * b.Hq + h * b.group + k) * b.D;
      const float inv = 1.0f / l[r];
      for (int64_t d = 0; d < b.D; ++d) dst[d] = acc[r * b.ld + d] * inv;
      if (V.rotated) fwht(dst, static_cast<int>(b.D));
    }
  }
}

struct ScoreTask {  // (sequence, KV head): its scores row, summed from the groups that hold it
  int64_t s, h;
  std::vector<int64_t> groups;
};

struct Plan {
  std::vector<Group> groups;
  std::vector<Item> items;
  int64_t scratch = 0;  // floats of partial results
  int64_t max_rows = 1;  // rows of the largest item (all its heads)
  int64_t logits = 0;    // floats of scored groups' logits, then of their rows' (max, sum)
  std::vector<ScoreTask> score_tasks;
};

// Validate each sequence; cut its queries into tiles and its KV heads into chunks so that a
// tile has at most kMaxRows rows; split long contexts every kSplitKeys keys.
inline Plan make_plan(const Batch& b, const HalfView& K, const HalfView& V, int64_t S, int64_t T) {
  Plan plan;
  const int64_t H = K.H, B = b.B;
  KVS_REQUIRE(b.starts[0] >= 0, "query_starts[0] must be >= 0");
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = b.starts[s + 1] - b.starts[s], len = b.lens[s];
    const auto seq = [s] { return "sequence " + std::to_string(s) + ": "; };
    KVS_REQUIRE(n >= 0 && b.starts[s + 1] <= T, seq() + "query_starts must be non-decreasing and within q's rows");
    if (n == 0) continue;
    KVS_REQUIRE(n <= len, seq() + std::to_string(n) + " queries but only " + std::to_string(len) + " context tokens");
    const int64_t nblocks = (len + B - 1) / B;
    KVS_REQUIRE(nblocks <= b.max_blocks, seq() + "context needs " + std::to_string(nblocks) + " blocks, the table holds " +
                                         std::to_string(b.max_blocks));
    for (int64_t kb = 0; kb < nblocks; ++kb) {
      const int64_t id = b.tables[s * b.max_blocks + kb];
      KVS_REQUIRE(id >= 0 && id < K.num_blocks && id < V.num_blocks, seq() + "block id " + std::to_string(id) +
                                                                     " is outside the cache");
      for (const HalfView* v : {&K, &V}) {
        KVS_REQUIRE(!v->fine || v->side[id] < v->fine->num_blocks, seq() + "block " + std::to_string(id) +
                                                                      "'s side slot is outside the side pool");
      }
    }
    if (b.qpos != nullptr) {
      const int32_t* p = b.qpos + b.starts[s];
      KVS_REQUIRE(p[n - 1] == len - 1, seq() + "its last query must sit at its last context position");
      for (int64_t i = 0; i < n; ++i) {
        KVS_REQUIRE(p[i] >= 0 && (i == 0 || p[i] > p[i - 1]), seq() + "query positions must ascend from 0 up");
      }
    }
    const int64_t open = b.open[s];
    if (len % B) {
      for (const HalfView* v : {&K, &V}) {
        const bool whole = v->kind == ASYM_CHANNEL || v->num_outliers > 0;
        KVS_REQUIRE(!whole || (open >= 0 && v->residual), seq() + "its open block is only in a residual row, and open_rows "
                                                            "is -1 or the half has no residual rows");
        KVS_REQUIRE(!v->residual || open < v->residual_rows, seq() + "open row " + std::to_string(open) +
                                                             " is outside the residual rows");
      }
    }
    // Decodes: all heads in one item (each block read once, contiguously). Prefill chunks:
    // as many queries per item as fit, so each decoded block serves many rows.
    const int64_t heads_per_group = std::max<int64_t>(1, std::min<int64_t>(H, kMaxRows / (n * b.group)));
    const int64_t tile_queries = std::max<int64_t>(1, std::min<int64_t>(n, kMaxRows / (b.group * heads_per_group)));
    for (int64_t q0 = 0, q1 = 0; q0 < n; q0 = q1) {
      q1 = std::min(n, q0 + tile_queries);
      if (b.qpos != nullptr) {
        const int32_t* p = b.qpos + b.starts[s];
        for (int64_t i = q0 + 1; i < q1; ++i) {
          if (p[i] - p[i - 1] > kTileGap) {
            q1 = i;
            break;
          }
        }
      }
      const int64_t nkeys = visible_keys(b, s, n, len, q1 - 1);
      const int64_t nb = (nkeys + B - 1) / B;
      for (int64_t h0 = 0; h0 < H; h0 += heads_per_group) {
        const int64_t h1 = std::min(H, h0 + heads_per_group);
        plan.groups.push_back({s, q0, q1, h0, h1, nkeys, nb, nb, 1});
      }
    }
  }
  const int64_t chunk = std::max<int64_t>(1, kSplitKeys / B);
  for (size_t gi = 0; gi < plan.groups.size(); ++gi) {
    Group& g = plan.groups[gi];
    const int64_t nh = g.h1 - g.h0, rows = nh * (g.q1 - g.q0) * b.group;
    plan.max_rows = std::max(plan.max_rows, rows);
    g.chunk = chunk;
    g.splits = (g.nblocks + g.chunk - 1) / g.chunk;
    // rows ascend: the tile's first row sees the earliest keys
    g.kb_first = first_key(b, g.s, b.starts[g.s + 1] - b.starts[g.s], b.lens[g.s], g.q0) / B;
    g.split0 = g.kb_first / g.chunk;
    for (int64_t sp = g.split0; sp < g.splits; ++sp) {
      int64_t partial = -1;
      if (g.splits - g.split0 > 1) {
        partial = plan.scratch;
        plan.scratch += rows * (2 + b.ld);
      }
      plan.items.push_back({static_cast<int64_t>(gi), sp, partial});
    }
  }
  if (b.scores) {
    KVS_REQUIRE(b.window == 0, "attention scores are not kept under a sliding window");
    const int64_t kv_heads = b.Hq / b.group;
    std::vector<int64_t> task_of(static_cast<size_t>(S * kv_heads), -1);   // (s, h) -> its score task
    for (size_t gi = 0; gi < plan.groups.size(); ++gi) {
      Group& g = plan.groups[gi];
      const int64_t n = b.starts[g.s + 1] - b.starts[g.s];
      const int64_t from = b.score_from[g.s];
      KVS_REQUIRE(from >= 0, "score_from must be >= 0");
      if (from >= g.q1 || from >= n) continue;  // no query of this tile is scored
      KVS_REQUIRE(b.lens[g.s] <= b.score_ld, "scores must hold every context token of a scored sequence");
      const int64_t rows = (g.h1 - g.h0) * (g.q1 - g.q0) * b.group;
      g.lg = plan.logits;
      plan.logits += rows * g.nkeys;
      g.norm = plan.logits;
      plan.logits += 2 * rows;
      for (int64_t h = g.h0; h < g.h1; ++h) {
        int64_t& task = task_of[static_cast<size_t>(g.s * kv_heads + h)];
        if (task < 0) {
          task = static_cast<int64_t>(plan.score_tasks.size());
          plan.score_tasks.push_back({g.s, h, {}});
        }
        plan.score_tasks[static_cast<size_t>(task)].groups.push_back(static_cast<int64_t>(gi));
      }
    }
  }
  return plan;
}

// Keep each row's final (max, sum) of a scored group.
inline void keep_norms(const Group& g, int64_t total, const float* m, const float* l, float* logits) {
  if (g.norm < 0) return;
  float* norm = logits + g.norm;
  for (int64_t r = 0; r < total; ++r) {
    norm[2 * r] = m[r];
    norm[2 * r + 1] = l[r];
  }
}

// scores[s][h][j] += 2^(logit - max) / sum over the task's scored rows (queries >= score_from).
inline void add_scores(const Batch& b, const Plan& plan, const ScoreTask& task, const float* logits) {
  const int64_t s = task.s, n = b.starts[s + 1] - b.starts[s], len = b.lens[s];
  float* out = b.scores + (s * (b.Hq / b.group) + task.h) * b.score_ld;
  for (const int64_t gi : task.groups) {
    const Group& g = plan.groups[static_cast<size_t>(gi)];
    const int64_t rows = (g.q1 - g.q0) * b.group, hh = task.h - g.h0;
    for (int64_t rr = 0; rr < rows; ++rr) {
      const int64_t i = g.q0 + rr / b.group;
      if (i < b.score_from[s]) continue;
      const int64_t r = hh * rows + rr, visible = visible_keys(b, s, n, len, i);
      const float* lg = logits + g.lg + r * g.nkeys;
      const float mx = logits[g.norm + 2 * r], inv = 1.0f / logits[g.norm + 2 * r + 1];
      int64_t j = 0;
#ifdef KVS_SIMD
      // the softmax's own exponential (attend.h): lg[j] - mx <= 0, -inf where a key is masked
      const vf vmx = vset1(mx), vinv = vset1(inv);
      for (; j + W <= visible; j += W) vstore(out + j, vfma(vexp2_neg(vsub(vload(lg + j), vmx)), vinv, vload(out + j)));
#endif
      for (; j < visible; ++j) out[j] += std::exp2(lg[j] - mx) * inv;
    }
  }
}

// Per-thread buffers, allocated once per call (uninitialized, except what must be finite).
class Scratch {
 public:
  Scratch(int64_t ld, int64_t B, int64_t heads, int64_t max_rows)
      : pld((B + 15) / 16 * 16), visible(static_cast<size_t>(max_rows)), first(static_cast<size_t>(max_rows)) {
    // the thread's arena, grown as needed and kept: a decode step calls this once per layer
    static thread_local std::vector<float> arena;
    const size_t need = static_cast<size_t>(max_rows * (2 * ld + 2 + W + pld) + 2 * (B * ld + 2 * ld + pld) +
                                            4 * B * heads * ld + 32 * 16);
    if (arena.size() < need) arena.resize(need);
    // every buffer on its own cache lines: vector loads must not straddle two
    float* at = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(arena.data()) + 63) & ~uintptr_t{63});
    auto take = [&at](int64_t n) {
      float* p = at;
      at += (n + 15) / 16 * 16;
      return p;
    };
    q = take(max_rows * ld);
    acc = take(max_rows * ld);
    ml = take(max_rows);
    l = take(max_rows);
    lv = take(max_rows * W);
    p = take(max_rows * pld);
    for (HalfBuffers* hb : {&kb, &vb}) {
      hb->x = take(B * ld);
      hb->cs = take(ld);
      hb->cz = take(ld);
      hb->rs = take(pld);
      hb->gs = take(B * heads * ld);  // groups <= ld
      hb->gz = take(B * heads * ld);
      hb->pld = pld;
      std::fill(hb->rs, hb->rs + pld, 1.0f);
    }
  }
  const int64_t pld;  // floats per row of p: block_size rounded up to 16

 public:
  float *q, *acc, *ml, *l, *lv, *p;
  HalfBuffers kb, vb;
  std::vector<int64_t> visible, first;
  Prefetcher pf;
};

// One item: the rows of its group's heads against its split of the context.
inline void run_item(const Batch& b, const HalfView& K, const HalfView& V, const Group& g, const Item& item,
              const float* qp, float* out, float* partials, float* logits, Scratch& w) {
  const int64_t s = g.s, n = b.starts[s + 1] - b.starts[s], len = b.lens[s], ld = b.ld, D = b.D;
  const int64_t nh = g.h1 - g.h0, rows = (g.q1 - g.q0) * b.group;  // rows per head
  for (int64_t i = g.q0; i < g.q1; ++i) {
    for (int64_t k = 0; k < b.group; ++k) {
      w.visible[(i - g.q0) * b.group + k] = visible_keys(b, s, n, len, i);
      w.first[(i - g.q0) * b.group + k] = first_key(b, s, n, len, i);
    }
  }
  for (int64_t hh = 0; hh < nh; ++hh) {
    for (int64_t i = g.q0; i < g.q1; ++i) {
      for (int64_t k = 0; k < b.group; ++k) {
        const float* src = qp + ((b.starts[s] + i) * b.Hq + (g.h0 + hh) * b.group + k) * D;
        float* dst = w.q + (hh * rows + (i - g.q0) * b.group + k) * ld;
        std::copy(src, src + D, dst);
        std::fill(dst + D, dst + ld, 0.0f);
        if (K.rotated) fwht(dst, static_cast<int>(D));
        for (int64_t d = 0; d < D; ++d) dst[d] *= b.scale_log2;
      }
    }
  }
  const int64_t total = nh * rows;
  float* m = w.ml;
  float* lv = w.lv;
  float* acc = w.acc;
  std::fill(m, m + total, -std::numeric_limits<float>::infinity());
  std::fill(lv, lv + total * W, 0.0f);
  std::fill(acc, acc + total * ld, 0.0f);
  const int64_t kb0 = std::max(item.split * g.chunk, g.kb_first), kb1 = std::min(g.nblocks, item.split * g.chunk + g.chunk);
  // Prefetch about kPrefetchBytes ahead: the block `ahead` blocks on (quantized blocks are a
  // few KiB), or when a block is larger (float32 SmolLM2: 24 KiB) the next head's rows.
  Prefetcher& pf = w.pf;
  const int64_t item_block_bytes = std::max<int64_t>(1, (block_bytes(K) + block_bytes(V)) * nh / K.H);
  const bool per_head = item_block_bytes > kPrefetchBytes;
  const int64_t ahead = per_head ? 1 : kPrefetchBytes / item_block_bytes;
  // The far stream: for items of every head (a decode's, whose blocks are read whole) in
  // plain formats. Quantized halves do enough arithmetic per byte to hide the latency without
  // it (measured: int8 and KIVI 1-7% slower with it, float32 / float16 20-35% faster).
  const bool far_ahead = nh == K.H && K.kind == PLAIN && V.kind == PLAIN;
  const int64_t far = far_ahead ? std::max<int64_t>(1, kFarBytes / (block_bytes(K) + block_bytes(V))) : 0;
  for (int64_t kb = kb0; kb < std::min(kb1, kb0 + ahead); ++kb) {
    pf.clear();
    queue(pf, K, V, b, s, kb, g.h0, per_head ? g.h0 + 1 : g.h1, g.h0);
    pf.drain();
  }
  // the far stream starts where the near one ends and catches up by two blocks a block (a
  // burst of its first blocks would stall on the miss buffers)
  int64_t far_next = kb0 + ahead;
  const auto queue_far_upto = [&](int64_t kb) {
    const int64_t end = std::min(kb1, kb + ahead + far + 1);
    for (int k = 0; k < 2 && far_next < end; ++k) queue(pf, K, V, b, s, far_next++, 0, K.H, 0, true);
  };
  const int64_t decodes = decodes_block(K, KEY, b, rows) + decodes_block(V, VALUE, b, rows);
  for (int64_t kb = kb0; kb < kb1; ++kb) {
    const int n_keys = static_cast<int>(std::min<int64_t>(b.B, g.nkeys - kb * b.B));
    const int64_t pumps = decodes * ((n_keys + 3) / 4) + attend_pumps(static_cast<int>(rows), n_keys, ld);
    for (int64_t hh = 0; hh < nh; ++hh) {
      const int64_t h = g.h0 + hh;
      if (per_head) {
        pf.clear();
        if (hh + 1 < nh) {
          queue(pf, K, V, b, s, kb, h + 1, h + 2, g.h0);
        } else if (kb + 1 < kb1) {
          queue(pf, K, V, b, s, kb + 1, g.h0, g.h0 + 1, g.h0);
        }
        if (hh == 0 && far) queue_far_upto(kb);
        pf.plan(pumps);
      } else if (hh == 0) {
        pf.clear();
        if (kb + ahead < kb1) queue(pf, K, V, b, s, kb + ahead, g.h0, g.h1, g.h0);
        if (far) queue_far_upto(kb);
        pf.plan(pumps * nh);
      }
      const Rows kr = rows_of(K, KEY, b, s, kb, h, n_keys, static_cast<int>(rows), w.kb, pf);
      const Rows vr = rows_of(V, VALUE, b, s, kb, h, n_keys, static_cast<int>(rows), w.vb, pf);
      const Tile tile{static_cast<int>(rows), ld, w.q + hh * rows * ld, w.visible.data(), m + hh * rows,
                      lv + hh * rows * W, acc + hh * rows * ld, w.p, w.pld, b.window > 0 ? w.first.data() : nullptr};
      float* lg = g.lg >= 0 ? logits + g.lg + hh * rows * g.nkeys : nullptr;
      attend_block(tile, kr, vr, n_keys, kb * b.B, pf, lg, g.nkeys);
      if (per_head || hh + 1 == nh) pf.drain();
    }
  }
  float* l = w.l;
  for (int64_t r = 0; r < total; ++r) {
    float sum = 0.0f;
    for (int k = 0; k < W; ++k) sum += lv[r * W + k];
    l[r] = sum;
  }
  if (item.partial >= 0) {  // (m, l, acc) for the merge
    float* part = partials + item.partial;
    std::copy(m, m + total, part);
    std::copy(l, l + total, part + total);
    std::copy(acc, acc + total * ld, part + 2 * total);
    return;
  }
  keep_norms(g, total, m, l, logits);
  for (int64_t hh = 0; hh < nh; ++hh) write_rows(b, g, g.h0 + hh, acc + hh * rows * ld, l + hh * rows, V, out);
}

// Combine the splits of a group: weights 2^(m_i - max m) on each split's sum and accumulator.
inline void merge(const Batch& b, const HalfView& V, const Group& g, const float* first, float* out, float* logits,
                  Scratch& w) {
  const int64_t nh = g.h1 - g.h0, rows = (g.q1 - g.q0) * b.group, total = nh * rows, ld = b.ld;
  const int64_t stride = total * (2 + ld);
  float* acc = w.acc;
  float* l = w.l;
  float* m = w.ml;
  for (int64_t r = 0; r < total; ++r) {
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t sp = 0; sp < g.splits - g.split0; ++sp) mx = std::max(mx, first[sp * stride + r]);
    m[r] = mx;
    l[r] = 0.0f;
    std::fill(acc + r * ld, acc + (r + 1) * ld, 0.0f);
    for (int64_t sp = 0; sp < g.splits - g.split0; ++sp) {
      const float* p = first + sp * stride;
      if (p[total + r] == 0.0f) continue;  // this split saw no key of this row
      const float wt = std::exp2(p[r] - mx);
      l[r] += wt * p[total + r];
      const float* pa = p + 2 * total + r * ld;
      for (int64_t d = 0; d < ld; ++d) acc[r * ld + d] += wt * pa[d];
    }
  }
  keep_norms(g, total, m, l, logits);
  for (int64_t hh = 0; hh < nh; ++hh) write_rows(b, g, g.h0 + hh, acc + hh * rows * ld, l + hh * rows, V, out);
}

}  // namespace detail

// out[t] for every query row t of the batch (rows outside every sequence are not written).
inline void attention(const detail::Batch& b, const HalfView& K, const HalfView& V, const float* q, float* out,
                      int64_t S, int64_t T) {
  using namespace detail;
  const int threads = std::max(1, omp_get_max_threads());
  const Plan plan = make_plan(b, K, V, S, T);
  std::vector<float> partials(static_cast<size_t>(plan.scratch));
  std::vector<float> logits(static_cast<size_t>(plan.logits));   // scored groups' logits and norms
  const int64_t num_items = static_cast<int64_t>(plan.items.size());
  const int64_t num_tasks = static_cast<int64_t>(plan.score_tasks.size());
  const int use = static_cast<int>(std::min<int64_t>(threads, std::max<int64_t>(1, num_items)));

#pragma omp parallel num_threads(use)
  {
    Scratch w(b.ld, b.B, K.H, plan.max_rows);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < num_items; ++it) {
      const Item& item = plan.items[it];
      run_item(b, K, V, plan.groups[item.group], item, q, out, partials.data(), logits.data(), w);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < num_items; ++it) {
      const Item& item = plan.items[it];
      if (item.partial >= 0 && item.split == plan.groups[item.group].split0) {
        merge(b, V, plan.groups[item.group], partials.data() + item.partial, out, logits.data(), w);
      }
    }
    // each (sequence, KV head) row of scores is one task's: no two threads add to one entry
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < num_tasks; ++t) add_scores(b, plan, plan.score_tasks[static_cast<size_t>(t)], logits.data());
  }
}

}  // namespace kvs

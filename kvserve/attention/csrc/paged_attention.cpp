// Paged attention on the CPU over a KV cache stored in any kvserve format, read in place.
//
// Work items are (sequence, query tile, KV head, context split). A query tile holds up to
// kMaxRows rows: (query, query head of the KV head's group), so the `group` heads sharing
// a KV head read each K/V row once, and a prefill chunk reuses each decoded block for all
// of its tile's queries. Long contexts are split (split-K) so that a single sequence still
// keeps every core busy; splits leave (max, sum, accumulator) partials that a second pass
// merges. Items are handed out dynamically over OpenMP (the runtime torch itself uses).
//
//   sequence s, tile t:  keys 0 ........................ nkeys-1      (nkeys = last query pos + 1)
//                        | split 0 | split 1 | ... | split n-1 |      each a run of whole blocks
#include <omp.h>

#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "attend.h"
#include "dequant.h"

namespace kvs {
namespace {

constexpr int kMaxRows = 128;         // query rows per tile (acc + q: 2 x 64 KiB at head_dim 128)
constexpr int kItemsPerThread = 8;    // split long contexts until there are this many items per thread
constexpr int64_t kMinSplitKeys = 128;

void require(bool ok, const std::string& msg) {
  if (!ok) throw std::invalid_argument(msg);  // pybind11 raises ValueError
}

std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

bool present(const at::Tensor& t) { return t.defined() && t.dim() > 0; }

void check_tensor(const at::Tensor& t, at::ScalarType dtype, std::vector<int64_t> shape, const std::string& name) {
  require(present(t), name + " is missing");
  require(t.device().is_cpu(), name + " must be a CPU tensor");
  require(t.scalar_type() == dtype, name + " must be " + std::string(c10::toString(dtype)) + ", got " +
                                        std::string(c10::toString(t.scalar_type())));
  bool same = t.dim() == static_cast<int64_t>(shape.size());
  for (size_t i = 0; same && i < shape.size(); ++i) same = shape[i] < 0 || t.size(i) == shape[i];
  std::string want = "[";
  for (size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + (shape[i] < 0 ? "*" : std::to_string(shape[i]));
  require(same, name + " must have shape " + want + "], got " + shape_str(t));
  require(t.is_contiguous(), name + " must be contiguous");
}

int dtype_code(at::ScalarType t, const std::string& name) {
  if (t == at::kFloat) return F32;
  if (t == at::kHalf) return F16;
  if (t == at::kBFloat16) return BF16;
  throw std::invalid_argument(name + " must be float32, float16 or bfloat16");
}

// layout = (kind, plain dtype code, bits, group size, hadamard, num_outliers);
// parts = (data | codes, scale, zero, outlier_values, outlier_channels, residual), absent ones 0-dim.
HalfView make_half(const std::string& name, const std::vector<int64_t>& layout, const std::vector<at::Tensor>& parts,
                   int64_t B, int64_t D) {
  require(layout.size() == 6 && parts.size() == 6, name + ": internal error (layout / parts arity)");
  HalfView v;
  v.kind = static_cast<int>(layout[0]);
  v.bits = static_cast<int>(layout[2]);
  v.group = static_cast<int>(layout[3]);
  v.hadamard = layout[4] != 0;
  v.num_outliers = static_cast<int>(layout[5]);
  v.rotated = v.hadamard && v.num_outliers == 0;
  v.B = B;
  v.D = D;
  const at::Tensor& main = parts[0];
  require(present(main) && main.dim() == 4, name + ": the data/codes part must be [num_blocks, B, H, *], got " +
                                                (present(main) ? shape_str(main) : std::string("none")));
  v.num_blocks = main.size(0);
  v.H = main.size(2);
  const int64_t NB = v.num_blocks, H = v.H;
  require(main.size(1) == B, name + ": parts hold blocks of " + std::to_string(main.size(1)) +
                                 " tokens, the batch says block_size " + std::to_string(B));
  switch (v.kind) {
    case PLAIN:
      v.dtype = static_cast<int>(layout[1]);
      require(v.dtype == dtype_code(main.scalar_type(), name + " data"), name + ": data dtype differs from the layout");
      check_tensor(main, main.scalar_type(), {NB, B, H, D}, name + " data");
      v.row_bytes = D * dtype_size(v.dtype);
      break;
    case INT8:
    case FP8:
      check_tensor(main, v.kind == INT8 ? at::kChar : at::kByte, {NB, B, H, D}, name + " codes");
      check_tensor(parts[1], at::kHalf, {NB, B, H}, name + " scale");
      v.row_bytes = D;
      break;
    case ASYM_TOKEN:
    case ASYM_CHANNEL: {
      require(v.bits == 2 || v.bits == 4, name + ": asymmetric codes are 2 or 4 bits, got " + std::to_string(v.bits));
      require(D % (8 / v.bits) == 0, name + ": head_dim must be a multiple of " + std::to_string(8 / v.bits));
      check_tensor(main, at::kByte, {NB, B, H, D * v.bits / 8}, name + " codes");
      std::vector<int64_t> param{NB, H, D};
      if (v.kind == ASYM_TOKEN) {
        require(v.group > 0 && D % v.group == 0, name + ": group size " + std::to_string(v.group) +
                                                     " does not divide head_dim " + std::to_string(D));
        param = {NB, B, H, D / v.group};
      }
      check_tensor(parts[1], at::kHalf, param, name + " scale");
      check_tensor(parts[2], at::kHalf, param, name + " zero");
      v.zero = reinterpret_cast<const uint16_t*>(parts[2].data_ptr());
      v.row_bytes = D * v.bits / 8;
      break;
    }
    default:
      throw std::invalid_argument(name + ": unknown codec kind " + std::to_string(v.kind));
  }
  v.main = reinterpret_cast<const uint8_t*>(main.data_ptr());
  if (v.kind != PLAIN) v.scale = reinterpret_cast<const uint16_t*>(parts[1].data_ptr());
  if (v.hadamard) require(D > 0 && (D & (D - 1)) == 0, name + ": +had needs a power-of-two head_dim, got " +
                                                       std::to_string(D));
  if (v.num_outliers) {
    const int64_t N = v.num_outliers;
    require(N > 0 && N < D && D <= 256, name + ": +out" + std::to_string(N) + " needs N < head_dim <= 256");
    check_tensor(parts[3], at::kHalf, {NB, B, H, N}, name + " outlier_values");
    check_tensor(parts[4], at::kByte, {NB, H, N}, name + " outlier_channels");
    v.out_values = reinterpret_cast<const uint16_t*>(parts[3].data_ptr());
    v.out_channels = reinterpret_cast<const uint8_t*>(parts[4].data_ptr());
  }
  if (present(parts[5])) {
    const at::Tensor& r = parts[5];
    v.residual_dtype = dtype_code(r.scalar_type(), name + " residual");
    check_tensor(r, r.scalar_type(), {-1, B, H, D}, name + " residual");
    v.residual = reinterpret_cast<const uint8_t*>(r.data_ptr());
    v.residual_rows = r.size(0);
  }
  return v;
}

struct Group {      // (sequence, query tile): its KV heads are split alike
  int64_t s, q0, q1, nkeys, nblocks, chunk, splits, first_item;
};
struct Item {
  int64_t group, head, split, partial;  // partial: offset of (m, l, acc) in the scratch, or -1
};

struct Batch {
  const int32_t* tables;
  int64_t max_blocks;
  const int32_t* lens;
  const int32_t* starts;
  const int32_t* open;
  int64_t B, group, Hq, D, ld;
  float scale_log2;
};

const float* rows_of(const HalfView& v, const Batch& b, int64_t s, int64_t kb, int64_t h, int n, float* buf,
                     float* tmp, int64_t* ld) {
  const int64_t len = b.lens[s];
  const int64_t open = b.open[s];
  if (v.residual && open >= 0 && len % b.B && kb == (len - 1) / b.B) {
    if (const float* p = direct_residual(v, open, h, ld)) return p;
    decode_residual(v, open, h, n, buf, b.ld);
  } else {
    const int64_t block = b.tables[s * b.max_blocks + kb];
    if (const float* p = direct_rows(v, block, h, ld)) return p;
    decode_block(v, block, h, n, buf, b.ld, tmp);
  }
  *ld = b.ld;
  return buf;
}

void write_rows(const Batch& b, const Group& g, int64_t h, const float* acc, const float* l, const HalfView& V,
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

}  // namespace

void run(const at::Tensor& q, at::Tensor out, const std::vector<int64_t>& k_layout,
         const std::vector<at::Tensor>& k_parts, const std::vector<int64_t>& v_layout,
         const std::vector<at::Tensor>& v_parts, const at::Tensor& block_tables, const at::Tensor& context_lens,
         const at::Tensor& query_starts, const at::Tensor& open_rows, int64_t block_size, double scale) {
  require(q.dim() == 3, "q must be [tokens, heads, head_dim], got " + shape_str(q));
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2), B = block_size;
  check_tensor(q, at::kFloat, {T, Hq, D}, "q");
  check_tensor(out, at::kFloat, {T, Hq, D}, "out");
  require(B > 0, "block_size must be positive");
  const HalfView K = make_half("key", k_layout, k_parts, B, D);
  const HalfView V = make_half("value", v_layout, v_parts, B, D);
  require(K.H == V.H && K.H > 0 && Hq % K.H == 0, "query heads (" + std::to_string(Hq) +
                                                      ") must be a multiple of the KV heads (" + std::to_string(K.H) +
                                                      ", keys and values alike)");
  require(block_tables.dim() == 2, "block_tables must be [num_seqs, max_blocks]");
  const int64_t S = block_tables.size(0), MB = block_tables.size(1);
  check_tensor(block_tables, at::kInt, {S, MB}, "block_tables");
  check_tensor(context_lens, at::kInt, {S}, "context_lens");
  check_tensor(query_starts, at::kInt, {S + 1}, "query_starts");
  check_tensor(open_rows, at::kInt, {S}, "open_rows");
  Batch b{block_tables.data_ptr<int32_t>(), MB, context_lens.data_ptr<int32_t>(), query_starts.data_ptr<int32_t>(),
          open_rows.data_ptr<int32_t>(), B, Hq / K.H, Hq, D, (D + 7) / 8 * 8,
          static_cast<float>(scale * static_cast<double>(kLog2e))};
  const int64_t H = K.H;
  const int64_t tile_queries = std::max<int64_t>(1, kMaxRows / b.group);

  // Plan: validate each sequence, cut its queries into tiles; then size the splits.
  std::vector<Group> groups;
  double total_cost = 0;
  require(b.starts[0] >= 0, "query_starts[0] must be >= 0");
  for (int64_t s = 0; s < S; ++s) {
    const int64_t n = b.starts[s + 1] - b.starts[s], len = b.lens[s];
    const std::string seq = "sequence " + std::to_string(s) + ": ";
    require(n >= 0 && b.starts[s + 1] <= T, seq + "query_starts must be non-decreasing and within q's rows");
    if (n == 0) continue;
    require(n <= len, seq + std::to_string(n) + " queries but only " + std::to_string(len) + " context tokens");
    const int64_t nblocks = (len + B - 1) / B;
    require(nblocks <= MB, seq + "context needs " + std::to_string(nblocks) + " blocks, the table holds " +
                               std::to_string(MB));
    for (int64_t kb = 0; kb < nblocks; ++kb) {
      const int64_t id = b.tables[s * MB + kb];
      require(id >= 0 && id < K.num_blocks && id < V.num_blocks, seq + "block id " + std::to_string(id) +
                                                                     " is outside the cache");
    }
    const int64_t open = b.open[s];
    if (len % B) {
      for (const HalfView* v : {&K, &V}) {
        const bool whole = v->kind == ASYM_CHANNEL || v->num_outliers > 0;
        require(!whole || open >= 0, seq + "its open block is only in a residual row, and open_rows is -1");
        require(!v->residual || open < v->residual_rows, seq + "open row " + std::to_string(open) +
                                                             " is outside the residual rows");
      }
    }
    for (int64_t q0 = 0; q0 < n; q0 += tile_queries) {
      const int64_t q1 = std::min(n, q0 + tile_queries);
      const int64_t nkeys = len - n + q1;
      const int64_t nb = (nkeys + B - 1) / B;
      groups.push_back({s, q0, q1, nkeys, nb, nb, 1, 0});
      total_cost += static_cast<double>(H * nb) * static_cast<double>((q1 - q0) * b.group + 4);
    }
  }
  const int threads = std::max(1, omp_get_max_threads());
  const double target = total_cost / (kItemsPerThread * threads);
  const int64_t min_chunk = std::max<int64_t>(1, kMinSplitKeys / B);
  std::vector<Item> items;
  int64_t scratch = 0;
  for (size_t gi = 0; gi < groups.size(); ++gi) {
    Group& g = groups[gi];
    const int64_t rows = (g.q1 - g.q0) * b.group;
    g.chunk = std::max<int64_t>(min_chunk, static_cast<int64_t>(std::ceil(target / (rows + 4))));
    g.splits = (g.nblocks + g.chunk - 1) / g.chunk;
    g.chunk = (g.nblocks + g.splits - 1) / g.splits;  // even splits
    g.first_item = static_cast<int64_t>(items.size());
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t sp = 0; sp < g.splits; ++sp) {
        int64_t partial = -1;
        if (g.splits > 1) {
          partial = scratch;
          scratch += rows * (2 + b.ld);
        }
        items.push_back({static_cast<int64_t>(gi), h, sp, partial});
      }
    }
  }
  std::vector<float> partials(static_cast<size_t>(scratch));
  float* o = out.data_ptr<float>();
  const float* qp = q.data_ptr<float>();
  const int64_t num_items = static_cast<int64_t>(items.size());

#pragma omp parallel
  {
    const int64_t ld = b.ld;
    std::vector<float> qbuf(kMaxRows * ld), accbuf(kMaxRows * ld), ml(2 * kMaxRows), kv(2 * B * ld), tmp(4 * ld),
        logits(B + 8);
    std::vector<int64_t> visible(kMaxRows);
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < num_items; ++it) {
      const Item& item = items[it];
      const Group& g = groups[item.group];
      const int64_t s = g.s, h = item.head, n = b.starts[s + 1] - b.starts[s], len = b.lens[s];
      const int rows = static_cast<int>((g.q1 - g.q0) * b.group);
      for (int64_t i = g.q0; i < g.q1; ++i) {
        for (int64_t k = 0; k < b.group; ++k) {
          const int64_t r = (i - g.q0) * b.group + k;
          const float* src = qp + ((b.starts[s] + i) * Hq + h * b.group + k) * D;
          float* dst = qbuf.data() + r * ld;
          std::copy(src, src + D, dst);
          std::fill(dst + D, dst + ld, 0.0f);
          if (K.rotated) fwht(dst, static_cast<int>(D));
          for (int64_t d = 0; d < D; ++d) dst[d] *= b.scale_log2;
          visible[r] = len - n + i + 1;
        }
      }
      float* m = item.partial >= 0 ? partials.data() + item.partial : ml.data();
      float* l = m + rows;
      float* acc = item.partial >= 0 ? l + rows : accbuf.data();
      std::fill(m, m + rows, -std::numeric_limits<float>::infinity());
      std::fill(l, l + rows, 0.0f);
      std::fill(acc, acc + rows * ld, 0.0f);
      const Tile tile{rows, ld, qbuf.data(), visible.data(), m, l, acc, logits.data()};
      const int64_t kb1 = std::min(g.nblocks, (item.split + 1) * g.chunk);
      for (int64_t kb = item.split * g.chunk; kb < kb1; ++kb) {
        const int n_keys = static_cast<int>(std::min<int64_t>(B, g.nkeys - kb * B));
        int64_t ldk = 0, ldv = 0;
        const float* kr = rows_of(K, b, s, kb, h, n_keys, kv.data(), tmp.data(), &ldk);
        const float* vr = rows_of(V, b, s, kb, h, n_keys, kv.data() + B * ld, tmp.data() + 2 * ld, &ldv);
        attend_block(tile, kr, ldk, vr, ldv, n_keys, kb * B);
      }
      if (item.partial < 0) write_rows(b, g, h, acc, l, V, o);
    }

    // Merge the splits of each (group, head): weights 2^(m_i - max m).
#pragma omp for schedule(dynamic, 1)
    for (int64_t it = 0; it < num_items; ++it) {
      const Item& item = items[it];
      const Group& g = groups[item.group];
      if (item.partial < 0 || item.split != 0) continue;
      const int64_t rows = (g.q1 - g.q0) * b.group, stride = rows * (2 + ld);
      const float* first = partials.data() + item.partial;
      float* acc = accbuf.data();
      float* l = ml.data();
      for (int64_t r = 0; r < rows; ++r) {
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t sp = 0; sp < g.splits; ++sp) mx = std::max(mx, first[sp * stride + r]);
        l[r] = 0.0f;
        std::fill(acc + r * ld, acc + (r + 1) * ld, 0.0f);
        for (int64_t sp = 0; sp < g.splits; ++sp) {
          const float* p = first + sp * stride;
          if (p[rows + r] == 0.0f) continue;  // this split saw no key of this row
          const float w = std::exp2(p[r] - mx);
          l[r] += w * p[rows + r];
          const float* pa = p + 2 * rows + r * ld;
          for (int64_t d = 0; d < ld; ++d) acc[r * ld + d] += w * pa[d];
        }
      }
      write_rows(b, g, item.head, acc, l, V, o);
    }
  }
}

}  // namespace kvs

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvserve paged attention over compressed KV blocks (CPU)";
  m.def("run", &kvs::run, "paged attention: see kvserve/attention/cpu.py");
#ifdef KVS_AVX2
  m.attr("isa") = "avx2";
#else
  m.attr("isa") = "scalar";
#endif
}

// Paged attention on the CPU over a KV cache stored in any kvserve format, read in place.
// This file checks the tensors and hands their pointers to the kernel (kernel.h).
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "encode.h"
#include "kernel.h"

namespace kvs {
namespace {

std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

bool present(const at::Tensor& t) { return t.defined() && t.dim() > 0; }

std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    default: return std::string(c10::toString(t));
  }
}

void check_tensor(const at::Tensor& t, at::ScalarType dtype, std::vector<int64_t> shape, const std::string& name) {
  KVS_REQUIRE(present(t), name + " is missing");
  KVS_REQUIRE(t.device().is_cpu(), name + " must be a CPU tensor");
  KVS_REQUIRE(t.scalar_type() == dtype, name + " must be " + dtype_name(dtype) + ", got " + dtype_name(t.scalar_type()));
  bool same = t.dim() == static_cast<int64_t>(shape.size());
  for (size_t i = 0; same && i < shape.size(); ++i) same = shape[i] < 0 || t.size(i) == shape[i];
  std::string want = "[";
  for (size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + (shape[i] < 0 ? "*" : std::to_string(shape[i]));
  KVS_REQUIRE(same, name + " must have shape " + want + "], got " + shape_str(t));
  KVS_REQUIRE(t.is_contiguous(), name + " must be contiguous");
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
  KVS_REQUIRE(layout.size() == 6 && parts.size() == 6, name + ": internal error (layout / parts arity)");
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
  KVS_REQUIRE(present(main) && main.dim() == 4, name + ": the data/codes part must be [num_blocks, B, H, *], got " +
                                                (present(main) ? shape_str(main) : std::string("none")));
  v.num_blocks = main.size(0);
  v.H = main.size(2);
  const int64_t NB = v.num_blocks, H = v.H;
  KVS_REQUIRE(main.size(1) == B, name + ": parts hold blocks of " + std::to_string(main.size(1)) +
                                 " tokens, the batch says block_size " + std::to_string(B));
  switch (v.kind) {
    case PLAIN:
      v.dtype = static_cast<int>(layout[1]);
      KVS_REQUIRE(v.dtype == dtype_code(main.scalar_type(), name + " data"), name + ": data dtype differs from the layout");
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
      KVS_REQUIRE(v.bits == 2 || v.bits == 4, name + ": asymmetric codes are 2 or 4 bits, got " + std::to_string(v.bits));
      KVS_REQUIRE(D % (8 / v.bits) == 0, name + ": head_dim must be a multiple of " + std::to_string(8 / v.bits));
      check_tensor(main, at::kByte, {NB, B, H, D * v.bits / 8}, name + " codes");
      std::vector<int64_t> param{NB, H, D};
      if (v.kind == ASYM_TOKEN) {
        KVS_REQUIRE(v.group > 0 && D % v.group == 0, name + ": group size " + std::to_string(v.group) +
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
  if (v.hadamard) KVS_REQUIRE(D > 0 && (D & (D - 1)) == 0, name + ": +had needs a power-of-two head_dim, got " +
                                                       std::to_string(D));
  if (v.num_outliers) {
    const int64_t N = v.num_outliers;
    KVS_REQUIRE(N > 0 && N < D && D <= 256, name + ": +out" + std::to_string(N) + " needs N < head_dim <= 256");
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

}  // namespace

namespace {

void check_pair(const HalfView& K, const HalfView& V, int64_t Hq) {
  KVS_REQUIRE(K.H == V.H && K.H > 0 && Hq % K.H == 0, "query heads (" + std::to_string(Hq) +
                                                      ") must be a multiple of the KV heads (" + std::to_string(K.H) +
                                                      ", keys and values alike)");
}

void run_views(const HalfView& K, const HalfView& V, const at::Tensor& q, at::Tensor& out,
               const at::Tensor& block_tables, const at::Tensor& context_lens, const at::Tensor& query_starts,
               const at::Tensor& open_rows, double scale, const at::Tensor* scores = nullptr,
               const at::Tensor* score_from = nullptr, const at::Tensor* query_positions = nullptr,
               int64_t window = 0) {
  const int64_t T = q.size(0), Hq = q.size(1), D = q.size(2);
  check_tensor(q, at::kFloat, {T, Hq, D}, "q");
  check_tensor(out, at::kFloat, {T, Hq, D}, "out");
  KVS_REQUIRE(D == K.D, "q has head_dim " + std::to_string(D) + ", the cache " + std::to_string(K.D));
  check_pair(K, V, Hq);
  KVS_REQUIRE(block_tables.dim() == 2, "block_tables must be [num_seqs, max_blocks]");
  const int64_t S = block_tables.size(0), MB = block_tables.size(1);
  check_tensor(block_tables, at::kInt, {S, MB}, "block_tables");
  check_tensor(context_lens, at::kInt, {S}, "context_lens");
  check_tensor(query_starts, at::kInt, {S + 1}, "query_starts");
  check_tensor(open_rows, at::kInt, {S}, "open_rows");
  detail::Batch b{block_tables.data_ptr<int32_t>(), MB, context_lens.data_ptr<int32_t>(),
                  query_starts.data_ptr<int32_t>(), open_rows.data_ptr<int32_t>(), K.B, Hq / K.H, Hq, D,
                  (D + 15) / 16 * 16, static_cast<float>(scale * static_cast<double>(kLog2e))};
  if (scores != nullptr) {
    KVS_REQUIRE(scores->dim() == 3, "scores must be [num_seqs, kv_heads, max_context]");
    check_tensor(*scores, at::kFloat, {S, K.H, -1}, "scores");
    check_tensor(*score_from, at::kInt, {S}, "score_from");
    b.scores = scores->data_ptr<float>();
    b.score_from = score_from->data_ptr<int32_t>();
    b.score_ld = scores->size(2);
  }
  if (query_positions != nullptr) {
    check_tensor(*query_positions, at::kInt, {T}, "query_positions");
    b.qpos = query_positions->data_ptr<int32_t>();
  }
  KVS_REQUIRE(window >= 0, "window must be >= 0 (0: no sliding window)");
  b.window = window;
  attention(b, K, V, q.data_ptr<float>(), out.data_ptr<float>(), S, T);
}

}  // namespace

// `query_positions` (here and below): each query's position (kernel.h), or empty: each
// sequence's queries are its last n positions.
const at::Tensor* positions_or_none(const at::Tensor& query_positions) {
  return query_positions.numel() ? &query_positions : nullptr;
}

void run(const at::Tensor& q, at::Tensor out, const std::vector<int64_t>& k_layout,
         const std::vector<at::Tensor>& k_parts, const std::vector<int64_t>& v_layout,
         const std::vector<at::Tensor>& v_parts, const at::Tensor& block_tables, const at::Tensor& context_lens,
         const at::Tensor& query_starts, const at::Tensor& open_rows, int64_t block_size, double scale,
         const at::Tensor& query_positions, int64_t window) {
  KVS_REQUIRE(q.dim() == 3, "q must be [tokens, heads, head_dim], got " + shape_str(q));
  KVS_REQUIRE(block_size > 0, "block_size must be positive");
  const HalfView K = make_half("key", k_layout, k_parts, block_size, q.size(2));
  const HalfView V = make_half("value", v_layout, v_parts, block_size, q.size(2));
  run_views(K, V, q, out, block_tables, context_lens, query_starts, open_rows, scale, nullptr, nullptr,
            positions_or_none(query_positions), window);
}

namespace {

// A [T, H, D] float tensor of new keys or values (channels contiguous; tokens and heads may be
// strided, e.g. the value columns of a fused qkv product).
TokenRows token_rows(const at::Tensor& x, const std::string& name, int64_t T, int64_t H, int64_t D) {
  KVS_REQUIRE(x.defined() && x.device().is_cpu(), name + " must be a CPU tensor");
  KVS_REQUIRE(x.dim() == 3 && x.size(0) == T && x.size(1) == H && x.size(2) == D,
              name + " must have shape [" + std::to_string(T) + ", " + std::to_string(H) + ", " + std::to_string(D) +
                  "], got " + shape_str(x));
  KVS_REQUIRE(D <= 1 || x.stride(2) == 1, name + " must have contiguous channels (stride 1 in the last dim)");
  const int dtype = dtype_code(x.scalar_type(), name);
  const int64_t es = dtype_size(dtype);
  return TokenRows{reinterpret_cast<const uint8_t*>(x.data_ptr()), dtype, x.stride(0) * es, x.stride(1) * es};
}

// An int64 index tensor of `n` entries, each in [0, bound); nullptr when n is 0.
const int64_t* indices(const at::Tensor& t, const std::string& name, int64_t n, int64_t bound) {
  if (n == 0) return nullptr;
  check_tensor(t, at::kLong, {n}, name);
  const int64_t* p = t.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    KVS_REQUIRE(p[i] >= 0 && p[i] < bound, name + "[" + std::to_string(i) + "] = " + std::to_string(p[i]) +
                                               " is outside [0, " + std::to_string(bound) + ")");
  }
  return p;
}

}  // namespace

namespace {

void write_views(const HalfView& K, const HalfView& V, const at::Tensor& key, const at::Tensor& value,
                 const at::Tensor& slots, const at::Tensor& residual_slots, const at::Tensor& encode_rows,
                 const at::Tensor& encode_block_ids) {
  KVS_REQUIRE(key.defined() && key.dim() == 3, "key must be [tokens, heads, head_dim]");
  const int64_t T = key.size(0), H = key.size(1), D = key.size(2), B = K.B;
  KVS_REQUIRE(D == K.D, "the new keys have head_dim " + std::to_string(D) + ", the cache " + std::to_string(K.D));
  KVS_REQUIRE(K.H == H && V.H == H, "the parts hold " + std::to_string(K.H) + " (keys) and " + std::to_string(V.H) +
                                        " (values) heads, the new keys " + std::to_string(H));
  for (const HalfView* v : {&K, &V}) {
    const std::string name = v == &K ? "key" : "value";
    KVS_REQUIRE(v->kind != PLAIN || (!v->hadamard && v->num_outliers == 0),
                name + ": plain storage takes no +had or +outN");
    KVS_REQUIRE(!encodes_whole_blocks(*v) || v->residual,
                name + ": a half that encodes whole blocks needs its residual rows");
  }
  const bool any_rows = encodes_whole_blocks(K) || encodes_whole_blocks(V);
  const bool any_tokens = !encodes_whole_blocks(K) || !encodes_whole_blocks(V);
  const int64_t rows = std::max(encodes_whole_blocks(K) ? K.residual_rows : 0,
                                encodes_whole_blocks(V) ? V.residual_rows : 0);
  KVS_REQUIRE(!encodes_whole_blocks(K) || !encodes_whole_blocks(V) || K.residual_rows == V.residual_rows,
              "keys and values keep different numbers of residual rows");
  KVS_REQUIRE(K.num_blocks == V.num_blocks, "keys and values hold different numbers of blocks");
  const int64_t E = any_rows ? encode_rows.numel() : 0;
  KVS_REQUIRE(!any_rows || encode_block_ids.numel() == E, "encode_rows and encode_block_ids differ in length");
  LayerWrites w{T,
                any_tokens ? indices(slots, "slots", T, K.num_blocks * B) : nullptr,
                any_rows ? indices(residual_slots, "residual_slots", T, rows * B) : nullptr,
                E,
                indices(encode_rows, "encode_rows", E, rows),
                indices(encode_block_ids, "encode_block_ids", E, K.num_blocks)};
  if (T == 0 && E == 0) return;
  write_layer(K, V, token_rows(key, "key", T, H, D), token_rows(value, "value", T, H, D), w);
}

}  // namespace

void write_kv(const std::vector<int64_t>& k_layout, const std::vector<at::Tensor>& k_parts,
              const std::vector<int64_t>& v_layout, const std::vector<at::Tensor>& v_parts, const at::Tensor& key,
              const at::Tensor& value, const at::Tensor& slots, const at::Tensor& residual_slots,
              const at::Tensor& encode_rows, const at::Tensor& encode_block_ids) {
  KVS_REQUIRE(key.defined() && key.dim() == 3, "key must be [tokens, heads, head_dim]");
  KVS_REQUIRE(!k_parts.empty() && present(k_parts[0]) && k_parts[0].dim() == 4,
              "key: the data/codes part must be [num_blocks, B, H, *]");
  const int64_t B = k_parts[0].size(1), D = key.size(2);
  const HalfView K = make_half("key", k_layout, k_parts, B, D);
  const HalfView V = make_half("value", v_layout, v_parts, B, D);
  write_views(K, V, key, value, slots, residual_slots, encode_rows, encode_block_ids);
}

// One layer's halves, checked once: a storage's parts live as long as the storage, so a step's
// writes and attention calls need not hand them over (and have them checked) again. Under
// precision by saliency, K and V point at their finer views KF, VF (never moved: held by pointer).
struct Halves {
  HalfView K, V, KF, VF;
  std::vector<at::Tensor> keep;   // the part tensors the views point into
};

std::shared_ptr<Halves> make_halves(const std::vector<int64_t>& k_layout, const std::vector<at::Tensor>& k_parts,
                                    const std::vector<int64_t>& v_layout, const std::vector<at::Tensor>& v_parts,
                                    int64_t block_size, int64_t head_dim) {
  KVS_REQUIRE(block_size > 0 && head_dim > 0, "block_size and head_dim must be positive");
  auto h = std::make_shared<Halves>();
  h->K = make_half("key", k_layout, k_parts, block_size, head_dim);
  h->V = make_half("value", v_layout, v_parts, block_size, head_dim);
  KVS_REQUIRE(h->K.H == h->V.H, "keys and values hold different numbers of heads");
  for (const auto* parts : {&k_parts, &v_parts})
    for (const auto& t : *parts)
      if (present(t)) h->keep.push_back(t);
  return h;
}

// make_halves, each half also reading the blocks that have one from its finer format: kf/vf
// parts [num_side_slots, ...] and the side map (int64 [num_blocks], a slot or -1, changed in
// place by the storage between calls).
std::shared_ptr<Halves> make_halves_refined(const std::vector<int64_t>& k_layout, const std::vector<at::Tensor>& k_parts,
                                            const std::vector<int64_t>& v_layout, const std::vector<at::Tensor>& v_parts,
                                            const std::vector<int64_t>& kf_layout,
                                            const std::vector<at::Tensor>& kf_parts,
                                            const std::vector<int64_t>& vf_layout,
                                            const std::vector<at::Tensor>& vf_parts, const at::Tensor& side_map,
                                            int64_t block_size, int64_t head_dim) {
  auto h = make_halves(k_layout, k_parts, v_layout, v_parts, block_size, head_dim);
  h->KF = make_half("key (finer)", kf_layout, kf_parts, block_size, head_dim);
  h->VF = make_half("value (finer)", vf_layout, vf_parts, block_size, head_dim);
  check_tensor(side_map, at::kLong, {h->K.num_blocks}, "side_map");
  for (auto [coarse, fine] : {std::pair{&h->K, &h->KF}, std::pair{&h->V, &h->VF}}) {
    KVS_REQUIRE(fine->H == coarse->H && !fine->residual, "a finer half holds the same heads and no residual rows");
    KVS_REQUIRE(coarse->residual, "a refined half keeps its open blocks in residual rows");
    KVS_REQUIRE(fine->num_blocks <= coarse->num_blocks + coarse->residual_rows, "more side slots than blocks");
    coarse->fine = fine;
    coarse->side = side_map.data_ptr<int64_t>();
    // writes: every token to its row; a filled block is encoded from its row into both formats
    coarse->rows_only = fine->rows_only = true;
    fine->residual = coarse->residual;
    fine->residual_dtype = coarse->residual_dtype;
    fine->residual_rows = coarse->residual_rows;
  }
  for (const auto* parts : {&kf_parts, &vf_parts})
    for (const auto& t : *parts)
      if (present(t)) h->keep.push_back(t);
  h->keep.push_back(side_map);
  return h;
}

void run_halves(const Halves& h, const at::Tensor& q, at::Tensor out, const at::Tensor& block_tables,
                const at::Tensor& context_lens, const at::Tensor& query_starts, const at::Tensor& open_rows,
                double scale, const at::Tensor& query_positions, int64_t window) {
  KVS_REQUIRE(q.dim() == 3, "q must be [tokens, heads, head_dim], got " + shape_str(q));
  run_views(h.K, h.V, q, out, block_tables, context_lens, query_starts, open_rows, scale, nullptr, nullptr,
            positions_or_none(query_positions), window);
}

// run_halves, also adding each scored query's attention weights to `scores` (see kernel.h).
void run_halves_scored(const Halves& h, const at::Tensor& q, at::Tensor out, const at::Tensor& block_tables,
                       const at::Tensor& context_lens, const at::Tensor& query_starts, const at::Tensor& open_rows,
                       double scale, at::Tensor scores, const at::Tensor& score_from,
                       const at::Tensor& query_positions) {
  KVS_REQUIRE(q.dim() == 3, "q must be [tokens, heads, head_dim], got " + shape_str(q));
  run_views(h.K, h.V, q, out, block_tables, context_lens, query_starts, open_rows, scale, &scores, &score_from,
            positions_or_none(query_positions));
}

void write_halves(const Halves& h, const at::Tensor& key, const at::Tensor& value, const at::Tensor& slots,
                  const at::Tensor& residual_slots, const at::Tensor& encode_rows, const at::Tensor& encode_block_ids) {
  write_views(h.K, h.V, key, value, slots, residual_slots, encode_rows, encode_block_ids);
}

// write_halves on refined halves, then the filled blocks `refine_rows` also encoded into their
// side slots `refine_slots` in the finer format.
void write_halves_refined(const Halves& h, const at::Tensor& key, const at::Tensor& value, const at::Tensor& slots,
                          const at::Tensor& residual_slots, const at::Tensor& encode_rows,
                          const at::Tensor& encode_block_ids, const at::Tensor& refine_rows,
                          const at::Tensor& refine_slots) {
  KVS_REQUIRE(h.K.fine && h.V.fine, "these halves have no finer format (make_halves_refined)");
  write_views(h.K, h.V, key, value, slots, residual_slots, encode_rows, encode_block_ids);
  if (refine_rows.numel() == 0) return;
  write_views(h.KF, h.VF, key.narrow(0, 0, 0), value.narrow(0, 0, 0), slots, residual_slots.narrow(0, 0, 0),
              refine_rows, refine_slots);
}

}  // namespace kvs

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvserve paged attention over compressed KV blocks (CPU)";
  m.def("run", &kvs::run, "paged attention: see kvserve/attention/cpu.py");
  m.def("write_kv", &kvs::write_kv, "one layer's new keys and values into their blocks: see kvserve/attention/cpu_writes.py");
  // module_local: two builds of this extension (two instruction sets) each register it
  pybind11::class_<kvs::Halves, std::shared_ptr<kvs::Halves>>(m, "Halves", pybind11::module_local());
  m.def("make_halves", &kvs::make_halves, "a layer's key and value halves, checked once");
  m.def("make_halves_refined", &kvs::make_halves_refined, "make_halves() with each half's finer format and side map");
  m.def("run_halves", &kvs::run_halves, "run() on registered halves");
  m.def("run_halves_scored", &kvs::run_halves_scored, "run_halves(), adding the attention weights keys get to scores");
  m.def("write_halves", &kvs::write_halves, "write_kv() on registered halves");
  m.def("write_halves_refined", &kvs::write_halves_refined, "write_halves() and the finer copies of filled blocks");
#if KVS_W == 16 && defined(__AVX512VBMI__)
  m.attr("isa") = "avx512vbmi";
#elif KVS_W == 16
  m.attr("isa") = "avx512";
#elif KVS_W == 8
  m.attr("isa") = "avx2";
#else
  m.attr("isa") = "scalar";
#endif
}

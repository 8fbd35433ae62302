// The model's CPU kernels: products with quantized weights (qkernel.h), RoPE (rope.h) and the
// norms a layer's torch ops would cost more than their arithmetic (norms.h). This
// file checks the tensors: a weight's once, when it is registered, and per call only what a
// call brings (x, out, the norm weight, positions).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "norms.h"
#include "qkernel.h"
#include "rope.h"
#include "rowmax.h"

namespace kvs {
namespace {

#define KVS_Q_REQUIRE(ok, msg)                                \
  do {                                                        \
    if (!(ok)) throw std::invalid_argument(std::string(msg)); \
  } while (0)

std::string shape_str(const at::Tensor& t) {
  std::string s = "[";
  for (int64_t i = 0; i < t.dim(); ++i) s += (i ? ", " : "") + std::to_string(t.size(i));
  return s + "]";
}

bool present(const at::Tensor& t) { return t.defined() && t.dim() > 0; }

void check(const at::Tensor& t, at::ScalarType dtype, const std::vector<int64_t>& shape, const std::string& name) {
  KVS_Q_REQUIRE(present(t), name + " is missing");
  KVS_Q_REQUIRE(t.device().is_cpu(), name + " must be a CPU tensor");
  KVS_Q_REQUIRE(t.scalar_type() == dtype, name + " has dtype " + std::string(c10::toString(t.scalar_type())) +
                                              ", expected " + std::string(c10::toString(dtype)));
  bool same = t.dim() == static_cast<int64_t>(shape.size());
  for (size_t i = 0; same && i < shape.size(); ++i) same = t.size(i) == shape[i];
  std::string want = "[";
  for (size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + std::to_string(shape[i]);
  KVS_Q_REQUIRE(same, name + " must have shape " + want + "], got " + shape_str(t));
  KVS_Q_REQUIRE(t.is_contiguous(), name + " must be contiguous");
}

template <typename T>
const T* ptr(const at::Tensor& t) {
  return reinterpret_cast<const T*>(t.data_ptr());
}

// parts: codes, high, scale, min, sub_scale, sub_min, super_scale, super_min (absent: 0-dim)
q::Segment make_segment(int kind, int64_t rows, int64_t K, int64_t group_blocks, const std::vector<at::Tensor>& parts,
                        const std::string& name) {
  KVS_Q_REQUIRE(parts.size() == 8, name + ": expected 8 parts");
  KVS_Q_REQUIRE(rows > 0 && K > 0 && K % q::kBlock == 0, name + ": K must be a positive multiple of 32, got " +
                                                             std::to_string(K));
  q::Segment s;
  s.kind = kind;
  s.rows = rows;
  s.K = K;
  s.tiles = (rows + q::kLanes - 1) / q::kLanes;
  const int64_t T = s.tiles, KB = K / q::kBlock, L = q::kLanes;
  switch (kind) {
    case q::Q4_0:
    case q::Q4_1:
    case q::Q5_0:
    case q::Q5_1:
    case q::Q8_0: {
      KVS_Q_REQUIRE(group_blocks > 0 && KB % group_blocks == 0,
                    name + ": group of " + std::to_string(group_blocks * 32) + " does not divide K " + std::to_string(K));
      s.group_blocks = group_blocks;
      check(parts[0], at::kByte, {T, KB, q::code_bytes(kind)}, name + " codes");
      check(parts[2], at::kHalf, {T, KB / group_blocks, L}, name + " scale");
      s.scale = ptr<uint16_t>(parts[2]);
      if (q::has_min(kind)) {
        check(parts[3], at::kHalf, {T, KB / group_blocks, L}, name + " min");
        s.min = ptr<uint16_t>(parts[3]);
      }
      break;
    }
    case q::Q4_K:
    case q::Q5_K:
    case q::Q6_K: {
      KVS_Q_REQUIRE(K % q::kSuper == 0, name + ": K-quants need K a multiple of 256, got " + std::to_string(K));
      check(parts[0], at::kByte, {T, KB, 256}, name + " codes");
      check(parts[6], at::kHalf, {T, K / q::kSuper, L}, name + " super_scale");
      s.super_scale = ptr<uint16_t>(parts[6]);
      if (kind == q::Q6_K) {
        check(parts[4], at::kChar, {T, 2 * KB, L}, name + " sub_scale");
      } else {
        check(parts[4], at::kByte, {T, KB, L}, name + " sub_scale");
        check(parts[5], at::kByte, {T, KB, L}, name + " sub_min");
        check(parts[7], at::kHalf, {T, K / q::kSuper, L}, name + " super_min");
        s.sub_min = ptr<uint8_t>(parts[5]);
        s.super_min = ptr<uint16_t>(parts[7]);
      }
      s.sub_scale = ptr<uint8_t>(parts[4]);
      break;
    }
    default:
      throw std::invalid_argument(name + ": unknown weight kind " + std::to_string(kind));
  }
  if (q::high_bytes(kind) > 0) {
    check(parts[1], at::kByte, {T, KB, q::high_bytes(kind)}, name + " high");
    s.high = ptr<uint8_t>(parts[1]);
  }
  s.codes = ptr<uint8_t>(parts[0]);
  return s;
}

// A registered weight: the kernel's view and the tensors it points into, kept alive.
struct PyWeight {
  q::Weight w;
  std::vector<at::Tensor> keep;
};

std::shared_ptr<PyWeight> make_weight(const std::vector<std::tuple<int, int64_t, int64_t, int64_t, std::vector<at::Tensor>>>& segs,
                                      const at::Tensor& bias, const at::Tensor& outlier_channels,
                                      const at::Tensor& outlier_weight) {
  KVS_Q_REQUIRE(!segs.empty(), "a weight needs at least one segment");
  auto pw = std::make_shared<PyWeight>();
  q::Weight& w = pw->w;
  for (size_t i = 0; i < segs.size(); ++i) {
    const auto& [kind, rows, K, group_blocks, parts] = segs[i];
    q::Segment s = make_segment(kind, rows, K, group_blocks, parts, "segment " + std::to_string(i));
    KVS_Q_REQUIRE(i == 0 || K == w.K, "segments must share K");
    s.col0 = w.N;
    s.tile0 = w.tiles;
    w.K = K;
    w.N += rows;
    w.tiles += s.tiles;
    w.segments.push_back(s);
    for (const auto& p : parts)
      if (present(p)) pw->keep.push_back(p);
  }
  if (present(bias)) {
    check(bias, at::kFloat, {w.N}, "bias");
    w.bias = ptr<float>(bias);
    pw->keep.push_back(bias);
  }
  if (present(outlier_channels)) {
    const int64_t n = outlier_channels.size(0);
    check(outlier_channels, at::kInt, {n}, "outlier_channels");
    check(outlier_weight, at::kFloat, {w.tiles, n, q::kLanes}, "outlier_weight");
    const int32_t* ch = ptr<int32_t>(outlier_channels);
    for (int64_t j = 0; j < n; ++j)
      KVS_Q_REQUIRE(ch[j] >= 0 && ch[j] < w.K, "outlier channel " + std::to_string(ch[j]) + " is outside K");
    w.num_outliers = n;
    w.outlier_channels = ch;
    w.outlier_weight = ptr<float>(outlier_weight);
    pw->keep.push_back(outlier_channels);
    pw->keep.push_back(outlier_weight);
  }
  return pw;
}

// out[M, N] = (or +=) prologue(x) W^T. x: [M, K] float32 rows (or [M, 2K], gate then up, for
// SWIGLU and GEGLU), unit column stride; out: [M, N] float32, unit column stride.
void linear(const PyWeight& pw, const at::Tensor& x, at::Tensor out, int64_t prologue, const at::Tensor& norm,
            double eps, bool add) {
  const q::Weight& w = pw.w;
  KVS_Q_REQUIRE(x.dim() == 2 && x.device().is_cpu() && x.scalar_type() == at::kFloat && x.stride(1) == 1,
                "x must be a CPU float32 matrix with unit column stride, got " + shape_str(x));
  const int64_t M = x.size(0);
  const int64_t want = prologue == q::SWIGLU || prologue == q::GEGLU ? 2 * w.K : w.K;
  KVS_Q_REQUIRE(x.size(1) == want, "x has " + std::to_string(x.size(1)) + " columns, the weight takes " +
                                       std::to_string(want));
  KVS_Q_REQUIRE(out.dim() == 2 && out.device().is_cpu() && out.scalar_type() == at::kFloat && out.stride(1) == 1 &&
                    out.size(0) == M && out.size(1) == w.N,
                "out must be a CPU float32 [" + std::to_string(M) + ", " + std::to_string(w.N) +
                    "] matrix with unit column stride, got " + shape_str(out));
  KVS_Q_REQUIRE(prologue >= q::NONE && prologue <= q::GEGLU, "unknown prologue " + std::to_string(prologue));
  if (prologue == q::RMSNORM) check(norm, at::kFloat, {w.K}, "norm");
  if (M == 0) return;
  q::linear(w, x.data_ptr<float>(), M, x.stride(0), static_cast<int>(prologue),
            prologue == q::RMSNORM ? norm.data_ptr<float>() : nullptr, static_cast<float>(eps), out.data_ptr<float>(),
            out.stride(0), add);
}

at::Tensor dequantize_rows(const PyWeight& pw, const at::Tensor& rows) {
  const q::Weight& w = pw.w;
  KVS_Q_REQUIRE(rows.dim() == 1 && rows.device().is_cpu() && rows.scalar_type() == at::kLong && rows.is_contiguous(),
                "rows must be a contiguous CPU int64 vector");
  const int64_t R = rows.size(0);
  const int64_t* ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i)
    KVS_Q_REQUIRE(ids[i] >= 0 && ids[i] < w.N, "row " + std::to_string(ids[i]) + " is outside [0, " +
                                                   std::to_string(w.N) + ")");
  at::Tensor out = at::empty({R, w.K}, at::TensorOptions().dtype(at::kFloat));
  float* o = out.data_ptr<float>();
#pragma omp parallel for schedule(static) if (R * w.K > (1 << 16))
  for (int64_t i = 0; i < R; ++i) q::dequant_row(w, ids[i], o + i * w.K);
  return out;
}

// The checks of a call over the fused Q/K/V rows at given positions (rope_qk, qk_norm_rope);
// returns the rows' count.
int64_t check_qkv_positions(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                            const at::Tensor& sin, int64_t H, int64_t Hkv, int64_t D) {
  KVS_Q_REQUIRE(qkv.dim() == 2 && qkv.device().is_cpu() && qkv.scalar_type() == at::kFloat && qkv.stride(1) == 1 &&
                    qkv.size(1) >= (H + Hkv) * D,
                "qkv must be a CPU float32 matrix of at least (heads + kv heads) x head_dim columns, got " +
                    shape_str(qkv));
  KVS_Q_REQUIRE(D > 0 && D % 2 == 0, "head_dim must be even");
  const int64_t T = qkv.size(0);
  check(positions, at::kLong, {T}, "positions");
  KVS_Q_REQUIRE(cos.dim() == 2 && cos.size(1) == D / 2, "cos must be [positions, head_dim / 2]");
  check(cos, at::kFloat, {cos.size(0), D / 2}, "cos");
  check(sin, at::kFloat, {cos.size(0), D / 2}, "sin");
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t)
    KVS_Q_REQUIRE(pos[t] >= 0 && pos[t] < cos.size(0), "position " + std::to_string(pos[t]) + " is outside the tables");
  return T;
}

// (q [T, H, D], k [T, Hkv, D]) rotated, from qkv [T, >= (H + Hkv) D] (unit column stride).
std::tuple<at::Tensor, at::Tensor> rope_qk(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos,
                                           const at::Tensor& sin, int64_t H, int64_t Hkv, int64_t D) {
  const int64_t T = check_qkv_positions(qkv, positions, cos, sin, H, Hkv, D);
  at::Tensor q = at::empty({T, H, D}, qkv.options());
  at::Tensor k = at::empty({T, Hkv, D}, qkv.options());
  rope::rope_qk(qkv.data_ptr<float>(), qkv.stride(0), T, H, Hkv, D, positions.data_ptr<int64_t>(),
                cos.data_ptr<float>(), sin.data_ptr<float>(), q.data_ptr<float>(), k.data_ptr<float>());
  return {q, k};
}

// h += rms_norm(x) * w, row by row, in place
void norm_add(at::Tensor h, const at::Tensor& x, const at::Tensor& w, double eps) {
  KVS_Q_REQUIRE(h.dim() == 2, "h must be [rows, n], got " + shape_str(h));
  const int64_t T = h.size(0), n = h.size(1);
  check(h, at::kFloat, {T, n}, "h");
  check(x, at::kFloat, {T, n}, "x");
  check(w, at::kFloat, {n}, "w");
  norms::norm_add(h.data_ptr<float>(), ptr<float>(x), ptr<float>(w), T, n, static_cast<float>(eps));
}

// queries [T, H, D] and keys [T, Hkv, D] of the fused Q/K/V rows, each head normed then rotated
std::tuple<at::Tensor, at::Tensor> qk_norm_rope(const at::Tensor& qkv, const at::Tensor& positions,
                                                const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& qw,
                                                const at::Tensor& kw, int64_t H, int64_t Hkv, int64_t D, double eps) {
  const int64_t T = check_qkv_positions(qkv, positions, cos, sin, H, Hkv, D);
  check(qw, at::kFloat, {D}, "qw");
  check(kw, at::kFloat, {D}, "kw");
  at::Tensor q = at::empty({T, H, D}, qkv.options());
  at::Tensor k = at::empty({T, Hkv, D}, qkv.options());
  std::vector<float> tmp(static_cast<size_t>(D));
  norms::qk_norm_rope(qkv.data_ptr<float>(), qkv.stride(0), T, H, Hkv, D, positions.data_ptr<int64_t>(),
                      cos.data_ptr<float>(), sin.data_ptr<float>(), ptr<float>(qw), ptr<float>(kw),
                      static_cast<float>(eps), tmp.data(), q.data_ptr<float>(), k.data_ptr<float>());
  return {q, k};
}

// Each row's (max, first index of it) of a float32 [n, V] matrix, and a mask of the rows left to
// torch (holding a NaN: rowmax.h), whose entries are not written.
std::tuple<at::Tensor, at::Tensor, at::Tensor> row_argmax(const at::Tensor& logits) {
  KVS_Q_REQUIRE(logits.dim() == 2 && logits.device().is_cpu() && logits.scalar_type() == at::kFloat &&
                    logits.is_contiguous(),
                "logits must be a contiguous CPU float32 matrix, got " + shape_str(logits));
  const int64_t n = logits.size(0), V = logits.size(1);
  at::Tensor values = at::empty({n}, at::TensorOptions().dtype(at::kFloat));
  at::Tensor indices = at::empty({n}, at::TensorOptions().dtype(at::kLong));
  at::Tensor rest = at::zeros({n}, at::TensorOptions().dtype(at::kBool));
  const float* x = logits.data_ptr<float>();
  float* v = values.data_ptr<float>();
  int64_t* ix = indices.data_ptr<int64_t>();
  bool* r = rest.data_ptr<bool>();
  {
    pybind11::gil_scoped_release release;
#pragma omp parallel for schedule(static) if (n > 1)
    for (int64_t i = 0; i < n; ++i) r[i] = !rowmax::argmax_unless_nan(x + i * V, V, v + i, ix + i);
  }
  return {values, indices, rest};
}

}  // namespace
}  // namespace kvs

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "kvserve model kernels (CPU): products with quantized weights read in place, RoPE";
  // module_local: two builds of this extension (two instruction sets) each register it
  pybind11::class_<kvs::PyWeight, std::shared_ptr<kvs::PyWeight>>(m, "Weight", pybind11::module_local())
      .def_property_readonly("rows", [](const kvs::PyWeight& w) { return w.w.N; })
      .def_property_readonly("cols", [](const kvs::PyWeight& w) { return w.w.K; });
  m.def("make_weight", &kvs::make_weight, "register a packed weight: see kvserve/model/formats/cpu.py");
  m.def("linear", &kvs::linear, "out = (or +=) prologue(x) W^T", pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("dequantize_rows", &kvs::dequantize_rows, "rows of W as float32");
  m.def("rope_qk", &kvs::rope_qk, "queries and keys rotated, from the fused Q/K/V rows");
  m.def("norm_add", &kvs::norm_add, "h += rms_norm(x) * w, in place");
  m.def("int8_peak", &kvs::q::int8_peak, "multiply-adds a second of the products' integer instruction, every thread",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("amx", &kvs::q::amx::enabled, "whether batches of at least amx_rows rows take AMX's tiles (amx.h)");
  m.attr("amx_rows") = kvs::q::kAmxRows;
  m.def("amx_peak", &kvs::q::amx::peak, "multiply-adds a second of AMX's half-block instruction, every thread (0 without AMX)",
        pybind11::call_guard<pybind11::gil_scoped_release>());
  m.def("set_amx", [](bool on) { return kvs::q::amx::switched_on().exchange(on); },
        "let AMX take the batches it fits (the default) or not; returns the previous setting");
  m.def("row_argmax", &kvs::row_argmax, "each row's max and first index of it (rows holding a NaN: masked out, left to torch)");
  m.def("qk_norm_rope", &kvs::qk_norm_rope, "queries and keys each head normed, then rotated, from the fused Q/K/V rows");
#if defined(KVS_Q_VNNI)
  m.attr("isa") = "avx512vnni";
#elif KVS_W == 8
  m.attr("isa") = "avx2";
#else
  m.attr("isa") = "scalar";
#endif
}

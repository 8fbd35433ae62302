// ArkVale's page selection for one layer and one decode query, in one call: score every full
// block by its key digest, take the top set, and pair the host blocks entering it with the
// resident blocks leaving it, best gain first, while the gain exceeds a margin.
// The contract and the torch twin are in kvserve/kv/budget/pages.py.

#include <torch/extension.h>

#include "simd.h"

#include <algorithm>
#include <cstring>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

namespace kvs {

namespace {

constexpr uint8_t kHost = 0, kResident = 1, kLost = 2;     // pages.py's HOST, RESIDENT, LOST

// NG query heads of one KV head over the blocks [0, nb): s[h][b] = sum over the box rows c of
// box[c][b] * wq[h][c], summed in row order (the same float sums whatever NG and the ISA).
// Vector builds hold NG x 2 vectors of sums in registers across the rows, so each box row
// tile is loaded once for the NG heads and no sum goes through memory.
template <int NG>
void score_heads(const uint16_t* kb, int64_t stride, const float* wq, int64_t rows, int64_t nb, float* s) {
  int64_t b = 0;
#ifdef KVS_SIMD
  for (; b + 2 * W <= nb; b += 2 * W) {
    vf acc[NG][2];
    for (int g = 0; g < NG; ++g) acc[g][0] = acc[g][1] = vzero();
    for (int64_t c = 0; c < rows; ++c) {
      const uint16_t* row = kb + c * stride + b;
      _mm_prefetch(reinterpret_cast<const char*>(row + 4 * W), _MM_HINT_T0);   // the tile after next
      const vf x0 = vload_f16(row), x1 = vload_f16(row + W);
      for (int g = 0; g < NG; ++g) {
        const vf w = vset1(wq[g * rows + c]);
        acc[g][0] = vfma(x0, w, acc[g][0]);
        acc[g][1] = vfma(x1, w, acc[g][1]);
      }
    }
    for (int g = 0; g < NG; ++g) {
      vstore(s + g * nb + b, acc[g][0]);
      vstore(s + g * nb + b + W, acc[g][1]);
    }
  }
#endif
  for (; b < nb; ++b)
    for (int g = 0; g < NG; ++g) {
      float acc = 0.f;
      for (int64_t c = 0; c < rows; ++c) acc = std::fma(f16_to_f32(kb[c * stride + b]), wq[g * rows + c], acc);
      s[g * nb + b] = acc;
    }
}

// box [kv, 2D, blocks] float16 (centre, then half width, per channel), q [heads, D]: each
// block's score, relative to every head's best block, then its best head's. The products run
// along the blocks, so they vectorize with no horizontal sums; each box row is read once per
// four query heads (half the bytes of float32: at 8k tokens a layer's box is ~0.4 MB, read
// every decode step).
std::vector<float> scores(const uint16_t* box, int64_t stride, const float* q, int64_t kv, int64_t nb,
                          int64_t dim, int64_t group, float weight) {
  const int64_t heads = kv * group, rows = 2 * dim;
  std::vector<float> wq(heads * rows);        // per query head, the weight of each box row
  for (int64_t h = 0; h < heads; ++h)
    for (int64_t c = 0; c < rows; ++c)
      wq[h * rows + c] = c < dim ? q[h * dim + c] : weight * std::fabs(q[h * dim + c - dim]);
  std::vector<float> s(heads * nb);          // [heads, blocks]
  // KV heads in parallel when there is enough to share (each writes its own rows of s)
#pragma omp parallel for schedule(static) if (kv > 1 && nb >= 256)
  for (int64_t k = 0; k < kv; ++k) {
    const uint16_t* kb = box + k * rows * stride;
    for (int64_t g = 0; g < group; g += 4) {
      const int64_t h = k * group + g;
      const float* w = wq.data() + h * rows;
      float* out = s.data() + h * nb;
      switch (std::min<int64_t>(4, group - g)) {
        case 4: score_heads<4>(kb, stride, w, rows, nb, out); break;
        case 3: score_heads<3>(kb, stride, w, rows, nb, out); break;
        case 2: score_heads<2>(kb, stride, w, rows, nb, out); break;
        default: score_heads<1>(kb, stride, w, rows, nb, out); break;
      }
    }
  }
  std::vector<float> out(nb, -std::numeric_limits<float>::infinity());
  for (int64_t h = 0; h < heads; ++h) {
    const float* sh = s.data() + h * nb;
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t b = 0; b < nb; ++b) best = std::max(best, sh[b]);
    for (int64_t b = 0; b < nb; ++b) out[b] = std::max(out[b], sh[b] - best);
  }
  return out;
}

// box: the store [kv, 2D, capacity] float16 whose first num_blocks columns are the blocks
void check_box(const torch::Tensor& box, int64_t num_blocks, const torch::Tensor& q) {
  TORCH_CHECK(box.dim() == 3 && box.scalar_type() == torch::kFloat16 && box.is_contiguous() && !box.is_cuda(),
              "box: contiguous CPU float16 [kv_heads, 2 * dim, capacity]");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "q: contiguous float32 [heads, dim]");
  TORCH_CHECK(box.size(1) == 2 * q.size(1) && q.size(0) % box.size(0) == 0, "box and q shapes disagree");
  TORCH_CHECK(num_blocks >= 0 && num_blocks <= box.size(2), "num_blocks out of range");
}

// The pairs (host block coming in, resident block going out) for scores s, best gain first
// (see pages.py; s is changed: lost and NaN blocks -inf, the first and latest +inf).
std::vector<int64_t> choose_pairs(std::vector<float>& s, const uint8_t* at, int64_t nb, int64_t num_top,
                                  double margin) {
  const float inf = std::numeric_limits<float>::infinity();
  for (int64_t b = 0; b < nb; ++b)    // lost (evicted from the host store) and NaN scores last
    if ((at[b] != kHost && at[b] != kResident) || std::isnan(s[b])) s[b] = -inf;
  if (nb > 0) s[0] = s[nb - 1] = inf;                            // the sinks and the latest block
  // best first, ties to the lower index (torch.sort(descending=True, stable=True)): a strict
  // total order, so the top set does not depend on how it is found
  auto better = [&](int64_t a, int64_t b) { return s[a] > s[b] || (s[a] == s[b] && a < b); };
  std::vector<int64_t> order(nb);
  std::iota(order.begin(), order.end(), 0);
  if (num_top < nb) std::nth_element(order.begin(), order.begin() + num_top, order.end(), better);
  std::vector<int64_t> coming, going;
  for (int64_t r = 0; r < num_top; ++r)
    if (at[order[r]] == kHost) coming.push_back(order[r]);
  for (int64_t r = num_top; r < nb; ++r)
    if (at[order[r]] == kResident) going.push_back(order[r]);
  std::sort(coming.begin(), coming.end(), better);
  std::sort(going.begin(), going.end(), [&](int64_t a, int64_t b) { return better(b, a); });   // worst first
  std::vector<int64_t> pairs;
  for (size_t n = 0; n < coming.size() && n < going.size(); ++n) {
    if (!(s[coming[n]] - s[going[n]] > margin)) break;
    pairs.push_back(coming[n]);
    pairs.push_back(going[n]);
  }
  return pairs;
}

std::vector<float> box_scores(const torch::Tensor& box, int64_t nb, const torch::Tensor& q, double weight) {
  return scores(reinterpret_cast<const uint16_t*>(box.data_ptr<at::Half>()), box.size(2), q.data_ptr<float>(),
                box.size(0), nb, q.size(1), q.size(0) / box.size(0), static_cast<float>(weight));
}

void check_where(const torch::Tensor& where, int64_t nb, int64_t num_top) {
  TORCH_CHECK(where.dim() == 1 && where.size(0) == nb && where.scalar_type() == torch::kUInt8 &&
              where.is_contiguous(), "where: contiguous uint8 [blocks]");
  TORCH_CHECK(num_top >= 0 && num_top <= nb, "num_top out of range");
}

torch::Tensor as_tensor(const std::vector<int64_t>& flat, int64_t width) {
  auto out = torch::empty({static_cast<int64_t>(flat.size()) / width, width}, torch::kInt64);
  std::copy(flat.begin(), flat.end(), out.data_ptr<int64_t>());
  return out;
}

}  // namespace

// Every block's digest score for q: [blocks] float32.
torch::Tensor digest_scores(const torch::Tensor& box, int64_t num_blocks, const torch::Tensor& q, double weight) {
  check_box(box, num_blocks, q);
  std::vector<float> s = box_scores(box, num_blocks, q, weight);
  auto out = torch::empty({num_blocks}, torch::kFloat32);
  std::copy(s.begin(), s.end(), out.data_ptr<float>());
  return out;
}

// Returns [swaps, 2] int64: (host block coming in, resident block going out).
torch::Tensor select_pages(const torch::Tensor& box, int64_t num_blocks, const torch::Tensor& q, double weight,
                           const torch::Tensor& where, int64_t num_top, double margin) {
  check_box(box, num_blocks, q);
  check_where(where, num_blocks, num_top);
  std::vector<float> s = box_scores(box, num_blocks, q, weight);
  return as_tensor(choose_pairs(s, where.data_ptr<uint8_t>(), num_blocks, num_top, margin), 2);
}

// One ArkVale decode step for one layer, where the device blocks are CPU tensors: choose the
// swaps (select_pages) and make them, in one pass with no Python between. rows [>= blocks]
// int64: the host pool row of each stashed block, -1 where the store holds none (a HOST block
// without a row was evicted for room: it is marked LOST here). key_parts / value_parts: each
// half's per-block tensors [num_device_blocks, ...] (a float cache: the blocks themselves; a
// quantized one: its codec's parts), whose bytes for one block, in order, are what a pool half
// row [rows, 2, ...] holds (then padding). Per pair (j_in, j_out): the pool row of j_in and the
// device block block_ids[i] holding j_out (i: j_out's place in resident) trade contents, so
// j_out is stashed in the row j_in leaves (rows, where, resident and pos [kv_heads, slots]
// int64, positions of slot-block i, are updated). Returns [swaps, 3] int64: (j_in, j_out, i),
// for the store's own index and the caller's lists.
torch::Tensor swap_pages(const torch::Tensor& box, int64_t num_blocks, const torch::Tensor& q, double weight,
                         const torch::Tensor& where, int64_t num_top, double margin, const torch::Tensor& rows,
                         const torch::Tensor& pool, const std::vector<torch::Tensor>& key_parts,
                         const std::vector<torch::Tensor>& value_parts, const std::vector<int64_t>& block_ids,
                         const std::vector<int64_t>& resident, const torch::Tensor& pos, int64_t block_size) {
  check_box(box, num_blocks, q);
  check_where(where, num_blocks, num_top);
  const int64_t nb = num_blocks;
  TORCH_CHECK(rows.dim() == 1 && rows.size(0) >= nb && rows.scalar_type() == torch::kInt64 && rows.is_contiguous(),
              "rows: contiguous int64 [>= blocks]");
  TORCH_CHECK(pos.dim() == 2 && pos.scalar_type() == torch::kInt64 && !pos.is_cuda() &&
              pos.size(1) >= static_cast<int64_t>(resident.size()) * block_size, "pos: int64 [kv_heads, >= slots]");
  TORCH_CHECK(block_ids.size() >= resident.size(), "swap_pages: fewer table blocks than resident ones");
  uint8_t* at = where.data_ptr<uint8_t>();
  int64_t* row_of = rows.data_ptr<int64_t>();
  for (int64_t b = 0; b < nb; ++b)
    if (at[b] == kHost && row_of[b] < 0) at[b] = kLost;
  std::vector<float> s = box_scores(box, nb, q, weight);
  const std::vector<int64_t> pairs = choose_pairs(s, at, nb, num_top, margin);
  const int64_t n = static_cast<int64_t>(pairs.size() / 2);
  if (n == 0) return torch::empty({0, 3}, torch::kInt64);
  // each part: its base and bytes per block; the two halves' parts in one list, keys first
  struct Part { char* base; int64_t bytes; };
  std::vector<Part> parts;
  int64_t half_bytes[2] = {0, 0}, num_device = -1;
  for (int half = 0; half < 2; ++half)
    for (const torch::Tensor& t : half == 0 ? key_parts : value_parts) {
      TORCH_CHECK(t.is_contiguous() && !t.is_cuda() && t.dim() >= 1, "swap_pages: contiguous CPU part tensors");
      TORCH_CHECK(num_device < 0 || t.size(0) == num_device, "swap_pages: parts of different block counts");
      num_device = t.size(0);
      const int64_t bytes = num_device ? t.numel() / num_device * t.element_size() : 0;
      parts.push_back({static_cast<char*>(t.data_ptr()), bytes});
      half_bytes[half] += bytes;
    }
  TORCH_CHECK(!key_parts.empty() && !value_parts.empty(), "swap_pages: a half without parts");
  TORCH_CHECK(pool.is_contiguous() && !pool.is_cuda() && pool.dim() >= 2 && pool.size(1) == 2,
              "swap_pages: a contiguous CPU pool [rows, 2, ...]");
  const int64_t row_bytes = pool.size(0) ? pool[0][0].numel() * pool.element_size() : 0;
  TORCH_CHECK(half_bytes[0] <= row_bytes && half_bytes[1] <= row_bytes, "swap_pages: block shapes differ");
  auto* p = static_cast<char*>(pool.data_ptr());
  int64_t* ps = pos.data_ptr<int64_t>();
  const int64_t pos_heads = pos.size(0), pos_stride = pos.stride(0), pos_step = pos.stride(1);
  thread_local std::vector<char> held;
  // every pair checked before any is made: a bad index changes nothing
  std::vector<int64_t> out;       // (j_in, j_out, i) per pair
  for (int64_t m = 0; m < n; ++m) {
    const int64_t j_in = pairs[2 * m], j_out = pairs[2 * m + 1];
    const auto found = std::find(resident.begin(), resident.end(), j_out);
    TORCH_CHECK(found != resident.end(), "swap_pages: a resident block is not in resident");
    const int64_t i = found - resident.begin(), row = row_of[j_in], block = block_ids[i];
    TORCH_CHECK(row >= 0 && row < pool.size(0) && block >= 0 && block < num_device,
                "swap_pages: index out of range");
    out.insert(out.end(), {j_in, j_out, i});
  }
  const size_t num_key_parts = key_parts.size();
  for (int64_t m = 0; m < n; ++m) {
    const int64_t j_in = out[3 * m], j_out = out[3 * m + 1], i = out[3 * m + 2];
    const int64_t row = row_of[j_in], block = block_ids[i];
    char* pk = p + row * 2 * row_bytes;         // the row's keys; its values a row_bytes on
    for (size_t x = 0; x < parts.size(); ++x) {  // trade, part by part
      if (x == num_key_parts) pk = p + (row * 2 + 1) * row_bytes;
      const Part& part = parts[x];
      char* dev = part.base + block * part.bytes;
      held.resize(static_cast<size_t>(part.bytes));
      std::memcpy(held.data(), dev, part.bytes);
      std::memcpy(dev, pk, part.bytes);
      std::memcpy(pk, held.data(), part.bytes);
      pk += part.bytes;
    }
    row_of[j_out] = row;
    row_of[j_in] = -1;
    at[j_in] = kResident;
    at[j_out] = kHost;
    for (int64_t h = 0; h < pos_heads; ++h)
      for (int64_t t = 0; t < block_size; ++t)
        ps[h * pos_stride + (i * block_size + t) * pos_step] = j_in * block_size + t;
  }
  return as_tensor(out, 3);
}

}  // namespace kvs

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("digest_scores", &kvs::digest_scores, "every block's digest score: see kvserve/kv/budget/pages.py");
  m.def("select_pages", &kvs::select_pages, "ArkVale's swaps for one layer: see kvserve/kv/budget/pages.py");
  m.def("swap_pages", &kvs::swap_pages, "ArkVale's swaps for one layer, chosen and made: see arkvale.py");
}

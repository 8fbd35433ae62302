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

constexpr uint8_t kHost = 0, kResident = 1;

// box [kv, 2D, blocks] float16 (centre, then half width, per channel), q [heads, D]: each
// block's score, relative to every head's best block, then its best head's. The inner loop
// runs along the blocks, so it vectorizes with no horizontal sums, and each box row is read
// once per KV head (half the bytes of float32: at 8k tokens a layer's box is ~0.4 MB, read
// every decode step).
std::vector<float> scores(const uint16_t* box, int64_t stride, const float* q, int64_t kv, int64_t nb,
                          int64_t dim, int64_t group, float weight) {
  const int64_t heads = kv * group;
  std::vector<float> s(heads * nb, 0.f);          // [heads, blocks]
  // KV heads in parallel when there is enough to share (each writes its own rows of s)
#pragma omp parallel for schedule(static) if (kv > 1 && nb >= 256)
  for (int64_t k = 0; k < kv; ++k) {
    for (int64_t c = 0; c < 2 * dim; ++c) {
      const uint16_t* row = box + (k * 2 * dim + c) * stride;
      for (int64_t g = 0; g < group; ++g) {
        const int64_t h = k * group + g;
        const float x = q[h * dim + c % dim];
        const float w = c < dim ? x : weight * std::fabs(x);
        float* out = s.data() + h * nb;
        int64_t b = 0;
#ifdef KVS_SIMD
        const vf wv = vset1(w);
        for (; b + W <= nb; b += W) vstore(out + b, vfma(vload_f16(row + b), wv, vload(out + b)));
#endif
        for (; b < nb; ++b) out[b] = std::fma(f16_to_f32(row[b]), w, out[b]);
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

}  // namespace

// box: the store [kv, 2D, capacity] float16 whose first num_blocks columns are the blocks
void check_box(const torch::Tensor& box, int64_t num_blocks, const torch::Tensor& q) {
  TORCH_CHECK(box.dim() == 3 && box.scalar_type() == torch::kFloat16 && box.is_contiguous() && !box.is_cuda(),
              "box: contiguous CPU float16 [kv_heads, 2 * dim, capacity]");
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kFloat32 && q.is_contiguous(),
              "q: contiguous float32 [heads, dim]");
  TORCH_CHECK(box.size(1) == 2 * q.size(1) && q.size(0) % box.size(0) == 0, "box and q shapes disagree");
  TORCH_CHECK(num_blocks >= 0 && num_blocks <= box.size(2), "num_blocks out of range");
}

// Every block's digest score for q: [blocks] float32.
torch::Tensor digest_scores(const torch::Tensor& box, int64_t num_blocks, const torch::Tensor& q, double weight) {
  check_box(box, num_blocks, q);
  const int64_t kv = box.size(0), nb = num_blocks;
  std::vector<float> s = scores(reinterpret_cast<const uint16_t*>(box.data_ptr<at::Half>()), box.size(2),
                                q.data_ptr<float>(), kv, nb, q.size(1), q.size(0) / kv,
                                static_cast<float>(weight));
  auto out = torch::empty({nb}, torch::kFloat32);
  std::copy(s.begin(), s.end(), out.data_ptr<float>());
  return out;
}

// Returns [swaps, 2] int64: (host block coming in, resident block going out).
torch::Tensor select_pages(const torch::Tensor& box, int64_t num_blocks, const torch::Tensor& q, double weight,
                           const torch::Tensor& where, int64_t num_top, double margin) {
  check_box(box, num_blocks, q);
  const int64_t kv = box.size(0), nb = num_blocks, dim = q.size(1);
  TORCH_CHECK(where.dim() == 1 && where.size(0) == nb && where.scalar_type() == torch::kUInt8 &&
              where.is_contiguous(), "where: contiguous uint8 [blocks]");
  TORCH_CHECK(num_top >= 0 && num_top <= nb, "num_top out of range");
  std::vector<float> s = scores(reinterpret_cast<const uint16_t*>(box.data_ptr<at::Half>()), box.size(2),
                                q.data_ptr<float>(), kv, nb, dim, q.size(0) / kv,
                                static_cast<float>(weight));
  const uint8_t* at = where.data_ptr<uint8_t>();
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
  auto out = torch::empty({static_cast<int64_t>(pairs.size() / 2), 2}, torch::kInt64);
  std::copy(pairs.begin(), pairs.end(), out.data_ptr<int64_t>());
  return out;
}

// Exchange blocks between the host pool and a layer's paged tensors, in place: the pool rows
// rows_in go to the blocks block_ids, whose content goes to the rows rows_out (all read before
// any is written, so a row may be both; a row written twice keeps the later block). pool:
// [rows, 2, *block], cache_k/cache_v: [blocks, *block], one dtype, all contiguous CPU tensors.
void exchange_pages(const torch::Tensor& pool, const torch::Tensor& cache_k, const torch::Tensor& cache_v,
                    const std::vector<int64_t>& block_ids, const std::vector<int64_t>& rows_in,
                    const std::vector<int64_t>& going, const std::vector<int64_t>& rows_out) {
  TORCH_CHECK(pool.is_contiguous() && cache_k.is_contiguous() && cache_v.is_contiguous() && !pool.is_cuda() &&
              !cache_k.is_cuda(), "exchange_pages: contiguous CPU tensors");
  TORCH_CHECK(pool.scalar_type() == cache_k.scalar_type() && cache_k.scalar_type() == cache_v.scalar_type(),
              "exchange_pages: one dtype");
  const int64_t block_bytes = cache_k[0].numel() * cache_k.element_size();
  TORCH_CHECK(pool.dim() >= 2 && pool.size(1) == 2 && pool[0][0].numel() * pool.element_size() == block_bytes &&
              cache_v[0].numel() == cache_k[0].numel(), "exchange_pages: block shapes differ");
  TORCH_CHECK(block_ids.size() == rows_in.size() && going.size() == rows_out.size(), "exchange_pages: lengths");
  const int64_t num_rows = pool.size(0), num_blocks = cache_k.size(0);
  const int64_t n = static_cast<int64_t>(block_ids.size());
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(block_ids[i] >= 0 && block_ids[i] < num_blocks && rows_in[i] >= 0 && rows_in[i] < num_rows,
                "exchange_pages: index out of range");
  for (size_t i = 0; i < going.size(); ++i)
    TORCH_CHECK(going[i] >= 0 && going[i] < n && rows_out[i] >= 0 && rows_out[i] < num_rows,
                "exchange_pages: index out of range");
  auto* p = static_cast<char*>(pool.data_ptr());
  auto* k = static_cast<char*>(cache_k.data_ptr());
  auto* v = static_cast<char*>(cache_v.data_ptr());
  thread_local std::vector<char> incoming;
  incoming.resize(static_cast<size_t>(2 * n * block_bytes));
  for (int64_t i = 0; i < n; ++i)
    std::memcpy(incoming.data() + 2 * i * block_bytes, p + rows_in[i] * 2 * block_bytes, 2 * block_bytes);
  // going[i]: which of the n device blocks row rows_out[i] receives
  for (size_t i = 0; i < going.size(); ++i) {
    char* row = p + rows_out[i] * 2 * block_bytes;
    std::memcpy(row, k + block_ids[going[i]] * block_bytes, block_bytes);
    std::memcpy(row + block_bytes, v + block_ids[going[i]] * block_bytes, block_bytes);
  }
  for (int64_t i = 0; i < n; ++i) {
    std::memcpy(k + block_ids[i] * block_bytes, incoming.data() + 2 * i * block_bytes, block_bytes);
    std::memcpy(v + block_ids[i] * block_bytes, incoming.data() + (2 * i + 1) * block_bytes, block_bytes);
  }
}

}  // namespace kvs

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("digest_scores", &kvs::digest_scores, "every block's digest score: see kvserve/kv/budget/pages.py");
  m.def("exchange_pages", &kvs::exchange_pages, "blocks between the host pool and the paged tensors: see host_store.py");
  m.def("select_pages", &kvs::select_pages, "ArkVale's swaps for one layer: see kvserve/kv/budget/pages.py");
}

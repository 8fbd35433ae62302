// A loop's rate on every OpenMP thread: the benchmarks' peaks (qkernel.h's int8_peak, amx.h's
// peak) time one parallel region in which each thread runs its own loop.
#pragma once

#include <omp.h>

#include <chrono>
#include <cstdint>

namespace kvs {
namespace q {

// Operations a second: `body()` runs on every thread of one parallel region and does
// `per_thread` operations, returning a value of its results that is read here (so the compiler
// keeps the work).
template <class Body>
inline double every_thread_rate(double per_thread, Body body) {
  int threads = 1;
  int64_t sink = 0;
  const auto start = std::chrono::steady_clock::now();
#pragma omp parallel
  {
#pragma omp single
    threads = omp_get_num_threads();
    const int64_t kept = body();
#pragma omp atomic
    sink += kept;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return (sink == 42 ? 1.0 : 0.0) + static_cast<double>(threads) * per_thread / seconds;
}

}  // namespace q
}  // namespace kvs

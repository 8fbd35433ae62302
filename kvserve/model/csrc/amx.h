// AMX's int8 tile products (Intel Xeon since Sapphire Rapids), for the products' longer batches.
//
// One instruction multiplies a tile of 16 activation rows by a tile of weight codes and adds
// into 16 x 16 int32 sums on a unit of its own, beside the vector registers. A weight tile's
// bytes are the products' vectors as they are (qkernel.h: vector j holds, for each of the 16
// rows of a weight tile, its codes 4j .. 4j+3): AMX's layout for its second operand. The
// activations' scales change every 16 columns, so each product is one half block: 16 rows x 16
// columns of codes (a tile of 16 bytes a row) by 4 vectors (a tile of 4 rows of 64 bytes). The
// integer sums are exactly those of VNNI's instruction; the float steps that follow are the
// kernel's own (qkernel.h's finish), so results are the same bits either way.
//
// Usable when CPUID has AMX-TILE and AMX-INT8, the OS saves the tile state (XCR0 bits 17-18) and
// Linux grants this process the tile data (arch_prctl, asked once). Built into the AVX-512 VNNI
// build only (with -mamx-tile -mamx-int8: the instructions run only where available() says so).
#pragma once

#include <atomic>
#include <cstdint>

#include "rate.h"

#if defined(KVS_Q_VNNI) && defined(__AMX_TILE__) && defined(__AMX_INT8__)
#define KVS_Q_AMX 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace kvs {
namespace q {
namespace amx {

inline std::atomic<bool>& switched_on() {
  static std::atomic<bool> on{true};
  return on;
}

#if defined(KVS_Q_AMX)

inline bool probe() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if (!((d >> 24) & 1) || !((d >> 25) & 1)) return false;   // AMX-TILE, AMX-INT8
  if (!__get_cpuid(1, &a, &b, &c, &d) || !((c >> 27) & 1)) return false;   // OSXSAVE
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if (((lo >> 17) & 3) != 3) return false;   // XTILECFG, XTILEDATA enabled by the OS
  constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
}

// Whether this CPU and OS run the tiles (probed once a process).
inline bool available() {
  static const bool ok = probe();
  return ok;
}

struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// This thread's tiles: 0, 1 a block's two halves of activations (16 rows x 16 bytes), 2, 3 its
// two halves of weight codes (4 rows x 64 bytes), 4, 5 and 6, 7 two blocks' products (16 rows
// x 16 int32 per half): a block's products run while the previous block's are stored.
inline void configure() {
  Config c;
  for (int i : {0, 1}) c.rows[i] = 16, c.colsb[i] = 16;
  for (int i : {2, 3}) c.rows[i] = 4, c.colsb[i] = 64;
  for (int i : {4, 5, 6, 7}) c.rows[i] = 16, c.colsb[i] = 64;
  _tile_loadconfig(&c);
}

inline void release() { _tile_release(); }

// Starts one block's products into pair P of product tiles: `a` the block's activations (16
// rows of 32 codes, row stride `stride`), `w` its 8 vectors of codes (512 bytes). Signed codes
// (Q8_0) take the signed-by-signed instruction, the rest signed activations by unsigned codes.
// (The tile numbers are spelled out: the intrinsics take literals.)
template <bool SIGNED_CODES, int P>
inline void issue(const int8_t* a, int64_t stride, const uint8_t* w) {
  _tile_loadd(0, a, stride);
  _tile_loadd(1, a + 16, stride);
  _tile_loadd(2, w, 64);
  _tile_loadd(3, w + 256, 64);
  if constexpr (P == 0) {
    _tile_zero(4);
    _tile_zero(5);
    if constexpr (SIGNED_CODES) { _tile_dpbssd(4, 0, 2); _tile_dpbssd(5, 1, 3); }
    else { _tile_dpbsud(4, 0, 2); _tile_dpbsud(5, 1, 3); }
  } else {
    _tile_zero(6);
    _tile_zero(7);
    if constexpr (SIGNED_CODES) { _tile_dpbssd(6, 0, 2); _tile_dpbssd(7, 1, 3); }
    else { _tile_dpbsud(6, 0, 2); _tile_dpbsud(7, 1, 3); }
  }
}

// Pair P's sums, row r at out0 / out1 + 16 r.
template <int P>
inline void collect(int32_t* out0, int32_t* out1) {
  if constexpr (P == 0) {
    _tile_stored(4, out0, 64);
    _tile_stored(5, out1, 64);
  } else {
    _tile_stored(6, out0, 64);
    _tile_stored(7, out1, 64);
  }
}

// Multiply-adds a second of the tiles' half-block instruction (16 rows x 16 codes by 16 weight
// rows), on every OpenMP thread: 4 independent products on the same operands, `iters` rounds. The
// ceiling of the products on the tiles (their sums stored and their float steps left out).
inline double peak(int64_t iters) {
  if (!available()) return 0.0;
  return every_thread_rate(static_cast<double>(iters) * 4 * 16 * 16 * 16, [iters]() -> int64_t {
    alignas(64) int8_t a[16 * 16];
    alignas(64) uint8_t w[4 * 64];
    for (int i = 0; i < 256; ++i) a[i] = static_cast<int8_t>(i * 13 - 100), w[i] = static_cast<uint8_t>(i * 7);
    configure();
    _tile_loadd(0, a, 16);
    _tile_loadd(2, w, 64);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t i = 0; i < iters; ++i) {
      _tile_dpbsud(4, 0, 2);
      _tile_dpbsud(5, 0, 2);
      _tile_dpbsud(6, 0, 2);
      _tile_dpbsud(7, 0, 2);
    }
    alignas(64) int32_t sums[16 * 16];
    _tile_stored(4, sums, 64);
    release();
    return sums[0];
  });
}

#else

inline bool available() { return false; }
inline void configure() {}
inline void release() {}
inline double peak(int64_t) { return 0.0; }

#endif

// Whether the products' longer batches take the tiles: available, and not switched off.
inline bool enabled() { return available() && switched_on().load(std::memory_order_relaxed); }

}  // namespace amx
}  // namespace q
}  // namespace kvs

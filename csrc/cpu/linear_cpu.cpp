// Decode-shaped linear y = x W^T (+ bias) from weights packed once (layout and why: linear_cpu.h).
// Compiled once per vector ISA (csrc/cpu/isa.h); the AVX-512 build also carries the AVX512-BF16
// kernel (vdpbf16ps), chosen at run time where the CPU has it.
//
// The register tile: MR rows of x times one panel of NR = 2 vectors of output features. Per k,
// the two weight vectors are loaded once and used by every row (one broadcast of x[m, k] each),
// so the weights stream from memory exactly once per call whatever M is, and the MR x NR outputs
// stay in 2 * MR vector registers. Threads take contiguous ranges of panels (their slices of the
// packed weight are contiguous too), and within a panel walk the M tiles, so a panel read from
// memory for the first tile is re-read from L1/L2 by the others.
#include "cpu/linear_cpu.h"
#include "cpu/team.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#if defined(CPU_CAPABILITY_AVX512) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#include <immintrin.h>
#define JACOBI_LINEAR_BF16_PAIRS 1
#endif

#include "cpu/linear_tile.h"

namespace jacobi::cpu::JACOBI_ISA {
namespace {

using linear_tile::kMaxMR;
using linear_tile::kMinBytesPerThread;
using linear_tile::kNR;
using linear_tile::kVL;
using linear_tile::tile_f32;
using linear_tile::Vec;
using linear_tile::write_tile;
using BVec = at::vec::Vectorized<c10::BFloat16>;
static_assert(BVec::size() == kNR, "a bf16 panel row must be one Vectorized<BFloat16>");

// bf16 weights and x without AVX512-BF16: each panel row widened to fp32, then the fp32 tile.
template <int MR>
inline void tile_bf16(const c10::BFloat16* x, int64_t ldx, const c10::BFloat16* panel, int64_t K,
                      float* out) {
  Vec acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = Vec(0.f);
  for (int64_t k = 0; k < K; ++k) {
    auto [w0, w1] = at::vec::convert_bfloat16_float(BVec::loadu(panel + k * kNR));
    for (int m = 0; m < MR; ++m) {
      const Vec xv(static_cast<float>(x[m * ldx + k]));
      acc[m][0] = at::vec::fmadd(xv, w0, acc[m][0]);
      acc[m][1] = at::vec::fmadd(xv, w1, acc[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    acc[m][0].store(out + m * kNR);
    acc[m][1].store(out + m * kNR + kVL);
  }
}

#ifdef JACOBI_LINEAR_BF16_PAIRS
#define JACOBI_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

bool cpu_has_avx512_bf16() {
  static const bool has = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return has;
}

JACOBI_BF16_TARGET inline __m512bh x_pair(const uint16_t* row, int64_t i, int64_t K) {
  uint32_t v;
  if (2 * i + 1 < K) {
    std::memcpy(&v, row + 2 * i, sizeof(v));
  } else {
    v = row[2 * i];  // K odd: the padded weight is zero, so is the padded x
  }
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(v));
}

// vdpbf16ps: acc[j] += x[2i] * W[j, 2i] + x[2i + 1] * W[j, 2i + 1], fp32 accumulation.
template <int MR>
JACOBI_BF16_TARGET inline void tile_bf16_pairs(const uint16_t* x, int64_t ldx,
                                               const uint16_t* panel, int64_t K, float* out) {
  __m512 acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_ps();
  const int64_t pairs = (K + 1) / 2;
  for (int64_t i = 0; i < pairs; ++i) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + i * 2 * kNR);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + i * 2 * kNR + 32);
    for (int m = 0; m < MR; ++m) {
      const __m512bh xv = x_pair(x + m * ldx, i, K);
      acc[m][0] = _mm512_dpbf16_ps(acc[m][0], xv, w0);
      acc[m][1] = _mm512_dpbf16_ps(acc[m][1], xv, w1);
    }
  }
  for (int m = 0; m < MR; ++m) {
    _mm512_storeu_ps(out + m * kNR, acc[m][0]);
    _mm512_storeu_ps(out + m * kNR + 16, acc[m][1]);
  }
}
static_assert(kNR == 32, "the AVX512-BF16 tile holds 32 output features");
#endif

// ---- the driver ------------------------------------------------------------------------------

enum class Kind { f32, bf16, bf16_pairs };

// One tile of `rows` (<= kMaxMR) rows through the tile of that height.
template <Kind kind, int MR = kMaxMR>
inline void tile(int rows, const void* x, int64_t ldx, const void* panel, int64_t K, float* out) {
  if constexpr (MR > 1) {
    if (rows < MR) return tile<kind, MR - 1>(rows, x, ldx, panel, K, out);
  }
  if constexpr (kind == Kind::f32) {
    tile_f32<MR>(static_cast<const float*>(x), ldx, static_cast<const float*>(panel), K, out);
  } else if constexpr (kind == Kind::bf16) {
    tile_bf16<MR>(static_cast<const c10::BFloat16*>(x), ldx,
                  static_cast<const c10::BFloat16*>(panel), K, out);
  } else {
#ifdef JACOBI_LINEAR_BF16_PAIRS
    tile_bf16_pairs<MR>(static_cast<const uint16_t*>(x), ldx, static_cast<const uint16_t*>(panel),
                        K, out);
#endif
  }
}

template <Kind kind>
void run(const LinearArgs& a) {
  using T = std::conditional_t<kind == Kind::f32, float, c10::BFloat16>;
  const int64_t panels = (a.N + kNR - 1) / kNR;
  const int64_t k_rows = kind == Kind::bf16_pairs ? 2 * ((a.K + 1) / 2) : a.K;
  const int64_t panel_elems = k_rows * kNR;
  const int64_t panel_bytes = panel_elems * static_cast<int64_t>(sizeof(T));
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / std::max<int64_t>(panel_bytes, 1));
  // M tiles of nearly equal height (13 rows: 7 + 6, not 8 + 5).
  const int64_t tiles = (a.M + kMaxMR - 1) / kMaxMR;
  const int64_t mr = (a.M + tiles - 1) / tiles;
  cpu::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
    alignas(64) float out[kMaxMR * kNR];
    for (int64_t p = p0; p < p1; ++p) {
      const T* panel = static_cast<const T*>(a.packed) + p * panel_elems;
      const int64_t n0 = p * kNR;
      const int cols = static_cast<int>(std::min<int64_t>(kNR, a.N - n0));
      for (int64_t m0 = 0; m0 < a.M; m0 += mr) {
        const int rows = static_cast<int>(std::min<int64_t>(mr, a.M - m0));
        tile<kind>(rows, static_cast<const T*>(a.x) + m0 * a.ldx, a.ldx, panel, a.K, out);
        write_tile<T>(out, rows, cols, a, m0, n0);
      }
    }
  });
}

}  // namespace

int linear_panel_width() { return kNR; }

PackFormat linear_pack_format(LinearDType d) {
  if (d == LinearDType::f32) return PackFormat::f32_panels;
#ifdef JACOBI_LINEAR_BF16_PAIRS
  if (cpu_has_avx512_bf16()) return PackFormat::bf16_pairs;
#endif
  return PackFormat::bf16_panels;
}

void linear_pack(LinearDType d, const void* const* rows, int64_t N, int64_t K, void* packed) {
  const bool pairs = linear_pack_format(d) == PackFormat::bf16_pairs;
  const int64_t panels = (N + kNR - 1) / kNR;
  const int64_t k_rows = pairs ? 2 * ((K + 1) / 2) : K;
  // A panel is written in blocks of 16 k (kNR x 16 elements, in L1) from kNR source rows read
  // front to back: contiguous reads, and the scattered writes stay in cache.
  auto body = [&](auto zero, auto* dst) {
    using T = std::remove_pointer_t<decltype(dst)>;
    cpu::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
      const T* src[kNR];
      for (int64_t p = p0; p < p1; ++p) {
        T* panel = dst + p * k_rows * kNR;
        for (int j = 0; j < kNR; ++j) {
          const int64_t n = p * kNR + j;
          src[j] = n < N ? static_cast<const T*>(rows[n]) : nullptr;
        }
        for (int64_t k0 = 0; k0 < k_rows; k0 += 16) {
          const int64_t k1 = std::min<int64_t>(k0 + 16, k_rows);
          for (int j = 0; j < kNR; ++j) {
            const T* row = src[j];
            for (int64_t k = k0; k < k1; ++k) {
              const T v = (row != nullptr && k < K) ? row[k] : zero;
              if (pairs) {
                panel[(k / 2) * 2 * kNR + 2 * j + (k % 2)] = v;
              } else {
                panel[k * kNR + j] = v;
              }
            }
          }
        }
      }
    });
  };
  if (d == LinearDType::f32) {
    body(0.f, static_cast<float*>(packed));
  } else {
    body(c10::BFloat16(0.f), static_cast<c10::BFloat16*>(packed));
  }
}

void linear_packed(const LinearArgs& a) {
  if (a.M == 0 || a.N == 0) return;
  if (a.dtype == LinearDType::f32) return run<Kind::f32>(a);
  if (linear_pack_format(a.dtype) == PackFormat::bf16_pairs) {
#ifdef JACOBI_LINEAR_BF16_PAIRS
    return run<Kind::bf16_pairs>(a);
#endif
  }
  return run<Kind::bf16>(a);
}

}  // namespace jacobi::cpu::JACOBI_ISA

// The register tile of the decode-shaped CPU linears, shared by the fp32 kernel (linear_cpu.cpp)
// and the GGUF kernel (linear_gguf_cpu.cpp), so that both run the very same instructions on fp32
// weights: a GGUF weight dequantized into a panel is multiplied by exactly this code, which is
// what makes the GGUF path return bitwise the outputs of the fp32 path on the dequantized values.
//
// Included inside namespace jacobi::cpu::JACOBI_ISA (one copy per vector ISA, csrc/cpu/isa.h).
// Panels: [k, kNR] fp32, kNR = 2 vectors of output features (linear_cpu.h).
#pragma once

#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

#include <cstring>
#include <tuple>
#include <type_traits>

#include "cpu/linear_cpu.h"

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

namespace jacobi::cpu::JACOBI_ISA::linear_tile {

using Vec = at::vec::Vectorized<float>;
constexpr int kVL = Vec::size();
constexpr int kNR = 2 * kVL;  // output features per panel
// Rows per register tile: 2 * kMaxMR accumulators, 2 weight vectors and a broadcast must fit
// the register file (32 zmm with AVX-512, 16 ymm with AVX2).
#if defined(CPU_CAPABILITY_AVX512)
constexpr int kMaxMR = 8;
#else
constexpr int kMaxMR = 4;
#endif
// Weight bytes a thread gets at least: below this, splitting a call costs more than it saves.
constexpr int64_t kMinBytesPerThread = 48 * 1024;

// Row k of a panel as two fp32 vectors: fp32 loaded as it is, bf16 widened exactly (a shift).
inline void panel_row(const float* row, Vec& w0, Vec& w1) {
  w0 = Vec::loadu(row);
  w1 = Vec::loadu(row + kVL);
}
inline void panel_row(const c10::BFloat16* row, Vec& w0, Vec& w1) {
  using BVec = at::vec::Vectorized<c10::BFloat16>;
  static_assert(BVec::size() == kNR, "a bf16 panel row is one Vectorized<BFloat16>");
  std::tie(w0, w1) = at::vec::convert_bfloat16_float(BVec::loadu(row));
}

// out[m][j] (+)= sum_k x[m, k] * panel[k, j], one fp32 chain per output. With kResume the chain
// goes on from the partial sums in out (stored by an earlier call over the preceding k): storing
// and reloading an accumulator does not change its bits, so a chain cut into pieces of k is the
// same chain. A bf16 panel (an adapter's stored factors) gives the bits of its fp32 widening.
template <int MR, bool kResume = false, typename W>
inline void tile_f32(const float* x, int64_t ldx, const W* panel, int64_t K, float* out) {
  Vec acc[MR][2];
  for (int m = 0; m < MR; ++m) {
    if constexpr (kResume) {
      acc[m][0] = Vec::loadu(out + m * kNR);
      acc[m][1] = Vec::loadu(out + m * kNR + kVL);
    } else {
      acc[m][0] = acc[m][1] = Vec(0.f);
    }
  }
  for (int64_t k = 0; k < K; ++k) {
    Vec w0, w1;
    panel_row(panel + k * kNR, w0, w1);
    for (int m = 0; m < MR; ++m) {
      const Vec xv(x[m * ldx + k]);
      acc[m][0] = at::vec::fmadd(xv, w0, acc[m][0]);
      acc[m][1] = at::vec::fmadd(xv, w1, acc[m][1]);
    }
  }
  for (int m = 0; m < MR; ++m) {
    acc[m][0].store(out + m * kNR);
    acc[m][1].store(out + m * kNR + kVL);
  }
}

// f(std::integral_constant<int, rows>{}) for `rows` in 1 .. kMaxMR: a tile of that height.
template <int MR = kMaxMR, typename F>
inline void with_rows(int rows, const F& f) {
  if constexpr (MR > 1) {
    if (rows < MR) return with_rows<MR - 1>(rows, f);
  }
  f(std::integral_constant<int, MR>{});
}

// tile_f32 for `rows` (1 .. kMaxMR) rows: the tile of that height.
template <bool kResume, typename W>
inline void tile_f32_rows(int rows, const float* x, int64_t ldx, const W* panel, int64_t K,
                          float* out) {
  with_rows(rows, [&](auto mr) { tile_f32<decltype(mr)::value, kResume>(x, ldx, panel, K, out); });
}

// Row k of a panel one vector wide (kVL outputs): fp32 as it is, bf16 widened exactly (a shift,
// as convert_bfloat16_float does).
inline Vec panel_vec(const float* row) { return Vec::loadu(row); }
inline Vec panel_vec(const c10::BFloat16* row) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row));
  return Vec(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row));
  return Vec(_mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
#else
  float f[kVL];
  for (int i = 0; i < kVL; ++i) f[i] = static_cast<float>(row[i]);
  return Vec::loadu(f);
#endif
}

// tile_f32 on a weight packed in panels one vector wide ([K, kVL] each, consecutive): NV (1 or
// 2) of them from `panel` on, out[m][v * kVL + j]. Each output is tile_f32's chain (from 0, k in
// order), so a weight with few rows (a LoRA's A, rank 16) is packed without tile_f32's padding to
// whole kNR panels and gives the same bits on the outputs it has.
template <int MR, int NV, typename W>
inline void tile_f32_vec(const float* x, int64_t ldx, const W* panel, int64_t K, float* out) {
  static_assert(NV == 1 || NV == 2, "one or two vector panels");
  Vec acc[MR][NV];
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v] = Vec(0.f);
  for (int64_t k = 0; k < K; ++k) {
    Vec w[NV];
    for (int v = 0; v < NV; ++v) w[v] = panel_vec(panel + (v * K + k) * kVL);
    for (int m = 0; m < MR; ++m) {
      const Vec xv(x[m * ldx + k]);
      for (int v = 0; v < NV; ++v) acc[m][v] = at::vec::fmadd(xv, w[v], acc[m][v]);
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int v = 0; v < NV; ++v) acc[m][v].store(out + m * kNR + v * kVL);
}

// tile_f32_vec for `rows` (1 .. kMaxMR) rows.
template <int NV, typename W>
inline void tile_f32_vec_rows(int rows, const float* x, int64_t ldx, const W* panel, int64_t K,
                              float* out) {
  with_rows(rows, [&](auto mr) { tile_f32_vec<decltype(mr)::value, NV>(x, ldx, panel, K, out); });
}

// y[m0 + m, n0 + j] = out[m][j] + bias[n0 + j] for j < cols, in y's dtype T. A whole fp32 panel
// without a bias (every decoding linear of a Llama) is two vector copies a row: the general loop
// made a memset call for the zero bias and a memcpy call per row, ~4 % of an 8-bit prefill's
// samples in the calls alone (a 125-token prompt: ~20 000 rows of 32 outputs a layer).
template <typename T>
inline void write_tile(const float* out, int rows, int cols, const LinearArgs& a, int64_t m0,
                       int64_t n0) {
  T* y = static_cast<T*>(a.y);
  if constexpr (std::is_same_v<T, float>) {
    if (a.bias == nullptr && cols == kNR) {
      for (int m = 0; m < rows; ++m) {
        float* dst = y + (m0 + m) * a.ldy + n0;
        Vec::loadu(out + m * kNR).store(dst);
        Vec::loadu(out + m * kNR + kVL).store(dst + kVL);
      }
      return;
    }
  }
  float b[kNR];
  if (a.bias != nullptr) {
    for (int j = 0; j < cols; ++j) {
      b[j] = a.bias_f32 ? static_cast<const float*>(a.bias)[n0 + j]
                        : static_cast<float>(static_cast<const c10::BFloat16*>(a.bias)[n0 + j]);
    }
  }
  for (int m = 0; m < rows; ++m) {
    T* dst = y + (m0 + m) * a.ldy + n0;
    const float* src = out + m * kNR;
    if (a.bias == nullptr) {
      if constexpr (std::is_same_v<T, float>) {
        std::memcpy(dst, src, cols * sizeof(float));
      } else {
        for (int j = 0; j < cols; ++j) dst[j] = static_cast<T>(src[j]);
      }
    } else {
      for (int j = 0; j < cols; ++j) dst[j] = static_cast<T>(src[j] + b[j]);
    }
  }
}

}  // namespace jacobi::cpu::JACOBI_ISA::linear_tile

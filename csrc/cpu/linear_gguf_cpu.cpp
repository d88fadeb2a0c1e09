// The decode-shaped CPU linear on GGUF codes (layout and why: linear_gguf_cpu.h). Compiled once
// per vector ISA (csrc/cpu/isa.h) with -ffp-contract=off (CMakeLists.txt): the dequantization's
// separately rounded product and sum must not be fused into one multiply-add, or a weight would
// differ from the `gguf` package's in its last bit. (The tile's explicit fmadd stays a fused
// multiply-add, as in the fp32 kernel.)
//
// Per panel, the codes are dequantized a chunk of k at a time into an fp32 [k, NR] panel of 16 KB
// that stays in L1, and every M tile runs the fp32 kernel's register tile over it, carrying its
// accumulators from chunk to chunk (linear_tile.h): one fp32 chain per output over all of k.
#include "cpu/linear_gguf_cpu.h"
#include "cpu/team.h"

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__F16C__) || defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#if defined(CPU_CAPABILITY_AVX512)
#include <cpuid.h>  // the AMX tile's CPU check
#if defined(__linux__)
#include <sys/syscall.h>  // ... and its permission (arch_prctl)
#include <unistd.h>
#endif
#endif

#include "cpu/linear_tile.h"

namespace jacobi::cpu::JACOBI_ISA {
namespace {

using linear_tile::kMaxMR;
using linear_tile::kMinBytesPerThread;
using linear_tile::kNR;
using linear_tile::kVL;
using linear_tile::tile_f32_rows;
using linear_tile::write_tile;

constexpr int kMaxBlockK = 256;
constexpr int kInt8Group = 32;  // k per quantized group of x (Q4_1's block)
constexpr int kMaxGroupsPerBlock = 16;
// k per dequantized chunk: an fp32 [k, NR] panel of 16 KB (a multiple of every group size).
constexpr int64_t kChunkK = 4096 / kNR;
static_assert(kChunkK % 32 == 0, "a chunk holds whole groups");
// Bytes ahead of the group being dequantized that the one-tile path prefetches: a core streams
// the codes at ~6 GB/s while dequantizing, against ~11 GB/s reading alone (AVX2 EPYC); asking for
// them 2 KB ahead gained ~5 % there (1-32 KB measured alike).
constexpr int64_t kPrefetchAhead = 2048;

uint16_t load_u16(const uint8_t* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

float half_to_float(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }

// ---- unpacking one block of the file -------------------------------------------------------------

// A packed group's header values for one column: the file's fp16 bits (h0 = d, h1 = m) or the
// fp32 scale and offset computed from the file's fields (f0 = s, f1 = o).
struct GroupHeader {
  uint16_t h0 = 0, h1 = 0;
  float f0 = 0.f, f1 = 0.f;
};

// Q4_K / Q5_K: the 6-bit scale and min of sub-block i from the 12 scale bytes.
void k_scale_min(const uint8_t* sc, int i, int* scale, int* min) {
  if (i < 4) {
    *scale = sc[i] & 63;
    *min = sc[i + 4] & 63;
  } else {
    *scale = (sc[i + 4] & 0xF) | ((sc[i - 4] >> 6) << 4);
    *min = (sc[i + 4] >> 4) | ((sc[i] >> 6) << 4);
  }
}

// One block of a row -> its codes (as the packed layout stores them: 4-bit codes raw, 8-bit
// codes signed) and the header of each of its groups.
void decode_block(GgufType t, const uint8_t* b, int8_t* codes, GroupHeader* hdr) {
  switch (t) {
    case GgufType::q4_0:
    case GgufType::q4_1: {
      const int off = t == GgufType::q4_0 ? 2 : 4;
      hdr[0].h0 = load_u16(b);
      if (t == GgufType::q4_1) hdr[0].h1 = load_u16(b + 2);
      for (int i = 0; i < 16; ++i) {
        codes[i] = static_cast<int8_t>(b[off + i] & 0xF);
        codes[i + 16] = static_cast<int8_t>(b[off + i] >> 4);
      }
      return;
    }
    case GgufType::q8_0:
      hdr[0].h0 = load_u16(b);
      for (int i = 0; i < 32; ++i) codes[i] = static_cast<int8_t>(b[2 + i]);
      return;
    case GgufType::q4_k:
    case GgufType::q5_k: {
      const float d = half_to_float(load_u16(b)), dmin = half_to_float(load_u16(b + 2));
      const uint8_t* sc = b + 4;
      const uint8_t* qh = b + 16;  // Q5_K: the fifth bits, 32 bytes
      const uint8_t* qs = t == GgufType::q4_k ? b + 16 : b + 48;
      for (int i = 0; i < 8; ++i) {
        int s, m;
        k_scale_min(sc, i, &s, &m);
        hdr[i].f0 = d * static_cast<float>(s);
        hdr[i].f1 = -(dmin * static_cast<float>(m));
        for (int l = 0; l < 32; ++l) {
          int q = (qs[32 * (i / 2) + l] >> (4 * (i % 2))) & 0xF;
          if (t == GgufType::q5_k) q |= ((qh[l] >> i) & 1) << 4;
          codes[32 * i + l] = static_cast<int8_t>(q);
        }
      }
      return;
    }
    case GgufType::q6_k: {
      const uint8_t* ql = b;
      const uint8_t* qh = b + 128;
      const int8_t* sc = reinterpret_cast<const int8_t*>(b + 192);
      const float d = half_to_float(load_u16(b + 208));
      for (int i = 0; i < 16; ++i) hdr[i].f0 = d * static_cast<float>(sc[i]);
      for (int w = 0; w < 256; ++w) {
        const int h = w / 128, r = w % 128;
        const int lo = (ql[64 * h + r % 64] >> (4 * (r / 64))) & 0xF;
        const int hi = (qh[32 * h + r % 32] >> (2 * (r / 32))) & 3;
        codes[w] = static_cast<int8_t>((lo | (hi << 4)) - 32);
      }
      return;
    }
  }
}

// ---- dequantizing a packed group into an fp32 panel ----------------------------------------------

// A type's format (linear_gguf_cpu.h) as compile-time constants for the kernels.
template <GgufType T>
struct Traits {
  static constexpr GgufFormat kF = gguf_format_of(T);
  static constexpr bool kHalfHeader = kF.half_header;
  static constexpr bool kOffset = kF.offset;
  static constexpr bool kNibbles = kF.code_bits == 4;
  static constexpr int kG = kF.group_k;
  static constexpr int kHeaderBytes = kF.header_bytes;
  static constexpr int kNibbleBias = T == GgufType::q4_0 ? -8 : 0;  // Q4_0's codes are q + 8
};

// n fp16 values -> fp32 (exact).
inline void halves_to_floats(const uint8_t* src, float* dst, int n) {
#if defined(__F16C__)
  for (int j = 0; j < n; j += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 2 * j));
    _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(h));
  }
#else
  for (int j = 0; j < n; ++j) dst[j] = half_to_float(load_u16(src + 2 * j));
#endif
}

// dst[k][j] = weight (k, column j) of the group at g, k < G: exactly the `gguf` package's value.
template <GgufType T>
inline void dequant_group_scalar(const uint8_t* g, float* __restrict dst) {
  using Tr = Traits<T>;
  alignas(64) float s[kNR];
  alignas(64) float o[kNR];
  if constexpr (Tr::kHalfHeader) {
    halves_to_floats(g, s, kNR);
    if constexpr (Tr::kOffset) halves_to_floats(g + 2 * kNR, o, kNR);
  } else {
    std::memcpy(s, g, sizeof(s));
    if constexpr (Tr::kOffset) std::memcpy(o, g + 4 * kNR, sizeof(o));
  }
  const uint8_t* c = g + kNR * Tr::kHeaderBytes;
  if constexpr (Tr::kNibbles) {
    for (int i = 0; i < Tr::kG / 2; ++i) {
      float* d0 = dst + (2 * i) * kNR;
      float* d1 = d0 + kNR;
      const uint8_t* ci = c + i * kNR;
      for (int j = 0; j < kNR; ++j) {
        float w0 = s[j] * static_cast<float>(static_cast<int>(ci[j] & 0xF) + Tr::kNibbleBias);
        float w1 = s[j] * static_cast<float>(static_cast<int>(ci[j] >> 4) + Tr::kNibbleBias);
        if constexpr (Tr::kOffset) {
          w0 = w0 + o[j];
          w1 = w1 + o[j];
        }
        d0[j] = w0;
        d1[j] = w1;
      }
    }
  } else {
    const int8_t* q = reinterpret_cast<const int8_t*>(c);
    for (int k = 0; k < Tr::kG; ++k) {
      for (int j = 0; j < kNR; ++j) {
        float w = s[j] * static_cast<float>(q[k * kNR + j]);
        if constexpr (Tr::kOffset) w = w + o[j];
        dst[k * kNR + j] = w;
      }
    }
  }
}


#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// The same with vector instructions, 16 (AVX2) or 32 (AVX-512) columns at once. Each weight gets
// the scalar loop's value, with fewer instructions where that is exact:
//  - Q4_0, Q4_1, Q8_0: the scale is the file's fp16 d (11 significant bits) and the code has at
//    most 8, so d * q is exact in fp32 and (d * q) + m, rounded once, is one fused multiply-add:
//    fma(d, q, m); Q4_0's d * (q - 8) is fma(d, q, -8 d) (every term exact, so the sum is too).
//  - the k-quants' fp32 scale times a code is not exact: a multiply, then the offset added, each
//    rounded on its own, as the scalar loop (the file is compiled without contraction).
// Codes are widened from memory straight to int32 (two k of 4-bit codes at once, split with an
// and and a shift), then converted to fp32 (exact).
#if defined(CPU_CAPABILITY_AVX512)
using VF = __m512;
using VI = __m512i;
inline VF vload(const uint8_t* p) { return _mm512_loadu_ps(reinterpret_cast<const float*>(p)); }
inline VF vhalves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
// 16 bytes at p -> 16 int32, zero- or sign-extended.
inline VI widen_u8(const uint8_t* p) {
  return _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline VI widen_s8(const uint8_t* p) {
  return _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline VI low_nibbles(VI b) { return _mm512_and_si512(b, _mm512_set1_epi32(0xF)); }
inline VI high_nibbles(VI b) { return _mm512_srli_epi32(b, 4); }  // b < 256
inline VF vcvt(VI i) { return _mm512_cvtepi32_ps(i); }
// A byte's low / high nibble as a float, from a table of 0..15 that vpermps indexes with each
// lane's low 4 bits: the low nibble without its mask and conversion (one instruction of two).
// The same values as vcvt of low_nibbles / high_nibbles (small integers, exact either way).
inline VF table_0_15() {
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}
inline VF low_nibble_floats(VI b, VF table) { return _mm512_permutexvar_ps(b, table); }
inline VF high_nibble_floats(VI b, VF table) {
  return _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
}
inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF vfmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF vset1(float v) { return _mm512_set1_ps(v); }
inline VF vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline VF vzero() { return _mm512_setzero_ps(); }
inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
inline void vstore(float* p, VF v) { _mm512_storeu_ps(p, v); }
#else
using VF = __m256;
using VI = __m256i;
inline VF vload(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
inline VF vhalves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
// 8 bytes at p -> 8 int32, zero- or sign-extended.
inline VI widen_u8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline VI widen_s8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline VI low_nibbles(VI b) { return _mm256_and_si256(b, _mm256_set1_epi32(0xF)); }
inline VI high_nibbles(VI b) { return _mm256_srli_epi32(b, 4); }  // b < 256
inline VF vcvt(VI i) { return _mm256_cvtepi32_ps(i); }
// (AVX2's vpermps indexes 8 lanes, not 16: the mask and conversion as they are)
inline VF table_0_15() { return _mm256_setzero_ps(); }
inline VF low_nibble_floats(VI b, VF) { return vcvt(low_nibbles(b)); }
inline VF high_nibble_floats(VI b, VF) { return vcvt(high_nibbles(b)); }
inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF vfmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vset1(float v) { return _mm256_set1_ps(v); }
inline VF vbroadcast(const float* p) { return _mm256_set1_ps(*p); }
inline VF vzero() { return _mm256_setzero_ps(); }
inline VF vadd(VF a, VF b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, VF v) { _mm256_storeu_ps(p, v); }
#endif
constexpr int kHalfNR = kNR / 2;  // floats per VF
static_assert(sizeof(VF) == kHalfNR * sizeof(float), "a panel row is two vectors");

// One group's scale and offset vectors for half h of its columns, and the weight of a code.
template <GgufType T>
struct GroupScales {
  using Tr = Traits<T>;
  // fp16 scale times a code of <= 8 bits is exact in fp32 (see above).
  static constexpr bool kFused = Tr::kHalfHeader && (Tr::kOffset || Tr::kNibbleBias != 0);
  VF s[2], o[2];
  void load(const uint8_t* g) {
    for (int h = 0; h < 2; ++h) {
      if constexpr (Tr::kHalfHeader) {
        s[h] = vhalves(g + 2 * kHalfNR * h);
        if constexpr (Tr::kOffset) {
          o[h] = vhalves(g + 2 * kNR + 2 * kHalfNR * h);
        } else if constexpr (Tr::kNibbleBias != 0) {
          o[h] = vmul(s[h], vset1(static_cast<float>(Tr::kNibbleBias)));  // exact
        }
      } else {
        s[h] = vload(g + 4 * kHalfNR * h);
        if constexpr (Tr::kOffset) o[h] = vload(g + 4 * kNR + 4 * kHalfNR * h);
      }
    }
  }
  VF weight(int h, VI code) const { return weight_of(h, vcvt(code)); }
  // The weight of a code already a float (exact: a small integer).
  VF weight_of(int h, VF q) const {
    if constexpr (kFused) {
      return vfmadd(s[h], q, o[h]);
    } else if constexpr (Tr::kOffset) {
      return vadd(vmul(s[h], q), o[h]);
    } else {
      return vmul(s[h], q);
    }
  }
};

// Walks the G weight rows of the same group of P panels (g[p]): f(k, p, h, w) gets the weights
// of row k, panel p, half h of its columns (one vector). For each (p, h), k comes in order, so a
// chain that f runs per (p, h) is the chain over k; the (p, h) of one k may interleave with the
// next k's (two k of nibbles come from one load). kTable: 4-bit codes to floats through
// vpermps's table (low_nibble_floats), for one-row tiles, where the weights' instructions are
// the bound (an exact one-row Q4_1 product, hot in L2, 2.9 % faster on an AVX-512 EPYC); where
// several rows share each weight (1.6 % slower at 4 rows) the mask and conversion stay.
template <GgufType T, int P, bool kTable = false, typename F>
inline void for_each_weight_row(const uint8_t* const* g, F&& f) {
  using Tr = Traits<T>;
  GroupScales<T> sc[P];
  for (int p = 0; p < P; ++p) sc[p].load(g[p]);
  constexpr int64_t kCodes = kNR * Tr::kHeaderBytes;
  if constexpr (Tr::kNibbles) {
    [[maybe_unused]] const VF table = table_0_15();
    for (int i = 0; i < Tr::kG / 2; ++i) {
      for (int p = 0; p < P; ++p) {
        for (int h = 0; h < 2; ++h) {
          const VI b = widen_u8(g[p] + kCodes + i * kNR + h * kHalfNR);
          if constexpr (kTable) {
            f(2 * i, p, h, sc[p].weight_of(h, low_nibble_floats(b, table)));
            f(2 * i + 1, p, h, sc[p].weight_of(h, high_nibble_floats(b, table)));
          } else {
            f(2 * i, p, h, sc[p].weight(h, low_nibbles(b)));
            f(2 * i + 1, p, h, sc[p].weight(h, high_nibbles(b)));
          }
        }
      }
    }
  } else {
    for (int k = 0; k < Tr::kG; ++k) {
      for (int p = 0; p < P; ++p) {
        for (int h = 0; h < 2; ++h) {
          f(k, p, h, sc[p].weight(h, widen_s8(g[p] + kCodes + k * kNR + h * kHalfNR)));
        }
      }
    }
  }
}

template <GgufType T>
inline void dequant_group(const uint8_t* g, float* __restrict dst) {
  for_each_weight_row<T, 1>(&g, [&](int k, int, int h, VF w) {
    vstore(dst + k * kNR + h * kHalfNR, w);
  });
}

// Up to kMaxMR rows (one M tile: a decoding step of a few tokens) on P panels side by side: each
// weight vector dequantized in registers and used at once by every row, as the fp32 tile uses a
// loaded one. The same multiply-add on the same values in the same order as tile_f32 over
// dequant_group's panel (_mm*_fmadd_ps(x, w, acc) is at::vec::fmadd's instruction), without the
// round trip of the weights through L1. P = 2 at one row: two panels give four independent chains,
// enough to hide the multiply-add's latency (one panel's two chains wait on it).
template <GgufType T, int MR, int P>
inline void codes_tile(const float* x, int64_t ldx, const uint8_t* panel, int64_t panel_bytes,
                       int64_t groups, int64_t gbytes, float* out) {
  VF acc[MR][P][2];
  for (int m = 0; m < MR; ++m) {
    for (int p = 0; p < P; ++p) acc[m][p][0] = acc[m][p][1] = vzero();
  }
  for (int64_t gi = 0; gi < groups; ++gi) {
    const float* xg = x + gi * Traits<T>::kG;
    const uint8_t* g[P];
    for (int p = 0; p < P; ++p) g[p] = panel + p * panel_bytes + gi * gbytes;
    // The codes are read once: ask for them ahead of the walk. Past the end of its panel, each
    // stream asks for the same stream of the next unit's panel (the units' panels are contiguous,
    // the next unit's panel p starts P panels on), so a unit starts on codes already on their way
    // instead of on a cold miss per panel (which cost most at short K: 18 groups a panel at 576).
    const int64_t ahead = gi * gbytes + kPrefetchAhead;
    const int64_t skip = ahead < panel_bytes ? 0 : (P - 1) * panel_bytes;
    for (int p = 0; p < P; ++p) {
      const uint8_t* next = panel + p * panel_bytes + skip + ahead;
      for (int64_t b = 0; b < gbytes; b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(next + b), _MM_HINT_T0);
      }
    }
    for_each_weight_row<T, P, MR == 1>(g, [&](int k, int p, int h, VF w) {
      for (int m = 0; m < MR; ++m) acc[m][p][h] = vfmadd(vbroadcast(xg + m * ldx + k), w, acc[m][p][h]);
    });
  }
  for (int p = 0; p < P; ++p) {
    for (int m = 0; m < MR; ++m) {
      vstore(out + (p * MR + m) * kNR, acc[m][p][0]);
      vstore(out + (p * MR + m) * kNR + kHalfNR, acc[m][p][1]);
    }
  }
}

constexpr bool kCodesTile = true;
// Panels a one-row unit takes at most: three where the registers hold three panels' scales,
// offsets and accumulators (18 of AVX-512's 32; AVX2's 16 hold two).
constexpr int kMaxPanels = sizeof(VF) == 64 ? 3 : 2;

// Panels per unit of a one-row call (2 or 3): the one whose units share `panels` among
// `threads` with the least on the busiest thread (ATen gives each thread ceil(units / threads)
// units in order); pairs on a tie.
inline int one_row_panels(int64_t panels, int64_t threads) {
  auto busiest = [&](int64_t P) {
    const int64_t units = (panels + P - 1) / P;
    const int64_t t = std::max<int64_t>(1, std::min(threads, units));
    return std::min(panels, (units + t - 1) / t * P);
  };
  return kMaxPanels == 3 && busiest(3) < busiest(2) ? 3 : 2;
}

template <GgufType T, int MR = kMaxMR>
inline void codes_tile_rows(int rows, const float* x, int64_t ldx, const uint8_t* panel,
                            int64_t panel_bytes, int64_t groups, int64_t gbytes, float* out) {
  if constexpr (MR > 1) {
    if (rows < MR) {
      return codes_tile_rows<T, MR - 1>(rows, x, ldx, panel, panel_bytes, groups, gbytes, out);
    }
  }
  codes_tile<T, MR, 1>(x, ldx, panel, panel_bytes, groups, gbytes, out);
}
#else
template <GgufType T>
inline void dequant_group(const uint8_t* g, float* __restrict dst) {
  dequant_group_scalar<T>(g, dst);
}

constexpr bool kCodesTile = false;
constexpr int kMaxPanels = 2;
inline int one_row_panels(int64_t, int64_t) { return 2; }

template <GgufType T>
inline void codes_tile_rows(int, const float*, int64_t, const uint8_t*, int64_t, int64_t, int64_t,
                            float*) {}
template <GgufType T, int MR, int P>
inline void codes_tile(const float*, int64_t, const uint8_t*, int64_t, int64_t, int64_t, float*) {}
#endif

// ---- the driver ----------------------------------------------------------------------------------

// y[m0 + m, n0 + j] += the LoRA term of panel p (linear_gguf_cpu.h: GgufLora), rows m0 .. m0 + rows.
template <typename W>
inline void add_lora(const GgufLora& lo, const LinearArgs& a, int64_t p, int rows, int64_t m0,
                     float* scratch) {
  const W* bp = static_cast<const W*>(lo.b_packed) + p * lo.rank * kNR;
  const int64_t r0 = lo.panel_r0 != nullptr ? lo.panel_r0[p] : 0;
  tile_f32_rows<false>(rows, lo.t + m0 * lo.ldt + r0, lo.ldt, bp, lo.rank, scratch);
  const int64_t n0 = p * kNR;
  const int cols = static_cast<int>(std::min<int64_t>(kNR, a.N - n0));
  float* y = static_cast<float*>(a.y);
  for (int m = 0; m < rows; ++m) {
    float* dst = y + (m0 + m) * a.ldy + n0;
    for (int j = 0; j < cols; ++j) dst[j] = dst[j] + scratch[m * kNR + j];
  }
}

inline void add_lora(const GgufLora& lo, const LinearArgs& a, int64_t p, int rows, int64_t m0,
                     float* scratch) {
  if (lo.bf16) return add_lora<c10::BFloat16>(lo, a, p, rows, m0, scratch);
  add_lora<float>(lo, a, p, rows, m0, scratch);
}

// Unit i of t = x A^T into lo.t, every row of x: A's vector panels 2i and 2i + 1 (the last unit
// may have one), kVL columns of t each, on the fp32 kernel's tile one or two vectors wide.
// (rows [r0, r1) of it: lora_t_rows)
template <typename W>
inline void lora_t_unit_of(const LinearArgs& a, const GgufLora& lo, int64_t i, int64_t r0,
                           int64_t r1) {
  const int64_t v0 = 2 * i;
  const int nv = static_cast<int>(std::min<int64_t>(2, lo.ldt / kVL - v0));
  const W* ap = static_cast<const W*>(lo.a_packed) + v0 * a.K * kVL;
  const float* x = static_cast<const float*>(a.x);
  alignas(64) float out[kMaxMR * kNR];
  for (int64_t m0 = r0; m0 < r1; m0 += kMaxMR) {
    const int rows = static_cast<int>(std::min<int64_t>(kMaxMR, r1 - m0));
    if (nv == 2) {
      linear_tile::tile_f32_vec_rows<2>(rows, x + m0 * a.ldx, a.ldx, ap, a.K, out);
    } else {
      linear_tile::tile_f32_vec_rows<1>(rows, x + m0 * a.ldx, a.ldx, ap, a.K, out);
    }
    for (int m = 0; m < rows; ++m)
      std::memcpy(lo.t + (m0 + m) * lo.ldt + v0 * kVL, out + m * kNR, nv * kVL * sizeof(float));
  }
}

inline void lora_t_unit(const LinearArgs& a, const GgufLora& lo, int64_t i, int64_t r0,
                        int64_t r1) {
  if (lo.bf16) return lora_t_unit_of<c10::BFloat16>(a, lo, i, r0, r1);
  lora_t_unit_of<float>(a, lo, i, r0, r1);
}

// Every unit of t, rows [r0, r1) of it.
inline void lora_t_rows(const LinearArgs& a, const GgufLora& lo, int64_t r0, int64_t r1) {
  const int64_t a_units = (lo.ldt / kVL + 1) / 2;
  for (int64_t i = 0; i < a_units; ++i) lora_t_unit(a, lo, i, r0, r1);
}

// y += t B^T on panels [p0, p1) (every row).
inline void add_lora_panels(const GgufLora& lo, const LinearArgs& a, int64_t p0, int64_t p1) {
  alignas(64) float scratch[kMaxMR * kNR];
  for (int64_t p = p0; p < p1; ++p) {
    for (int64_t m0 = 0; m0 < a.M; m0 += kMaxMR) {
      const int rows = static_cast<int>(std::min<int64_t>(kMaxMR, a.M - m0));
      add_lora(lo, a, p, rows, m0, scratch);
    }
  }
}

// The panel loop of a GGUF linear, with its LoRA (if any). body(u0, u1) computes y = x W^T (+
// bias) for units [u0, u1) of `units` (a unit: unit_bytes of codes, `per_unit` panels), split
// over the threads with `grain`. With a LoRA all of it runs in one parallel pass: t = x A^T by
// the first units (A's vector panels placed before the product's, each weighing its bytes in
// units, computed two at a time; where A ran in a pass of its own, one thread read 37-98 KB of A
// while the other waited), then each thread's product, then, once every unit of t is written (a
// count of them), y += t B^T on the thread's own panels. Every thread computes its units of t
// before it waits on anything, and with OpenMP every chunk has a thread of its own, all running:
// no thread waits on one that waits. (With another threading backend: B in a pass after.) Each
// output is the same sums in the same order as when its LoRA term was added right after its
// panel's product: the same bits.
//
// Many rows (rows_apart or more: a prefill, a wide step) go another way: t first, its rows split
// among the threads (one thread computed all of a prefill's t, 179 rows, while the other
// waited), then each thread's units a few at a time, each few's LoRA terms added right after
// their product, while its outputs are still in the cache (added after all of a thread's units,
// y was read and written again from memory: a prefill's gate/up output is 2.2 MB). The same sums
// in the same order: the same bits. Where it pays (interleaved in one process, smollm2-jf, 2-core
// EPYC, 2026-12-05): a 179-token prefill 0.93 (8-bit) and 0.94 (exact); 16-token steps 0.95
// (8-bit) and 0.97 (exact), 8 tokens 0.97 exact but 1.05 8-bit, 12 tokens 1.01 8-bit, 4 tokens
// 1.00 exact and 1.02 8-bit: from kMaxMR rows in the exact tiles, 16 in the 8-bit ones.
constexpr int64_t kLoraUnitsAtOnce = 4;  // (1 and 12 the same within 1 %)

template <typename Body>
inline void panel_loop(const LinearArgs& a, const GgufLora& lo, int64_t units, int64_t per_unit,
                       int64_t unit_bytes, int64_t grain, int64_t rows_apart, const Body& body) {
  if (lo.t == nullptr) return cpu::parallel_for(0, units, grain, body);
  if (a.M >= rows_apart) {
    const int64_t panels = (a.N + kNR - 1) / kNR;
    cpu::parallel_for(0, a.M, kMaxMR, [&](int64_t r0, int64_t r1) { lora_t_rows(a, lo, r0, r1); });
    cpu::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; u += kLoraUnitsAtOnce) {
        const int64_t ue = std::min(u1, u + kLoraUnitsAtOnce);
        body(u, ue);
        add_lora_panels(lo, a, u * per_unit, std::min(panels, ue * per_unit));
      }
    });
    return;
  }
  // A's vector panels weigh their bytes in units (w each, to the nearest), and A's unit i (its
  // vector panels 2i, 2i + 1) is computed by the thread given unit 2 i w (the units after it:
  // nothing).
  const int64_t a_vpanels = lo.ldt / kVL, a_units = (a_vpanels + 1) / 2;
  const int64_t a_bytes = a.K * kVL * (lo.bf16 ? 2 : 4);
  const int64_t ub = std::max<int64_t>(unit_bytes, 1);
  const int64_t w = std::max<int64_t>(1, (a_bytes + ub / 2) / ub);
  const int64_t lead = a_vpanels * w;
  const int64_t panels = (a.N + kNR - 1) / kNR;
#if AT_PARALLEL_OPENMP
  constexpr bool kInPass = true;
#else
  constexpr bool kInPass = false;
#endif
  std::atomic<int64_t> t_done{0};
  cpu::parallel_for(0, lead + units, grain, [&](int64_t u0, int64_t u1) {
    for (int64_t i = (u0 + 2 * w - 1) / (2 * w); 2 * i * w < std::min(u1, lead); ++i) {
      lora_t_unit(a, lo, i, 0, a.M);
      t_done.fetch_add(1, std::memory_order_release);
    }
    if (u1 <= lead) return;
    const int64_t b0 = std::max(u0, lead) - lead, b1 = u1 - lead;
    body(b0, b1);
    if (!kInPass) return;
    while (t_done.load(std::memory_order_acquire) < a_units) {
#if defined(__x86_64__)
      __builtin_ia32_pause();
#endif
    }
    add_lora_panels(lo, a, b0 * per_unit, std::min(panels, b1 * per_unit));
  });
  if (!kInPass) {
    cpu::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) { add_lora_panels(lo, a, p0, p1); });
  }
}

template <GgufType T>
void run(const LinearArgs& a, const GgufLora& lo) {
  using Tr = Traits<T>;
  constexpr GgufFormat f = Tr::kF;
  const int64_t panels = (a.N + kNR - 1) / kNR;
  const int64_t groups = a.K / Tr::kG;
  const int64_t gbytes = gguf_group_bytes(f, kNR);
  const int64_t panel_bytes = groups * gbytes;
  const int64_t chunk_groups = kChunkK / Tr::kG;
  const int64_t grain = std::max<int64_t>(1, kMinBytesPerThread / std::max<int64_t>(panel_bytes, 1));
  // M tiles of nearly equal height, as the fp32 kernel.
  const int64_t tiles = (a.M + kMaxMR - 1) / kMaxMR;
  const int64_t mr = (a.M + tiles - 1) / tiles;
  const float* x = static_cast<const float*>(a.x);
  if (kCodesTile && a.M <= kMaxMR) {
    // One row: panels in pairs or threes (codes_tile's P = 2 or 3), each thread's range starting
    // on one. Threes where they share the panels out more evenly: a one-token step's o and down
    // projections (18 panels) and q/k/v (30) left one thread of two a pair more (5 / 4, 8 / 7
    // pairs), waiting at every call's end; in threes 3 / 3 and 5 / 5. Each panel's chains are
    // the same at any P: the same bits.
    const int P = a.M == 1 ? one_row_panels(panels, at::get_num_threads()) : 1;
    const int64_t units = (panels + P - 1) / P;
    panel_loop(a, lo, units, P, P * panel_bytes, (grain + P - 1) / P, kMaxMR,
               [&](int64_t u0, int64_t u1) {
      alignas(64) float out[kMaxPanels * kMaxMR * kNR];
      const int rows = static_cast<int>(a.M);
      const auto* packed = static_cast<const uint8_t*>(a.packed);
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t p = u * P;
        const int64_t np = std::min<int64_t>(P, panels - p);
        const uint8_t* first = packed + p * panel_bytes;
        if (np == 3) {
          codes_tile<T, 1, 3>(x, a.ldx, first, panel_bytes, groups, gbytes, out);
        } else if (np == 2) {
          codes_tile<T, 1, 2>(x, a.ldx, first, panel_bytes, groups, gbytes, out);
        } else {
          codes_tile_rows<T>(rows, x, a.ldx, first, panel_bytes, groups, gbytes, out);
        }
        for (int64_t q = 0; q < np; ++q) {
          const int64_t n0 = (p + q) * kNR;
          const int cols = static_cast<int>(std::min<int64_t>(kNR, a.N - n0));
          write_tile<float>(out + q * rows * kNR, rows, cols, a, 0, n0);
        }
      }
    });
    return;
  }
  panel_loop(a, lo, panels, 1, panel_bytes, grain, kMaxMR, [&](int64_t p0, int64_t p1) {
    alignas(64) float buf[kChunkK * kNR];
    std::vector<float> acc(static_cast<size_t>(a.M) * kNR);
    for (int64_t p = p0; p < p1; ++p) {
      const uint8_t* panel = static_cast<const uint8_t*>(a.packed) + p * panel_bytes;
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g0 = 0; g0 < groups; g0 += chunk_groups) {
        const int64_t g1 = std::min(groups, g0 + chunk_groups);
        for (int64_t g = g0; g < g1; ++g) {
          dequant_group<T>(panel + g * gbytes, buf + (g - g0) * Tr::kG * kNR);
        }
        const int64_t k0 = g0 * Tr::kG, nk = (g1 - g0) * Tr::kG;
        for (int64_t m0 = 0; m0 < a.M; m0 += mr) {
          const int rows = static_cast<int>(std::min<int64_t>(mr, a.M - m0));
          tile_f32_rows<true>(rows, x + m0 * a.ldx + k0, a.ldx, buf, nk, acc.data() + m0 * kNR);
        }
      }
      const int64_t n0 = p * kNR;
      const int cols = static_cast<int>(std::min<int64_t>(kNR, a.N - n0));
      for (int64_t m0 = 0; m0 < a.M; m0 += mr) {
        const int rows = static_cast<int>(std::min<int64_t>(mr, a.M - m0));
        write_tile<float>(acc.data() + m0 * kNR, rows, cols, a, m0, n0);
      }
    }
  });
}

// ---- 8-bit activations (opt-in; linear_gguf_cpu.h: linear_gguf_int8) ---------------------------

// The 8-bit path's types: Q4_1 (unsigned 4-bit codes and an offset), Q8_0 (signed 8-bit codes).
// A group's header (fp16 d[NR], and m[NR] for Q4_1) comes before its codes.
template <GgufType T>
constexpr int64_t int8_header() {
  static_assert(T == GgufType::q4_1 || T == GgufType::q8_0, "8-bit activations: Q4_1 or Q8_0");
  static_assert(Traits<T>::kG == kInt8Group, "one x group per weight group");
  return kNR * Traits<T>::kHeaderBytes;
}

// One group of 32 values of a row of x quantized: q = nearbyint(x * (127 / amax)) in
// [-127, 127], dx = amax / 127, msx = dx * sum(q), qsum = sum(q) (the exact integer, which the
// VNNI tile needs too). A group with a non-finite value gets q = 0, qsum = 0 and dx = msx = NaN
// (its outputs NaN, as the float product's); a group so small that 127 / amax
// overflows (amax < ~3.7e-37) gets q = 0 (its terms are below fp32's reach anyway).
inline float int8_scale(float amax) {
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  return std::isfinite(inv) ? inv : 0.f;
}

// Plain scalar code; the vector variant below gives the same bytes.
inline void quantize_group_scalar(const float* xg, int8_t* qg, float* dx, float* msx,
                                  int32_t* qsum) {
  float amax = 0.f;
  bool finite = true;
  for (int k = 0; k < kInt8Group; ++k) {
    finite = finite && std::isfinite(xg[k]);
    amax = std::max(amax, std::fabs(xg[k]));
  }
  if (!finite) {
    std::fill(qg, qg + kInt8Group, int8_t{0});
    *dx = *msx = std::numeric_limits<float>::quiet_NaN();
    *qsum = 0;
    return;
  }
  const float inv = int8_scale(amax);
  int sum = 0;
  for (int k = 0; k < kInt8Group; ++k) {
    const int v = std::clamp(static_cast<int>(std::nearbyint(xg[k] * inv)), -127, 127);
    qg[k] = static_cast<int8_t>(v);
    sum += v;
  }
  *dx = amax / 127.f;
  *msx = *dx * static_cast<float>(sum);
  *qsum = sum;
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// quantize_group_scalar with 8 lanes: the same max, the same product x * inv rounded to fp32,
// rounded to the nearest integer, ties to even (nearbyint's mode), clamped; the integer sum exact.
// Groups with a non-finite value go to the scalar code.
inline void quantize_group(const float* xg, int8_t* qg, float* dx, float* msx, int32_t* qsum) {
  const __m256 sign = _mm256_set1_ps(-0.f);
  const __m256i exp = _mm256_set1_epi32(0x7f800000);
  __m256 v[4], amax8 = _mm256_setzero_ps();
  int special = 0;
  for (int i = 0; i < 4; ++i) {
    v[i] = _mm256_loadu_ps(xg + 8 * i);
    amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(sign, v[i]));
    const __m256i e = _mm256_and_si256(_mm256_castps_si256(v[i]), exp);
    special |= _mm256_movemask_epi8(_mm256_cmpeq_epi32(e, exp));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(amax8), _mm256_extractf128_ps(amax8, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  const float amax = _mm_cvtss_f32(m4);
  if (special != 0) return quantize_group_scalar(xg, qg, dx, msx, qsum);
  const float inv = int8_scale(amax);
  const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.f), hi = _mm256_set1_ps(127.f);
  __m256i iv[4], sum8 = _mm256_setzero_si256();
  for (int i = 0; i < 4; ++i) {
    const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], vinv),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    iv[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));  // exact: integers
    sum8 = _mm256_add_epi32(sum8, iv[i]);
  }
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]),
                                       _mm256_packs_epi32(iv[2], iv[3]));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(qg),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum8), _mm256_extracti128_si256(sum8, 1));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(1, 0, 3, 2)));
  s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, _MM_SHUFFLE(2, 3, 0, 1)));
  *dx = amax / 127.f;
  *qsum = _mm_cvtsi128_si32(s4);
  *msx = *dx * static_cast<float>(*qsum);
}
#else
inline void quantize_group(const float* xg, int8_t* qg, float* dx, float* msx, int32_t* qsum) {
  quantize_group_scalar(xg, qg, dx, msx, qsum);
}
#endif

// One row of x quantized per group of 32 k (quantize_group).
inline void quantize_row(const float* x, int64_t K, int8_t* q, float* dx, float* msx,
                         int32_t* qsum) {
  for (int64_t g = 0; g < K / kInt8Group; ++g) {
    quantize_group(x + g * kInt8Group, q + g * kInt8Group, dx + g, msx + g, qsum + g);
  }
}

// A Q4_1 or Q8_0 panel times one quantized row: per group, column c's exact integer sum
// isum = sum_k code(k, c) q(k), then acc = fma(d * dx, isum, acc) and, for Q4_1,
// acc = fma(m, msx, acc) (d, m the column's fp16 scale and offset): the same operations in the
// same order on every ISA.
template <GgufType T>
inline void int8_panel_row_scalar(const uint8_t* panel, int64_t groups, int64_t gbytes,
                                  const int8_t* q, const float* dx, const float* msx,
                                  float* out) {
  for (int j = 0; j < kNR; ++j) out[j] = 0.f;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* grp = panel + g * gbytes;
    const uint8_t* codes = grp + int8_header<T>();
    const int8_t* qg = q + g * kInt8Group;
    for (int j = 0; j < kNR; ++j) {
      int isum = 0;
      if constexpr (T == GgufType::q4_1) {
        for (int i = 0; i < kInt8Group / 2; ++i) {
          const uint8_t b = codes[i * kNR + j];
          isum += static_cast<int>(b & 0xF) * qg[2 * i] + static_cast<int>(b >> 4) * qg[2 * i + 1];
        }
      } else {
        for (int k = 0; k < kInt8Group; ++k)
          isum += static_cast<int>(static_cast<int8_t>(codes[k * kNR + j])) * qg[k];
      }
      const float d = half_to_float(load_u16(grp + 2 * j));
      const float dd = d * dx[g];
      out[j] = std::fma(dd, static_cast<float>(isum), out[j]);
      if constexpr (T == GgufType::q4_1) {
        const float m = half_to_float(load_u16(grp + 2 * (kNR + j)));
        out[j] = std::fma(m, msx[g], out[j]);
      }
    }
  }
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
constexpr bool kInt8Vector = true;
static_assert(kNR % 16 == 0, "the 8-bit tile takes 16 columns at a time");

// int8_panel_row_scalar's arithmetic, 16 columns at a time, with each column's four consecutive
// codes (k, .., k+3) in one 32-bit lane times the row's four values there (one 32-bit
// broadcast): maddubs (unsigned x signed bytes) sums each column's pairs in 16 bits, madd with
// ones adds a column's two pairs in 32 bits. The exact integer sum of each column, then the same
// fused multiply-adds.
//  - Q4_1: the 16-bit pair sums add up over the group's 8 steps of 4 k (each <= 8 * 2 * 15 * 127
//    = 30480: no overflow) and are widened once per group.
//  - Q8_0: signed codes as |code| times q with the code's sign (a pair's sum <= 2 * 128 * 127 =
//    32512: no overflow), widened at each step.
// The lanes hold the columns in the order [0-3 | 8-11] and [4-7 | 12-15] (the shuffles stay
// inside 128-bit lanes); the scales are permuted alike and the outputs back at the end, so each
// column gets exactly its own operations.
//
// Per panel the groups go in order, each row's fp32 accumulators in memory between groups. A
// call of up to 4 rows (int8_panel_rows) rearranges each step in registers and uses it at once;
// more rows (int8_panel) rearrange each group once into a buffer in L1 that every row tile
// reads. Either way a row's operations are exactly the one-row ones (the same int8_step,
// int8_step_rows and int8_group_done), so its bits do not depend on M. Why this shape: with
// pairs of columns side by side (the first version) each step needed two widenings of four
// shuffles per row, and rearranging inside the row loop at 4 rows kept more vectors live than
// AVX2 has registers (a 16-row Q8_0 head ran slower than the exact fp32 product).
template <GgufType T>
constexpr int kInt8Vecs = T == GgufType::q4_1 ? 2 : 4;  // rearranged vectors per step of 4 k

// Step j (codes 4j .. 4j+3) of a group's 16 columns (block s), rearranged: w[0..1] the codes in
// the lanes' order, for Q8_0 w[2..3] their absolute values.
template <GgufType T>
inline void int8_step(const uint8_t* codes, int j, int s, __m256i* w) {
  // row k of the block's 16 columns in both lanes
  auto row16 = [&](int k) {
    return _mm256_broadcastsi128_si256(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k * kNR + 16 * s)));
  };
  // the byte pairs (row a, row b) of columns [0-7 | 8-15]
  auto pairs = [](__m256i a, __m256i b) {
    return _mm256_blend_epi32(_mm256_unpacklo_epi8(a, b), _mm256_unpackhi_epi8(a, b), 0xF0);
  };
  if constexpr (T == GgufType::q4_1) {
    // byte rows 2j (codes 4j | 4j+1 << 4) and 2j+1 (4j+2 | 4j+3 << 4), per column
    const __m256i nib = _mm256_set1_epi8(0x0F);
    const __m256i t = pairs(row16(2 * j), row16(2 * j + 1));
    const __m256i l = _mm256_and_si256(t, nib);
    const __m256i h = _mm256_and_si256(_mm256_srli_epi16(t, 4), nib);
    w[0] = _mm256_unpacklo_epi8(l, h);
    w[1] = _mm256_unpackhi_epi8(l, h);
  } else {
    const __m256i t01 = pairs(row16(4 * j), row16(4 * j + 1));
    const __m256i t23 = pairs(row16(4 * j + 2), row16(4 * j + 3));
    w[0] = _mm256_unpacklo_epi16(t01, t23);
    w[1] = _mm256_unpackhi_epi16(t01, t23);
    w[2] = _mm256_abs_epi8(w[0]);
    w[3] = _mm256_abs_epi8(w[1]);
  }
}

// MR rows' integer sums of a group, carried across its steps: Q4_1's in 16 bits (widened by
// int8_group_done), Q8_0's in 32.
template <int MR>
struct Int8Sums {
  __m256i v[MR][2];
  Int8Sums() {
    for (int r = 0; r < MR; ++r) v[r][0] = v[r][1] = _mm256_setzero_si256();
  }
};

// One step (rearranged codes w, int8_step) for MR rows: q points at each row's group values,
// rows ldq apart.
template <GgufType T, int MR>
inline void int8_step_rows(const __m256i* w, const int8_t* q, int64_t ldq, int j,
                           Int8Sums<MR>& acc) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < MR; ++r) {
    int32_t v;  // the row's q(4j) .. q(4j+3) in every 32-bit lane
    std::memcpy(&v, q + r * ldq + 4 * j, 4);
    const __m256i x = _mm256_set1_epi32(v);
    for (int h = 0; h < 2; ++h) {
      if constexpr (T == GgufType::q4_1) {
        acc.v[r][h] = _mm256_add_epi16(acc.v[r][h], _mm256_maddubs_epi16(w[h], x));
      } else {
        const __m256i p = _mm256_maddubs_epi16(w[2 + h], _mm256_sign_epi8(x, w[h]));
        acc.v[r][h] = _mm256_add_epi32(acc.v[r][h], _mm256_madd_epi16(p, ones));
      }
    }
  }
}

// A group's sums done: acc[r] (row r's 16 columns of this block in the lanes' order, at
// acc + r * ld) = fma(d * dx, isum, acc) (+ fma(m, msx, acc) for Q4_1); dx, msx rows ldg apart.
template <GgufType T, int MR>
inline void int8_group_done(Int8Sums<MR>& sums, const __m256* d, const __m256* m,
                            const float* dx, const float* msx, int64_t ldg, float* acc,
                            int64_t ld) {
  const __m256i ones = _mm256_set1_epi16(1);
  for (int r = 0; r < MR; ++r) {
    const __m256 vdx = _mm256_set1_ps(dx[r * ldg]);
    const __m256 vmsx = _mm256_set1_ps(msx[r * ldg]);
    for (int h = 0; h < 2; ++h) {
      __m256i isum = sums.v[r][h];
      if constexpr (T == GgufType::q4_1) isum = _mm256_madd_epi16(isum, ones);
      float* o = acc + r * ld + 8 * h;
      __m256 v = _mm256_loadu_ps(o);
      v = _mm256_fmadd_ps(_mm256_mul_ps(d[h], vdx), _mm256_cvtepi32_ps(isum), v);
      if constexpr (T == GgufType::q4_1) v = _mm256_fmadd_ps(m[h], vmsx, v);
      _mm256_storeu_ps(o, v);
    }
  }
}

// The fp16 scales (or offsets) of 16 columns at p, in the lanes' order.
inline void int8_lanes(const uint8_t* p, __m256* v) {
  const __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
  v[0] = _mm256_permute2f128_ps(lo, hi, 0x20);
  v[1] = _mm256_permute2f128_ps(lo, hi, 0x31);
}

// A group's scales (and offsets) of block s, in the lanes' order.
template <GgufType T>
inline void int8_scales(const uint8_t* grp, int s, __m256* d, __m256* m) {
  int8_lanes(grp + 2 * 16 * s, d);
  if constexpr (T == GgufType::q4_1) int8_lanes(grp + 2 * (kNR + 16 * s), m);
}

// rows of kNR outputs at out (ld apart), from the lanes' order back to the columns'.
inline void int8_unpermute(float* out, int64_t rows, int64_t ld) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int s = 0; s < kNR / 16; ++s) {
      float* o = out + r * ld + 16 * s;
      const __m256 a = _mm256_loadu_ps(o), b = _mm256_loadu_ps(o + 8);
      _mm256_storeu_ps(o, _mm256_permute2f128_ps(a, b, 0x20));
      _mm256_storeu_ps(o + 8, _mm256_permute2f128_ps(a, b, 0x31));
    }
  }
}

inline void prefetch_group(const uint8_t* grp, int64_t gbytes) {
  for (int64_t b = 0; b < gbytes; b += 64) {
    _mm_prefetch(reinterpret_cast<const char*>(grp + kPrefetchAhead + b), _MM_HINT_T0);
  }
}

constexpr int kInt8MR = 4;  // rows per register tile

// A call of at most kInt8MR rows (a decoding step), straight from the panel: each step's codes
// rearranged in registers and used at once, the sums in registers. At 1-4 rows this is
// 1.1-1.4x faster than int8_panel_buffered (its stores and reloads, the zeroing, the final
// permutation), measured in one process; beyond, the buffer wins (it rearranges each group once
// for all rows; a 160-row Q8_0 head 1.4x faster). The same operations per row, so the same bits.
template <GgufType T, int MR>
inline void int8_panel_rows(const uint8_t* panel, int64_t groups, int64_t gbytes,
                            const int8_t* q, int64_t ldq, const float* dx, const float* msx,
                            int64_t ldg, float* out) {
  std::fill(out, out + MR * kNR, 0.f);
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* grp = panel + g * gbytes;
    prefetch_group(grp, gbytes);
    for (int s = 0; s < kNR / 16; ++s) {
      Int8Sums<MR> sums;
      for (int j = 0; j < 8; ++j) {
        __m256i w[kInt8Vecs<T>];
        int8_step<T>(grp + int8_header<T>(), j, s, w);
        int8_step_rows<T, MR>(w, q + g * kInt8Group, ldq, j, sums);
      }
      __m256 d[2], m[2];
      int8_scales<T>(grp, s, d, m);
      int8_group_done<T, MR>(sums, d, m, dx + g, msx + g, ldg, out + 16 * s, kNR);
    }
  }
  int8_unpermute(out, MR, kNR);
}

template <GgufType T>
inline void int8_panel_tile(int rows, const uint8_t* panel, int64_t groups, int64_t gbytes,
                            const int8_t* q, int64_t ldq, const float* dx, const float* msx,
                            int64_t ldg, float* out) {
  switch (rows) {
    case 1: return int8_panel_rows<T, 1>(panel, groups, gbytes, q, ldq, dx, msx, ldg, out);
    case 2: return int8_panel_rows<T, 2>(panel, groups, gbytes, q, ldq, dx, msx, ldg, out);
    case 3: return int8_panel_rows<T, 3>(panel, groups, gbytes, q, ldq, dx, msx, ldg, out);
    default: return int8_panel_rows<T, 4>(panel, groups, gbytes, q, ldq, dx, msx, ldg, out);
  }
}

// Rows m0 .. m0 + MR of int8_panel's group g (block s) from its rearranged steps w.
template <GgufType T, int MR>
inline void int8_buffered_rows(const __m256i (*w)[kInt8Vecs<T>], const int8_t* q, int64_t ldq,
                               const __m256* d, const __m256* m, const float* dx,
                               const float* msx, int64_t ldg, float* out) {
  Int8Sums<MR> sums;
  for (int j = 0; j < 8; ++j) int8_step_rows<T, MR>(w[j], q, ldq, j, sums);
  int8_group_done<T, MR>(sums, d, m, dx, msx, ldg, out, kNR);
}

// int8_panel beyond kInt8MR rows: per group, its codes rearranged once into a buffer in L1 that
// every row tile reads.
template <GgufType T>
inline void int8_panel_buffered(const uint8_t* panel, int64_t groups, int64_t gbytes,
                                int64_t M, const int8_t* q, int64_t ldq, const float* dx,
                                const float* msx, int64_t ldg, float* out) {
  std::fill(out, out + M * kNR, 0.f);
  __m256i w[8][kInt8Vecs<T>];
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* grp = panel + g * gbytes;
    prefetch_group(grp, gbytes);
    for (int s = 0; s < kNR / 16; ++s) {
      for (int j = 0; j < 8; ++j) int8_step<T>(grp + int8_header<T>(), j, s, w[j]);
      __m256 d[2], m[2];
      int8_scales<T>(grp, s, d, m);
      for (int64_t m0 = 0; m0 < M; m0 += kInt8MR) {
        const int8_t* qg = q + m0 * ldq + g * kInt8Group;
        const float *dxg = dx + m0 * ldg + g, *msxg = msx + m0 * ldg + g;
        float* o = out + m0 * kNR + 16 * s;
        switch (std::min<int64_t>(kInt8MR, M - m0)) {
          case 1: int8_buffered_rows<T, 1>(w, qg, ldq, d, m, dxg, msxg, ldg, o); break;
          case 2: int8_buffered_rows<T, 2>(w, qg, ldq, d, m, dxg, msxg, ldg, o); break;
          case 3: int8_buffered_rows<T, 3>(w, qg, ldq, d, m, dxg, msxg, ldg, o); break;
          default: int8_buffered_rows<T, 4>(w, qg, ldq, d, m, dxg, msxg, ldg, o);
        }
      }
    }
  }
  int8_unpermute(out, M, kNR);
}

// One panel times all M rows of x (quantized: q [M, ldq], dx / msx [M, ldg]) into out [M, kNR].
template <GgufType T>
inline void int8_panel(const uint8_t* panel, int64_t groups, int64_t gbytes, int64_t M,
                       const int8_t* q, int64_t ldq, const float* dx, const float* msx,
                       int64_t ldg, float* out) {
  if (M <= kInt8MR) {
    return int8_panel_tile<T>(static_cast<int>(M), panel, groups, gbytes, q, ldq, dx, msx, ldg,
                              out);
  }
  int8_panel_buffered<T>(panel, groups, gbytes, M, q, ldq, dx, msx, ldg, out);
}
#else
constexpr bool kInt8Vector = false;
template <GgufType T>
inline void int8_panel(const uint8_t*, int64_t, int64_t, int64_t, const int8_t*, int64_t,
                       const float*, const float*, int64_t, float*) {}
#endif

// The AMX tile's shape (below): rows of x per tile product, and the fewest rows of a call it
// takes (fewer: the VNNI tile). 65: prefills and batches, not a step of one sequence: at 16-32
// rows a whole step ran no faster on AMX, and with a switch at 16 the tuner's quick probe
// (jacobi_ext/decoding/tuning.py: QUICK_SIZES 1, 16, 64) would time its 16-row point on one
// kernel and the 5-15-row steps it interpolates from it on another.
constexpr int kAmxRows = 16;
constexpr int kAmxMinRows = 65;

#if defined(CPU_CAPABILITY_AVX512)
// ---- The 8-bit tile on AVX512-VNNI (vpdpbusd), chosen at run time where the CPU has it --------
//
// Why: on a CPU with VNNI one vpdpbusd multiplies 64 unsigned code bytes by 64 signed x bytes and
// adds each column's four products to its 32-bit sum: what maddubs + madd + add do above in three
// instructions on half the lanes. A 16-token step spent ~3/4 of its time in the 8-bit linears on
// an AVX-512 EPYC (compute-bound there, not reading-bound), as did the prefill.
//
// The same integer sums (exact, whatever the order) and then the same fused multiply-adds per
// column and group as int8_panel_row_scalar: the same bits as every other ISA
// (tests/test_gguf_linear.py compares them). The packed layout is the one every path reads
// (linear_gguf_cpu.h); each group's codes are rearranged once per call into one 32-bit lane per
// column (16 columns a vector), four codes a lane:
//  - Q4_1: byte rows 4t .. 4t+3 hold k 8t .. 8t+7 as (k even | k odd << 4), so lane bytes' low
//    nibbles are k 8t, 8t+2, 8t+4, 8t+6 and the high ones k 8t+1, .. 8t+7; x is arranged to match
//    once per row (vnni_arrange_row);
//  - Q8_0: byte rows 4j .. 4j+3 are k 4j .. 4j+3, x read as quantized; vpdpbusd takes unsigned
//    codes, so each code is taken plus 128 (flipping its top bit) and 128 times the group's sum
//    of x (quantize_group's qsum) taken off first.
#define JACOBI_VNNI_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni")))

// Whether the environment variable `name` is "0" (a tile turned off, to compare tiles on one
// machine and for the tests).
bool turned_off(const char* name) {
  const char* env = std::getenv(name);
  return env != nullptr && std::strcmp(env, "0") == 0;
}

// Whether the CPU has AVX512-VNNI, unless JACOBI_EXT_CPU_VNNI=0 turns the tile off (the same
// bits either way). Cached.
bool cpu_has_avx512_vnni() {
  static const bool has = [] {
    if (turned_off("JACOBI_EXT_CPU_VNNI")) return false;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512vnni") != 0;
  }();
  return has;
}

// Whether the CPU also has AVX512-VBMI (vpermt2b: any 64 of 128 bytes in one instruction), which
// arranges the VNNI tile's codes (vnni_codes_vbmi), unless JACOBI_EXT_CPU_VBMI=0 (the same bits
// either way). Ice Lake and Zen 4 have it; Cascade Lake has VNNI without it. Cached.
bool cpu_has_avx512_vbmi() {
  static const bool has = [] {
    if (turned_off("JACOBI_EXT_CPU_VBMI")) return false;
    __builtin_cpu_init();
    return cpu_has_avx512_vnni() && __builtin_cpu_supports("avx512vbmi") != 0;
  }();
  return has;
}

// One row of Q4_1's quantized x (q, K values) as the VNNI tile reads it: each 8 k as
// k 0, 2, 4, 6, 1, 3, 5, 7 (the nibbles' order in a lane).
inline void vnni_arrange_row(const int8_t* q, int64_t K, int8_t* qa) {
  const __m128i order = _mm_setr_epi8(0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15);
  for (int64_t k = 0; k < K; k += 16) {  // K is a multiple of kInt8Group = 32 (the op checks)
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + k));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qa + k), _mm_shuffle_epi8(v, order));
  }
}

// A group's codes of columns 16 s .. 16 s + 15, one lane per column: w[j] pairs with x bytes
// 4j .. 4j+3 of the arranged row (see above).
template <GgufType T>
JACOBI_VNNI_TARGET inline void vnni_codes(const uint8_t* codes, int s, __m512i* w) {
  auto row = [&](int r) {
    return _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + r * kNR + 16 * s)));
  };
  auto lanes = [&](int r) {  // byte rows r .. r+3 of each column in its lane
    const __m512i b = _mm512_slli_epi32(row(r + 1), 8), c = _mm512_slli_epi32(row(r + 2), 16);
    return _mm512_or_si512(_mm512_ternarylogic_epi32(row(r), b, c, 0xFE),
                           _mm512_slli_epi32(row(r + 3), 24));
  };
  if constexpr (T == GgufType::q4_1) {
    const __m512i nib = _mm512_set1_epi8(0x0F);
    for (int t = 0; t < 4; ++t) {
      const __m512i v = lanes(4 * t);
      w[2 * t] = _mm512_and_si512(v, nib);
      w[2 * t + 1] = _mm512_and_si512(_mm512_srli_epi32(v, 4), nib);
    }
  } else {
    const __m512i top = _mm512_set1_epi8(static_cast<char>(0x80));
    for (int j = 0; j < 8; ++j) w[j] = _mm512_xor_si512(lanes(4 * j), top);
  }
}

#define JACOBI_VBMI_TARGET \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi")))

// vnni_codes for both halves of a group with VBMI: byte rows 4t .. 4t+3 of the 32 columns are 128
// contiguous bytes, and one vpermt2b per half puts column c's four bytes in its lane (lane byte i
// from row 4t + i): the same lanes as vnni_codes builds from 4 widening loads, 3 shifts and 2 ors
// a row set and half. Q4_1's nibbles are then split as there, Q8_0's codes taken plus 128 (or,
// for the AMX tile's signed product, kept as stored: kUnsigned = false).
struct VbmiIndex {  // half h: lane j's byte i is row 4t + i's column 16 h + j
  alignas(64) int8_t at[2][64];
  VbmiIndex() {
    for (int h = 0; h < 2; ++h)
      for (int j = 0; j < 16; ++j)
        for (int i = 0; i < 4; ++i) at[h][4 * j + i] = static_cast<int8_t>(32 * i + 16 * h + j);
  }
};

template <GgufType T, bool kUnsigned = true>
JACOBI_VBMI_TARGET inline void vnni_codes_vbmi(const uint8_t* codes, const __m512i* idx,
                                               __m512i (*w)[8]) {
  constexpr int kSets = T == GgufType::q4_1 ? 4 : 8;  // sets of 4 byte rows in a group
  for (int t = 0; t < kSets; ++t) {
    const __m512i lo = _mm512_loadu_si512(codes + 4 * kNR * t);
    const __m512i hi = _mm512_loadu_si512(codes + 4 * kNR * t + 2 * kNR);
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_permutex2var_epi8(lo, idx[h], hi);
      if constexpr (T == GgufType::q4_1) {
        const __m512i nib = _mm512_set1_epi8(0x0F);
        w[h][2 * t] = _mm512_and_si512(v, nib);
        w[h][2 * t + 1] = _mm512_and_si512(_mm512_srli_epi32(v, 4), nib);
      } else if constexpr (kUnsigned) {
        w[h][t] = _mm512_xor_si512(v, _mm512_set1_epi8(static_cast<char>(0x80)));
      } else {
        w[h][t] = v;
      }
    }
  }
}

// A group's fp16 scales d (and Q4_1's offsets m) of its two halves of 16 columns, widened
// (exact): the VNNI and AMX tiles' float steps read them.
template <GgufType T>
JACOBI_VNNI_TARGET inline void group_scales(const uint8_t* grp, __m512* d, __m512* m) {
  for (int h = 0; h < 2; ++h) {
    d[h] = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 32 * h)));
    if constexpr (T == GgufType::q4_1) {
      m[h] = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(grp + 2 * kNR + 32 * h)));
    }
  }
}

// 16 columns' outputs after one group: int8_panel_row_scalar's steps, acc = fma(d * dx, isum,
// acc), then for Q4_1 acc = fma(m, msx, acc) (dx, msx the row's, broadcast). The one place the
// AVX-512 tiles (VNNI, AMX) spell them.
template <GgufType T>
JACOBI_VNNI_TARGET inline __m512 group_step(__m512 acc, __m512 d, __m512 m, __m512 dx,
                                            __m512 msx, __m512i isum) {
  acc = _mm512_fmadd_ps(_mm512_mul_ps(d, dx), _mm512_cvtepi32_ps(isum), acc);
  if constexpr (T == GgufType::q4_1) acc = _mm512_fmadd_ps(m, msx, acc);
  return acc;
}

// int8_panel_vnni's work on group g (at grp) of every row, its codes arranged in w.
template <GgufType T>
JACOBI_VNNI_TARGET inline void vnni_group(const uint8_t* grp, const __m512i (*w)[8], int64_t g,
                                          int64_t M, const int8_t* qa, int64_t ldq,
                                          const int32_t* qsum, const float* dx, const float* msx,
                                          int64_t ldg, float* out) {
  // The first group's sums start from zero where the later ones read out (the same fmadd on
  // the same zero as from a zeroed out, without the zeroing: a memset per panel was ~4 % of an
  // 8-token 8-bit step's samples).
  const bool first = g == 0;
  __m512 d[2], m[2];
  group_scales<T>(grp, d, m);
  for (int64_t r = 0; r < M; ++r) {
    const int8_t* xg = qa + r * ldq + g * kInt8Group;
    // two chains per half (even and odd steps), added at the end: exact integers
    __m512i acc[2][2];
    const __m512i init = T == GgufType::q8_0 ? _mm512_set1_epi32(-128 * qsum[r * ldg + g])
                                             : _mm512_setzero_si512();
    acc[0][0] = acc[1][0] = init;
    acc[0][1] = acc[1][1] = _mm512_setzero_si512();
    for (int j = 0; j < 8; ++j) {
      int32_t v;
      std::memcpy(&v, xg + 4 * j, 4);
      const __m512i x = _mm512_set1_epi32(v);
      acc[0][j & 1] = _mm512_dpbusd_epi32(acc[0][j & 1], w[0][j], x);
      acc[1][j & 1] = _mm512_dpbusd_epi32(acc[1][j & 1], w[1][j], x);
    }
    const __m512 vdx = _mm512_set1_ps(dx[r * ldg + g]);
    const __m512 vmsx = _mm512_set1_ps(msx[r * ldg + g]);
    for (int h = 0; h < 2; ++h) {
      const __m512i isum = _mm512_add_epi32(acc[h][0], acc[h][1]);
      float* o = out + r * kNR + 16 * h;
      const __m512 prev = first ? _mm512_setzero_ps() : _mm512_loadu_ps(o);
      _mm512_storeu_ps(o, group_step<T>(prev, d[h], m[h], vdx, vmsx, isum));
    }
  }
}

// int8_panel on VNNI: one panel (kNR = 32 columns) times all M rows (qa [M, ldq]: Q4_1's
// arranged, Q8_0's as quantized; Q8_0's group sums qsum [M, ldg]) into out [M, kNR]. Per group
// the codes are arranged once, for every row (at a step's few rows most of the tile's work
// without VBMI).
template <GgufType T>
JACOBI_VNNI_TARGET void int8_panel_vnni(const uint8_t* panel, int64_t groups, int64_t gbytes,
                                        int64_t M, const int8_t* qa, int64_t ldq,
                                        const int32_t* qsum, const float* dx, const float* msx,
                                        int64_t ldg, float* out) {
  static_assert(kNR == 32, "the VNNI tile takes a panel as two vectors of 16 columns");
  if (groups == 0) std::fill(out, out + M * kNR, 0.f);
  for (int64_t g = 0; g < groups; ++g) {  // (vnni_group writes out at g = 0)
    const uint8_t* grp = panel + g * gbytes;
    prefetch_group(grp, gbytes);
    __m512i w[2][8];
    vnni_codes<T>(grp + int8_header<T>(), 0, w[0]);
    vnni_codes<T>(grp + int8_header<T>(), 1, w[1]);
    vnni_group<T>(grp, w, g, M, qa, ldq, qsum, dx, msx, ldg, out);
  }
}

// int8_panel_vnni with the codes arranged by vnni_codes_vbmi: the same lanes, the same bits. Its
// own copy of the group loop: a function compiled for VNNI alone may not inline VBMI code.
template <GgufType T>
JACOBI_VBMI_TARGET void int8_panel_vbmi(const uint8_t* panel, int64_t groups, int64_t gbytes,
                                        int64_t M, const int8_t* qa, int64_t ldq,
                                        const int32_t* qsum, const float* dx, const float* msx,
                                        int64_t ldg, float* out) {
  static const VbmiIndex index;
  const __m512i idx[2] = {_mm512_load_si512(index.at[0]), _mm512_load_si512(index.at[1])};
  if (groups == 0) std::fill(out, out + M * kNR, 0.f);
  for (int64_t g = 0; g < groups; ++g) {  // (vnni_group writes out at g = 0)
    const uint8_t* grp = panel + g * gbytes;
    prefetch_group(grp, gbytes);
    __m512i w[2][8];
    vnni_codes_vbmi<T>(grp + int8_header<T>(), idx, w);
    vnni_group<T>(grp, w, g, M, qa, ldq, qsum, dx, msx, ldg, out);
  }
}

// ---- The 8-bit tile on AMX (tdpbsud / tdpbssd), chosen at run time for prefills ---------------
//
// Why: a CPU with AMX-INT8 (Sapphire Rapids and later) multiplies a tile of up to 16 rows of x
// bytes by a tile of 16 columns' code bytes in one instruction, each column's 32-bit sum per row:
// for one group of 32 k at 16 rows, the work of 16 x 8 vpdpbusd. But each group's sums must leave
// the tile (its scales differ per group and row), so per group and 16 rows it costs two tile
// products, three tile loads and two tile stores (~66 cycles, at the unit's rate), and the float
// steps per row stay. Measured on a 2-core Xeon with AMX (2026-12-01; one 1536 x 576 Q4_1 linear,
// hot, 2 threads): 1.14x the VNNI tile at 16 rows, 1.3x at 64, slower at 4 (22 against 18 us);
// a 512-token prefill of SmolLM2-135M 1.2-1.25x, a 128-token one 1.1-1.17x, 16-32-token steps
// equal. So it takes calls of kAmxMinRows rows or more (prefills, batches); fewer stay on the
// VNNI tile.
//
// The same integer sums (exact) and then the same fused multiply-adds per column and group, in
// the same order, as int8_panel_row_scalar: the same bits as every other tile. The codes are
// arranged by vnni_codes_vbmi into the VNNI tile's lanes, which are the layout a tile product
// reads for its second operand (row j: each column's four codes that pair with x bytes
// 4j .. 4j+3), and loaded as two tiles (the panel's two halves of 16 columns); Q4_1 takes x
// arranged as for VNNI (vnni_arrange_row) times unsigned nibbles (tdpbsud), Q8_0 x as quantized
// times its codes as stored, both signed (tdpbssd: no +128). Tiles: 0 and 1 the halves' sums (R
// rows x 16 int32), 2 the x rows (R x 32 bytes), 3 and 4 the halves' codes (8 rows x 64 bytes);
// R = min(M, kAmxRows), configured per thread and call.
#define JACOBI_AMX_TARGET                                                                \
  __attribute__((target("avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,amx-tile,"      \
                        "amx-int8")))

constexpr int kAmxChunk = 8;  // groups arranged ahead of their products (8 KB of codes)

// Whether the CPU has AMX-TILE and AMX-INT8 and the OS lets this process use them (Linux: asked
// for once; without it the first tile instruction faults), unless JACOBI_EXT_CPU_AMX=0 turns the
// tile off (the same bits either way). It arranges codes with VBMI, which every AMX CPU has, so
// JACOBI_EXT_CPU_VBMI=0 (and _VNNI=0) turn it off too. Cached.
bool cpu_has_amx_int8() {
  static const bool has = [] {
    if (turned_off("JACOBI_EXT_CPU_AMX") || !cpu_has_avx512_vbmi()) return false;
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid_count(7, 0, &a, &b, &c, &d) == 0) return false;
    constexpr unsigned kAmxTile = 1u << 24, kAmxInt8 = 1u << 25;  // CPUID.(7, 0):EDX
    if ((d & kAmxTile) == 0 || (d & kAmxInt8) == 0) return false;
#if defined(__linux__)
    constexpr long kReqXcompPerm = 0x1023, kXtileData = 18;  // arch_prctl, the tile data state
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) == 0;
#else
    return false;
#endif
  }();
  return has;
}

// The palette-1 tile configuration (64 bytes, Intel's layout).
struct alignas(64) AmxConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of each tile
  uint8_t rows[16] = {};
};

// This thread's tiles for products of `rows` rows of x (<= kAmxRows).
JACOBI_AMX_TARGET void amx_configure(int rows) {
  AmxConfig c;
  c.rows[0] = c.rows[1] = c.rows[2] = static_cast<uint8_t>(rows);
  c.colsb[0] = c.colsb[1] = 64;
  c.colsb[2] = kInt8Group;
  c.rows[3] = c.rows[4] = kInt8Group / 4;
  c.colsb[3] = c.colsb[4] = 64;
  // ldtilecfg in asm with c as a memory operand: GCC 12's _tile_loadconfig does not tell the
  // compiler that it reads c, which then dropped c's stores (every tile unconfigured, the first
  // tile load faulting).
  asm volatile("ldtilecfg %0" : : "m"(c));
}

// This thread's tiles given back (their state no longer saved at each context switch).
JACOBI_AMX_TARGET void amx_release() { _tile_release(); }

// int8_panel on AMX: one panel times all M rows (qa [M', ldq] as for the VNNI tile, Q4_1's
// arranged, M' = M rounded up to whole tiles of kAmxRows: the last product reads rows past M,
// whose sums are not used) into out [M, kNR]. The thread's tiles configured by amx_configure
// for min(M, kAmxRows) rows. Per chunk of kAmxChunk groups, in three passes: the codes arranged
// and the scales widened; then, per tile of rows, every group's two tile products, their sums
// stored; then the float steps, row by row, each row's outputs in registers over the chunk's
// groups in order. (Arranging each group right before its products, sums and float steps group
// by group, ran 5-10 % slower at 16-64 rows.)
template <GgufType T>
JACOBI_AMX_TARGET void int8_panel_amx(const uint8_t* panel, int64_t groups, int64_t gbytes,
                                      int64_t M, const int8_t* qa, int64_t ldq, const float* dx,
                                      const float* msx, int64_t ldg, float* out) {
  static_assert(kNR == 32, "the AMX tile takes a panel as two tiles of 16 columns");
  static const VbmiIndex index;
  const __m512i idx[2] = {_mm512_load_si512(index.at[0]), _mm512_load_si512(index.at[1])};
  alignas(64) __m512i w[kAmxChunk][2][8];                // the chunk's arranged codes
  alignas(64) int32_t sums[kAmxChunk][2][kAmxRows][16];  // ... their sums, a tile of rows
  __m512 d[kAmxChunk][2], m[kAmxChunk][2];               // ... their scales and offsets
  std::fill(out, out + M * kNR, 0.f);
  for (int64_t g0 = 0; g0 < groups; g0 += kAmxChunk) {
    const int gn = static_cast<int>(std::min<int64_t>(kAmxChunk, groups - g0));
    for (int i = 0; i < gn; ++i) {
      const uint8_t* grp = panel + (g0 + i) * gbytes;
      prefetch_group(grp, gbytes);
      vnni_codes_vbmi<T, /*kUnsigned=*/false>(grp + int8_header<T>(), idx, w[i]);
      group_scales<T>(grp, d[i], m[i]);
    }
    for (int64_t m0 = 0; m0 < M; m0 += kAmxRows) {
      for (int i = 0; i < gn; ++i) {
        _tile_loadd(2, qa + m0 * ldq + (g0 + i) * kInt8Group, ldq);
        _tile_loadd(3, w[i][0], 64);
        _tile_loadd(4, w[i][1], 64);
        _tile_zero(0);
        _tile_zero(1);
        if constexpr (T == GgufType::q4_1) {
          _tile_dpbsud(0, 2, 3);
          _tile_dpbsud(1, 2, 4);
        } else {
          _tile_dpbssd(0, 2, 3);
          _tile_dpbssd(1, 2, 4);
        }
        _tile_stored(0, sums[i][0], 64);
        _tile_stored(1, sums[i][1], 64);
      }
      const int64_t rows = std::min<int64_t>(kAmxRows, M - m0);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t row = m0 + r;
        float* o = out + row * kNR;
        __m512 acc[2] = {_mm512_loadu_ps(o), _mm512_loadu_ps(o + 16)};
        for (int i = 0; i < gn; ++i) {
          const __m512 vdx = _mm512_set1_ps(dx[row * ldg + g0 + i]);
          const __m512 vmsx = _mm512_set1_ps(msx[row * ldg + g0 + i]);
          for (int h = 0; h < 2; ++h) {
            const __m512i isum = _mm512_load_si512(sums[i][h][r]);
            acc[h] = group_step<T>(acc[h], d[i][h], m[i][h], vdx, vmsx, isum);
          }
        }
        _mm512_storeu_ps(o, acc[0]);
        _mm512_storeu_ps(o + 16, acc[1]);
      }
    }
  }
}
#else
inline bool cpu_has_avx512_vnni() { return false; }
inline bool cpu_has_avx512_vbmi() { return false; }
inline bool cpu_has_amx_int8() { return false; }
inline void amx_configure(int) {}
inline void amx_release() {}
template <GgufType T>
inline void int8_panel_amx(const uint8_t*, int64_t, int64_t, int64_t, const int8_t*, int64_t,
                           const float*, const float*, int64_t, float*) {}
inline void vnni_arrange_row(const int8_t*, int64_t, int8_t*) {}
template <GgufType T>
inline void int8_panel_vnni(const uint8_t*, int64_t, int64_t, int64_t, const int8_t*, int64_t,
                            const int32_t*, const float*, const float*, int64_t, float*) {}
template <GgufType T>
inline void int8_panel_vbmi(const uint8_t*, int64_t, int64_t, int64_t, const int8_t*, int64_t,
                            const int32_t*, const float*, const float*, int64_t, float*) {}
#endif

template <GgufType T>
void run_int8(const LinearArgs& a, const GgufLora& lo) {
  constexpr GgufFormat f = Traits<T>::kF;
  const int64_t panels = (a.N + kNR - 1) / kNR;
  const int64_t groups = a.K / f.group_k;
  const int64_t gbytes = gguf_group_bytes(f, kNR);
  const int64_t panel_bytes = groups * gbytes;
  const int64_t grain =
      std::max<int64_t>(1, kMinBytesPerThread / std::max<int64_t>(panel_bytes, 1));
  // Every row quantized once, and for the VNNI tile Q4_1's rows arranged to its lanes: a step's
  // few rows on the calling thread (a few microseconds), a prefill's hundreds split among the
  // threads (on the calling thread alone the other waited through them). Each row alone: the
  // same bytes either way.
  const bool vnni = cpu_has_avx512_vnni(), vbmi = cpu_has_avx512_vbmi();
  const bool amx = a.M >= kAmxMinRows && cpu_has_amx_int8();
  const bool arrange = vnni && T == GgufType::q4_1;
  thread_local std::vector<int8_t> q, qa;
  thread_local std::vector<float> dx, msx;
  thread_local std::vector<int32_t> qsum;
  // the AMX tile's last product reads whole tiles of rows (those past M unused)
  const int64_t q_rows = amx ? (a.M + kAmxRows - 1) / kAmxRows * kAmxRows : a.M;
  q.resize(static_cast<size_t>(q_rows * a.K));
  if (arrange) qa.resize(q.size());
  dx.resize(static_cast<size_t>(a.M * groups));
  msx.resize(static_cast<size_t>(a.M * groups));
  qsum.resize(static_cast<size_t>(a.M * groups));
  // Pointers, not the vectors: in the workers a thread_local name is the worker's own (empty).
  int8_t* qp = q.data();
  int8_t* qap = qa.data();
  int32_t* qsump = qsum.data();
  float *dxp = dx.data(), *msxp = msx.data();
  const float* x = static_cast<const float*>(a.x);
  // values a thread quantizes at least: a step of 8 or more rows split among the threads (its
  // rows quantized one after another on the calling thread while the others waited)
  constexpr int64_t kQuantizeGrain = 4096;
  cpu::parallel_for(0, a.M, std::max<int64_t>(1, kQuantizeGrain / a.K), [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      quantize_row(x + m * a.ldx, a.K, qp + m * a.K, dxp + m * groups, msxp + m * groups,
                   qsump + m * groups);
      if (arrange) vnni_arrange_row(qp + m * a.K, a.K, qap + m * a.K);
    }
  });
  const auto* packed = static_cast<const uint8_t*>(a.packed);
  const int8_t* qvp = arrange ? qap : qp;  // what the VNNI tile reads
  panel_loop(a, lo, panels, 1, panel_bytes, grain, /*rows_apart=*/16, [&](int64_t p0, int64_t p1) {
    constexpr int64_t kSmallM = 16;  // rows whose outputs fit the stack buffer
    alignas(64) float small[kSmallM * kNR];
    std::vector<float> big;
    float* out = small;
    if (a.M > kSmallM) {
      big.resize(static_cast<size_t>(a.M * kNR));
      out = big.data();
    }
    if (amx) amx_configure(static_cast<int>(std::min<int64_t>(a.M, kAmxRows)));
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t n0 = p * kNR;
      const int cols = static_cast<int>(std::min<int64_t>(kNR, a.N - n0));
      const uint8_t* panel = packed + p * panel_bytes;
      if (amx) {
        int8_panel_amx<T>(panel, groups, gbytes, a.M, qvp, a.K, dxp, msxp, groups, out);
      } else if (vbmi) {
        int8_panel_vbmi<T>(panel, groups, gbytes, a.M, qvp, a.K, qsump, dxp, msxp, groups, out);
      } else if (vnni) {
        int8_panel_vnni<T>(panel, groups, gbytes, a.M, qvp, a.K, qsump, dxp, msxp, groups, out);
      } else if (kInt8Vector) {
        int8_panel<T>(panel, groups, gbytes, a.M, qp, a.K, dxp, msxp, groups, out);
      } else {
        for (int64_t m = 0; m < a.M; ++m) {
          int8_panel_row_scalar<T>(panel, groups, gbytes, qp + m * a.K, dxp + m * groups,
                                   msxp + m * groups, out + m * kNR);
        }
      }
      for (int64_t m0 = 0; m0 < a.M; m0 += kMaxMR) {
        const int rows = static_cast<int>(std::min<int64_t>(kMaxMR, a.M - m0));
        write_tile<float>(out + m0 * kNR, rows, cols, a, m0, n0);
      }
    }
    if (amx) amx_release();
  });
}

}  // namespace

void linear_gguf_pack(GgufType type, const uint8_t* const* rows, int64_t N, int64_t K,
                      uint8_t* packed) {
  const GgufFormat f = gguf_format_of(type);
  const int64_t panels = (N + kNR - 1) / kNR;
  const int64_t groups = K / f.group_k, blocks = K / f.block_k;
  const int gpb = f.block_k / f.group_k;
  const int64_t gbytes = gguf_group_bytes(f, kNR);
  const int64_t header = static_cast<int64_t>(kNR) * f.header_bytes;
  cpu::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
    int8_t codes[kMaxBlockK];
    GroupHeader hdr[kMaxGroupsPerBlock];
    for (int64_t p = p0; p < p1; ++p) {
      uint8_t* panel = packed + p * groups * gbytes;
      for (int j = 0; j < kNR; ++j) {
        const int64_t n = p * kNR + j;
        for (int64_t b = 0; b < blocks; ++b) {
          if (n < N) {
            decode_block(type, rows[n] + b * f.block_bytes, codes, hdr);
          } else {  // padding: every weight 0 (a zero scale and offset)
            std::fill(codes, codes + f.block_k, int8_t{0});
            std::fill(hdr, hdr + gpb, GroupHeader{});
          }
          for (int gi = 0; gi < gpb; ++gi) {
            uint8_t* g = panel + (b * gpb + gi) * gbytes;
            if (f.half_header) {
              std::memcpy(g + 2 * j, &hdr[gi].h0, 2);
              if (f.offset) std::memcpy(g + 2 * (kNR + j), &hdr[gi].h1, 2);
            } else {
              std::memcpy(g + 4 * j, &hdr[gi].f0, 4);
              if (f.offset) std::memcpy(g + 4 * (kNR + j), &hdr[gi].f1, 4);
            }
            const int8_t* q = codes + gi * f.group_k;
            uint8_t* c = g + header;
            if (f.code_bits == 4) {
              for (int i = 0; i < f.group_k / 2; ++i) {
                c[i * kNR + j] = static_cast<uint8_t>((q[2 * i] & 0xF) | ((q[2 * i + 1] & 0xF) << 4));
              }
            } else {
              for (int k = 0; k < f.group_k; ++k) c[k * kNR + j] = static_cast<uint8_t>(q[k]);
            }
          }
        }
      }
    }
  });
}

void linear_gguf(GgufType type, const LinearArgs& a, const GgufLora& lora) {
  if (a.M == 0 || a.N == 0) return;
  switch (type) {
    case GgufType::q4_0: return run<GgufType::q4_0>(a, lora);
    case GgufType::q4_1: return run<GgufType::q4_1>(a, lora);
    case GgufType::q8_0: return run<GgufType::q8_0>(a, lora);
    case GgufType::q4_k: return run<GgufType::q4_k>(a, lora);
    case GgufType::q5_k: return run<GgufType::q5_k>(a, lora);
    case GgufType::q6_k: return run<GgufType::q6_k>(a, lora);
  }
}

const char* linear_gguf_int8_tile() {
  if (cpu_has_amx_int8()) return "amx-int8";  // calls of kAmxMinRows rows or more; fewer: VBMI
  if (cpu_has_avx512_vbmi()) return "avx512-vnni-vbmi";
  if (cpu_has_avx512_vnni()) return "avx512-vnni";
  return kInt8Vector ? "avx2" : "scalar";
}

void linear_gguf_int8(GgufType type, const LinearArgs& a, const GgufLora& lora) {
  if (a.M == 0 || a.N == 0) return;
  if (type == GgufType::q4_1) run_int8<GgufType::q4_1>(a, lora);  // the op checks the type
  if (type == GgufType::q8_0) run_int8<GgufType::q8_0>(a, lora);
}

void linear_gguf_int8_residual(const float* x, int64_t M, int64_t K, int64_t ldx, float* r,
                               int64_t ldr) {
  int8_t q[kInt8Group];
  float dx, msx;
  int32_t qsum;
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < K / kInt8Group; ++g) {
      const float* xg = x + m * ldx + g * kInt8Group;
      float* rg = r + m * ldr + g * kInt8Group;
      quantize_group(xg, q, &dx, &msx, &qsum);  // run_int8's quantization, the same bytes
      for (int k = 0; k < kInt8Group; ++k) rg[k] = std::fma(-dx, static_cast<float>(q[k]), xg[k]);
    }
  }
}

}  // namespace jacobi::cpu::JACOBI_ISA

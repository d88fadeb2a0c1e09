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

#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstring>
#include <vector>

#if defined(__F16C__) || defined(CPU_CAPABILITY_AVX2) || defined(CPU_CAPABILITY_AVX512)
#include <immintrin.h>
#endif

#include "cpu/linear_tile.h"

namespace jacobi::cpu::JACOBI_ISA {
namespace {

using linear_tile::kMaxMR;
using linear_tile::kMinBytesPerThread;
using linear_tile::kNR;
using linear_tile::tile_f32_rows;
using linear_tile::write_tile;

constexpr int kMaxBlockK = 256;
constexpr int kMaxGroupsPerBlock = 16;
// k per dequantized chunk: an fp32 [k, NR] panel of 16 KB (a multiple of every group size).
constexpr int64_t kChunkK = 4096 / kNR;
static_assert(kChunkK % 32 == 0, "a chunk holds whole groups");

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
// The same with vector instructions, 16 (AVX2) or 32 (AVX-512) columns at once: the codes widened
// to int32, converted to fp32 (exact), times the scale, plus the offset: each its own rounding,
// as in the scalar loop (the file is compiled without contraction, and the intrinsics are
// separate multiplies and adds).
#if defined(CPU_CAPABILITY_AVX512)
using VF = __m512;
using VB = __m256i;  // the NR = 32 codes of one k (or two k, as nibbles)
inline VF vload(const uint8_t* p) { return _mm512_loadu_ps(reinterpret_cast<const float*>(p)); }
inline VF vhalves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline VB bload(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline VB low_nibbles(VB b) { return _mm256_and_si256(b, _mm256_set1_epi8(0x0F)); }
inline VB high_nibbles(VB b) {
  return _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi8(0x0F));
}
template <bool kSigned>
inline void widen(VB b, int bias, VF* lo, VF* hi) {
  const __m128i b0 = _mm256_castsi256_si128(b), b1 = _mm256_extracti128_si256(b, 1);
  __m512i i0 = kSigned ? _mm512_cvtepi8_epi32(b0) : _mm512_cvtepu8_epi32(b0);
  __m512i i1 = kSigned ? _mm512_cvtepi8_epi32(b1) : _mm512_cvtepu8_epi32(b1);
  if (bias != 0) {
    i0 = _mm512_add_epi32(i0, _mm512_set1_epi32(bias));
    i1 = _mm512_add_epi32(i1, _mm512_set1_epi32(bias));
  }
  *lo = _mm512_cvtepi32_ps(i0);
  *hi = _mm512_cvtepi32_ps(i1);
}
inline VF vmul(VF a, VF b) { return _mm512_mul_ps(a, b); }
inline VF vfmadd(VF a, VF b, VF c) { return _mm512_fmadd_ps(a, b, c); }
inline VF vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline VF vzero() { return _mm512_setzero_ps(); }
inline VF vadd(VF a, VF b) { return _mm512_add_ps(a, b); }
inline void vstore(float* p, VF v) { _mm512_storeu_ps(p, v); }
#else
using VF = __m256;
using VB = __m128i;
inline VF vload(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
inline VF vhalves(const uint8_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
inline VB bload(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline VB low_nibbles(VB b) { return _mm_and_si128(b, _mm_set1_epi8(0x0F)); }
inline VB high_nibbles(VB b) { return _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(0x0F)); }
template <bool kSigned>
inline void widen(VB b, int bias, VF* lo, VF* hi) {
  const __m128i b1 = _mm_srli_si128(b, 8);
  __m256i i0 = kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
  __m256i i1 = kSigned ? _mm256_cvtepi8_epi32(b1) : _mm256_cvtepu8_epi32(b1);
  if (bias != 0) {
    i0 = _mm256_add_epi32(i0, _mm256_set1_epi32(bias));
    i1 = _mm256_add_epi32(i1, _mm256_set1_epi32(bias));
  }
  *lo = _mm256_cvtepi32_ps(i0);
  *hi = _mm256_cvtepi32_ps(i1);
}
inline VF vmul(VF a, VF b) { return _mm256_mul_ps(a, b); }
inline VF vfmadd(VF a, VF b, VF c) { return _mm256_fmadd_ps(a, b, c); }
inline VF vbroadcast(const float* p) { return _mm256_set1_ps(*p); }
inline VF vzero() { return _mm256_setzero_ps(); }
inline VF vadd(VF a, VF b) { return _mm256_add_ps(a, b); }
inline void vstore(float* p, VF v) { _mm256_storeu_ps(p, v); }
#endif
constexpr int kHalfNR = kNR / 2;  // floats per VF
static_assert(sizeof(VF) == kHalfNR * sizeof(float), "a panel row is two vectors");
static_assert(sizeof(VB) == kNR, "one byte vector holds a panel row of codes");

// Walks the G weight rows of one packed group in k order: f(k, w0, w1) gets row k's NR weights
// (two vectors), each dequantized exactly as the scalar loop does: the codes widened to int32,
// converted (exact), times the scale, plus the offset, every step rounded on its own.
template <GgufType T, typename F>
inline void for_each_weight_row(const uint8_t* g, F&& f) {
  using Tr = Traits<T>;
  VF s0, s1, o0{}, o1{};
  if constexpr (Tr::kHalfHeader) {
    s0 = vhalves(g);
    s1 = vhalves(g + 2 * kHalfNR);
    if constexpr (Tr::kOffset) {
      o0 = vhalves(g + 2 * kNR);
      o1 = vhalves(g + 2 * kNR + 2 * kHalfNR);
    }
  } else {
    s0 = vload(g);
    s1 = vload(g + 4 * kHalfNR);
    if constexpr (Tr::kOffset) {
      o0 = vload(g + 4 * kNR);
      o1 = vload(g + 4 * kNR + 4 * kHalfNR);
    }
  }
  auto row = [&](int k, VB codes) {
    VF q0, q1;
    widen<!Tr::kNibbles>(codes, Tr::kNibbleBias, &q0, &q1);
    VF w0 = vmul(s0, q0), w1 = vmul(s1, q1);
    if constexpr (Tr::kOffset) {
      w0 = vadd(w0, o0);
      w1 = vadd(w1, o1);
    }
    f(k, w0, w1);
  };
  const uint8_t* c = g + kNR * Tr::kHeaderBytes;
  if constexpr (Tr::kNibbles) {
    for (int i = 0; i < Tr::kG / 2; ++i) {
      const VB b = bload(c + i * kNR);
      row(2 * i, low_nibbles(b));
      row(2 * i + 1, high_nibbles(b));
    }
  } else {
    for (int k = 0; k < Tr::kG; ++k) row(k, bload(c + k * kNR));
  }
}

template <GgufType T>
inline void dequant_group(const uint8_t* g, float* __restrict dst) {
  for_each_weight_row<T>(g, [&](int k, VF w0, VF w1) {
    vstore(dst + k * kNR, w0);
    vstore(dst + k * kNR + kHalfNR, w1);
  });
}

// Up to kMaxMR rows (one M tile: a decoding step of a few tokens): each weight vector dequantized
// in registers and used at once by every row, as the fp32 tile uses a loaded one. The same
// multiply-add on the same values in the same order as tile_f32 over dequant_group's panel
// (_mm*_fmadd_ps(x, w, acc) is at::vec::fmadd's instruction), without the round trip of the
// weights through L1, which at one row cost a third of the time.
template <GgufType T, int MR>
inline void codes_tile(const float* x, int64_t ldx, const uint8_t* panel, int64_t groups,
                       int64_t gbytes, float* out) {
  VF acc[MR][2];
  for (int m = 0; m < MR; ++m) acc[m][0] = acc[m][1] = vzero();
  for (int64_t g = 0; g < groups; ++g) {
    const float* xg = x + g * Traits<T>::kG;
    for_each_weight_row<T>(panel + g * gbytes, [&](int k, VF w0, VF w1) {
      for (int m = 0; m < MR; ++m) {
        const VF xv = vbroadcast(xg + m * ldx + k);
        acc[m][0] = vfmadd(xv, w0, acc[m][0]);
        acc[m][1] = vfmadd(xv, w1, acc[m][1]);
      }
    });
  }
  for (int m = 0; m < MR; ++m) {
    vstore(out + m * kNR, acc[m][0]);
    vstore(out + m * kNR + kHalfNR, acc[m][1]);
  }
}

constexpr bool kCodesTile = true;

template <GgufType T, int MR = kMaxMR>
inline void codes_tile_rows(int rows, const float* x, int64_t ldx, const uint8_t* panel,
                            int64_t groups, int64_t gbytes, float* out) {
  if constexpr (MR > 1) {
    if (rows < MR) return codes_tile_rows<T, MR - 1>(rows, x, ldx, panel, groups, gbytes, out);
  }
  codes_tile<T, MR>(x, ldx, panel, groups, gbytes, out);
}
#else
template <GgufType T>
inline void dequant_group(const uint8_t* g, float* __restrict dst) {
  dequant_group_scalar<T>(g, dst);
}

constexpr bool kCodesTile = false;

template <GgufType T>
inline void codes_tile_rows(int, const float*, int64_t, const uint8_t*, int64_t, int64_t, float*) {}
#endif

// ---- the driver ----------------------------------------------------------------------------------

// y[m0 + m, n0 + j] += the LoRA term of panel p (linear_gguf_cpu.h: GgufLora), rows m0 .. m0 + rows.
inline void add_lora(const GgufLora& lo, const LinearArgs& a, int64_t p, int rows, int64_t m0,
                     float* scratch) {
  const float* bp = lo.b_packed + p * lo.rank * kNR;
  tile_f32_rows<false>(rows, lo.t + m0 * lo.ldt, lo.ldt, bp, lo.rank, scratch);
  const int64_t n0 = p * kNR;
  const int cols = static_cast<int>(std::min<int64_t>(kNR, a.N - n0));
  float* y = static_cast<float*>(a.y);
  for (int m = 0; m < rows; ++m) {
    float* dst = y + (m0 + m) * a.ldy + n0;
    for (int j = 0; j < cols; ++j) dst[j] = dst[j] + scratch[m * kNR + j];
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
    at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
      alignas(64) float out[kMaxMR * kNR];
      for (int64_t p = p0; p < p1; ++p) {
        const uint8_t* panel = static_cast<const uint8_t*>(a.packed) + p * panel_bytes;
        const int rows = static_cast<int>(a.M);
        codes_tile_rows<T>(rows, x, a.ldx, panel, groups, gbytes, out);
        const int64_t n0 = p * kNR;
        write_tile<float>(out, rows, static_cast<int>(std::min<int64_t>(kNR, a.N - n0)), a, 0, n0);
        if (lo.t != nullptr) add_lora(lo, a, p, rows, 0, out);
      }
    });
    return;
  }
  at::parallel_for(0, panels, grain, [&](int64_t p0, int64_t p1) {
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
        if (lo.t != nullptr) add_lora(lo, a, p, rows, m0, buf);
      }
    }
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
  at::parallel_for(0, panels, 1, [&](int64_t p0, int64_t p1) {
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

}  // namespace jacobi::cpu::JACOBI_ISA

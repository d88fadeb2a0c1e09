// The small ops of a CPU decoding step (decode_cpu.h). Compiled once per vector ISA (isa.h).
//
// Attention: per (batch, kv head), the keys transposed in blocks of kKeyPad keys, Kt
// [W / kKeyPad][D][kKeyPad] (kept by the caller across steps, fp32 or with a half K/V cache
// fp16, or made here in fp32), so a row's
// scores over a vector of keys are one chain of D fused multiply-adds with q[d] broadcast: no
// horizontal sums, rows in groups of kRows share each Kt load, and a block's 4 KB (D = 64) are
// read in order (one stream, not D rows a page apart). The
// softmax runs over the whole row of scores at once (W is the cache length: thousands at most),
// then out = p V, one chain over the keys in slot order per output feature. Every row is
// computed alone in the same order whatever the others are, as decode_cpu.h promises.
#include "cpu/decode_cpu.h"
#include "cpu/team.h"

#include "jacobi/decode_step.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

namespace jacobi::cpu::JACOBI_ISA {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int kVL = Vec::size();
constexpr int kRows = kDecodeRows;  // query rows sharing each load of Kt / V (independent chains)
static_assert(kKeyPad % kVL == 0, "the key padding must hold whole vectors");
constexpr float kNegInf = -std::numeric_limits<float>::infinity();
// The tiles' row and vector loops unrolled in full, so that their accumulators stay in registers.
#define JACOBI_UNROLL _Pragma("GCC unroll 16")

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

// Rounds an fp32 value to T and back: the `round` of jacobi/decode_step.h's formulas.
template <typename T>
struct RoundTo {
  float operator()(float v) const { return static_cast<float>(static_cast<T>(v)); }
};

// dst[0, n) = src[0, n) in fp32.
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f(src[i]);
}

// n <= kVL keys or values from p as fp32 lanes (the rest 0): fp32 as they are, fp16 (the half
// K/V cache, DecodeAttnArgs::kv_half) widened exactly, a whole vector in one conversion.
inline Vec load_vec(const float* p, int64_t n) { return Vec::loadu(p, n); }
inline Vec load_vec(const c10::Half* p, int64_t n) {
#if defined(CPU_CAPABILITY_AVX512)
  if (n == kVL)
    return Vec(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(CPU_CAPABILITY_AVX2)
  if (n == kVL) return Vec(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
  alignas(64) float lanes[kVL] = {};
  for (int64_t i = 0; i < n; ++i) lanes[i] = static_cast<float>(p[i]);
  return Vec::loadu(lanes);
}

// The element the attention reads a cache of KV elements in, where it reads them in place (the
// caller's transposed keys, V): fp16 as stored (load_vec widens it), anything else fp32 (fp32
// itself; bf16 is widened into scratch first).
template <typename KV>
using ReadElement = std::conditional_t<std::is_same_v<KV, c10::Half>, c10::Half, float>;

// Where key vector v (keys [v kVL, v kVL + kVL)) of a group's keys starts in their transposed
// blocks, [W / kKeyPad][D][kKeyPad] (decode_cpu.h): feature d is kKeyPad elements further on.
template <typename E>
inline const E* key_vector(const E* kt, int64_t D, int64_t v) {
  return kt + kt_slot(v * kVL, D);
}

// Scores of R query rows (q: R x D fp32, pre-scaled) against key vectors [v, v + T) of a
// group's transposed keys kt: s[r][j] = sum_d q[r][d] * k[j][d], d in order. T key vectors side
// by side give R T independent chains (at one query row of a GQA group of 3, R = 3: one vector
// at a time left three chains waiting on the multiply-add's latency); each chain is the same
// whatever T is.
template <int R, int T, typename E>
inline void score_tile(const float* q, int64_t D, const E* kt, int64_t v, float* s,
                       int64_t lds) {
  const E* kv_at[T];
  Vec acc[R][T];
  JACOBI_UNROLL
  for (int t = 0; t < T; ++t) kv_at[t] = key_vector(kt, D, v + t);
  JACOBI_UNROLL
  for (int r = 0; r < R; ++r)
    JACOBI_UNROLL
    for (int t = 0; t < T; ++t) acc[r][t] = Vec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    Vec kv[T];
    JACOBI_UNROLL
    for (int t = 0; t < T; ++t) kv[t] = load_vec(kv_at[t] + d * kKeyPad, kVL);
    JACOBI_UNROLL
    for (int r = 0; r < R; ++r) {
      const Vec qv(q[r * D + d]);
      JACOBI_UNROLL
      for (int t = 0; t < T; ++t) acc[r][t] = at::vec::fmadd(qv, kv[t], acc[r][t]);
    }
  }
  JACOBI_UNROLL
  for (int r = 0; r < R; ++r)
    JACOBI_UNROLL
    for (int t = 0; t < T; ++t) acc[r][t].store(s + r * lds + (v + t) * kVL);
}

// Key (or feature) vectors per tile for R rows: R T chains, T loads and a broadcast within the
// vector registers: 16 on AVX2; 32 with AVX-512, where T = 4 covers a head of 64 features at
// once and 8 rows take 2 (at 16 query rows a step, p V ran ~11 loads per 8 multiply-adds at
// T = 1).
#if defined(CPU_CAPABILITY_AVX512)
template <int R>
constexpr int kScoreT = R <= 6 ? 4 : 2;
#else
template <int R>
constexpr int kScoreT = R == 1 ? 6 : R == 2 ? 4 : R == 3 ? 3 : R <= 5 ? 2 : 1;
#endif

// score_tile over key vectors [v0, v1) (of kVL keys each), T at a time, the rest one by one.
template <int R, typename E>
inline void score_range(const float* q, int64_t D, const E* kt, int64_t v0, int64_t v1,
                        float* s, int64_t lds) {
  constexpr int T = kScoreT<R>;
  int64_t v = v0;
  for (; v + T <= v1; v += T) score_tile<R, T>(q, D, kt, v, s, lds);
  for (; v < v1; ++v) score_tile<R, 1>(q, D, kt, v, s, lds);
}

template <typename E>
inline void scores(int rows, const float* q, int64_t D, const E* kt, int64_t v0, int64_t v1,
                   float* s, int64_t lds) {
  switch (rows) {
    case 8: return score_range<8>(q, D, kt, v0, v1, s, lds);
    case 7: return score_range<7>(q, D, kt, v0, v1, s, lds);
    case 6: return score_range<6>(q, D, kt, v0, v1, s, lds);
    case 5: return score_range<5>(q, D, kt, v0, v1, s, lds);
    case 4: return score_range<4>(q, D, kt, v0, v1, s, lds);
    case 3: return score_range<3>(q, D, kt, v0, v1, s, lds);
    case 2: return score_range<2>(q, D, kt, v0, v1, s, lds);
    default: return score_range<1>(q, D, kt, v0, v1, s, lds);
  }
}

// The slot of the o-th of W slots in position order (DecodeAttnArgs::first): [first, W), then
// [0, first). The one statement of that order, for the softmax sum and p V.
inline int64_t slot_by_position(int64_t o, int64_t W, int64_t first) {
  return o < W - first ? first + o : o - (W - first);
}

// out[r][d0, d0 + T kVL) = sum_j p[r][j] * V[j][same] (rows of V ldv apart), j over the slots of
// positions [o0, o1) in position order (VisibleRange), only where p > 0 (masked slots are 0, and
// their V may hold anything). The probabilities come transposed, pt[j][r] (kRows apart): one
// compare tells whether every row sees slot j (the common case: the multiply-adds run
// unconditionally), else each row is asked on its own. T feature vectors side by side for more
// independent chains, as score_tile; n < kVL: one partial vector (T = 1).
template <int R, int T, typename E>
inline void pv_tile(const float* pt, const E* v, int64_t ldv, int64_t W, int64_t first,
                    int64_t o0, int64_t o1, int64_t D, int64_t d0, int64_t n, float* out) {
  constexpr int kAll = (1 << R) - 1;
  Vec acc[R][T];
  JACOBI_UNROLL
  for (int r = 0; r < R; ++r)
    JACOBI_UNROLL
    for (int t = 0; t < T; ++t) acc[r][t] = Vec(0.f);
  for (int64_t o = o0; o < o1; ++o) {
    const int64_t j = slot_by_position(o, W, first);
    Vec vv[T];
    JACOBI_UNROLL
    for (int t = 0; t < T; ++t) vv[t] = load_vec(v + j * ldv + d0 + t * kVL, T == 1 ? n : kVL);
    const float* pj = pt + j * kRows;
    const bool every = (Vec::loadu(pj, kRows).zero_mask() & kAll) == 0;
    JACOBI_UNROLL
    for (int r = 0; r < R; ++r) {
      if (every || pj[r] != 0.f) {
        const Vec pv(pj[r]);
        JACOBI_UNROLL
        for (int t = 0; t < T; ++t) acc[r][t] = at::vec::fmadd(pv, vv[t], acc[r][t]);
      }
    }
  }
  JACOBI_UNROLL
  for (int r = 0; r < R; ++r)
    JACOBI_UNROLL
    for (int t = 0; t < T; ++t) acc[r][t].store(out + r * D + d0 + t * kVL, T == 1 ? n : kVL);
}

template <int R, typename E>
inline void pv_range(const float* pt, const E* v, int64_t ldv, int64_t W, int64_t first,
                     int64_t o0, int64_t o1, int64_t D, int64_t d0, int64_t d1, float* out) {
  constexpr int T = kScoreT<R>;
  int64_t d = d0;
  for (; d + T * kVL <= d1; d += T * kVL) {
    pv_tile<R, T>(pt, v, ldv, W, first, o0, o1, D, d, kVL, out);
  }
  for (; d < d1; d += kVL) {
    pv_tile<R, 1>(pt, v, ldv, W, first, o0, o1, D, d, std::min<int64_t>(kVL, d1 - d), out);
  }
}

// out rows = p V over features [d0, d1), from the probabilities transposed (pt[j][r]).
template <typename E>
inline void pv(int rows, const float* pt, const E* v, int64_t ldv, int64_t W, int64_t first,
               int64_t o0, int64_t o1, int64_t D, int64_t d0, int64_t d1, float* out) {
  switch (rows) {
    case 8: return pv_range<8>(pt, v, ldv, W, first, o0, o1, D, d0, d1, out);
    case 7: return pv_range<7>(pt, v, ldv, W, first, o0, o1, D, d0, d1, out);
    case 6: return pv_range<6>(pt, v, ldv, W, first, o0, o1, D, d0, d1, out);
    case 5: return pv_range<5>(pt, v, ldv, W, first, o0, o1, D, d0, d1, out);
    case 4: return pv_range<4>(pt, v, ldv, W, first, o0, o1, D, d0, d1, out);
    case 3: return pv_range<3>(pt, v, ldv, W, first, o0, o1, D, d0, d1, out);
    case 2: return pv_range<2>(pt, v, ldv, W, first, o0, o1, D, d0, d1, out);
    default: return pv_range<1>(pt, v, ldv, W, first, o0, o1, D, d0, d1, out);
  }
}

// sr[j] = -inf where !m[j], over [lo, hi); returns the largest sr[j] there, NaNs skipped, -inf
// where there is none: what `mx = std::max(mx, sr[j])` from -inf gives in order (a NaN never
// compares greater), with lanes side by side. A maximum of floats is exact in any order, but for
// the sign of a zero maximum, which exp(s - mx) does not see (x - (+0) and x - (-0) are the same
// x, exp(+-0) = 1). The scalar loop waited on each max (~3 cycles a key) and branched on each
// mask byte.
inline float mask_and_max(float* sr, const bool* m, int64_t lo, int64_t hi) {
  float mx = kNegInf;
  int64_t j = lo;
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 ninf = _mm512_set1_ps(kNegInf);
  __m512 acc = ninf;
  for (; j + 16 <= hi; j += 16) {
    const __m128i mb = _mm_loadu_si128(reinterpret_cast<const __m128i*>(m + j));
    const __mmask16 hidden = _mm_cmpeq_epi8_mask(mb, _mm_setzero_si128());
    const __m512 v = _mm512_mask_mov_ps(_mm512_loadu_ps(sr + j), hidden, ninf);
    _mm512_storeu_ps(sr + j, v);
    acc = _mm512_max_ps(v, acc);  // a NaN in v: acc kept
  }
  mx = _mm512_reduce_max_ps(acc);  // (acc holds no NaN)
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  __m256 acc = ninf;
  for (; j + 8 <= hi; j += 8) {
    const __m128i mb = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(m + j));
    const __m256i hidden = _mm256_cmpeq_epi32(_mm256_cvtepu8_epi32(mb), _mm256_setzero_si256());
    const __m256 v = _mm256_blendv_ps(_mm256_loadu_ps(sr + j), ninf, _mm256_castsi256_ps(hidden));
    _mm256_storeu_ps(sr + j, v);
    acc = _mm256_max_ps(v, acc);  // a NaN in v: acc kept
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  for (const float x : lanes) mx = std::max(mx, x);  // (acc holds no NaN)
#endif
  for (; j < hi; ++j) {
    if (!m[j]) sr[j] = kNegInf;
    mx = std::max(mx, sr[j]);
  }
  return mx;
}

// A row of scores over slots [lo, hi) (masks m) -> exp(score - the row's max) in place, masked
// slots exactly 0 (slots outside [lo, hi) neither read nor written). Returns false (and zeros)
// where the row sees no slot.
inline bool exp_row(float* sr, const bool* m, int64_t lo, int64_t hi) {
  const float mx = mask_and_max(sr, m, lo, hi);
  if (mx == kNegInf) {
    std::fill(sr + lo, sr + std::max(lo, hi), 0.f);
    return false;
  }
  const Vec vmx(mx);
  for (int64_t j = lo; j < hi; j += kVL) {
    const int c = static_cast<int>(std::min<int64_t>(kVL, hi - j));
    (Vec::loadu(sr + j, c) - vmx).exp_u20().store(sr + j, c);
  }
  return true;
}

// The softmax of `rows` rows whose exp_row values come transposed, pt[j][r] (kRows apart, lanes
// past `rows` and rows that see no slot 0): each row's sum in position order, one chain per row
// (kRows chains side by side, one lane each: the same bits as a row summed alone, wherever the
// cache keeps its keys), then every value times 1 / sum (0 for a row that sees no slot); the sum
// over the positions [o0, o1), the products over the slots [s0, s1) of a VisibleRange.
inline void normalize_rows(float* pt, int64_t W, int64_t first, int64_t o0, int64_t o1,
                           int64_t s0, int64_t s1, const bool* any, int rows) {
  float sum[kRows] = {};
  for (int64_t o = o0; o < o1; ++o) {
    const float* pj = pt + slot_by_position(o, W, first) * kRows;
    for (int r = 0; r < kRows; ++r) sum[r] += pj[r];
  }
  float inv[kRows] = {};
  for (int r = 0; r < rows; ++r) inv[r] = any[r] ? 1.f / sum[r] : 0.f;
  for (int64_t j = s0; j < s1; ++j)
    for (int r = 0; r < kRows; ++r) pt[j * kRows + r] *= inv[r];
}

// What a chunk of query rows may see: positions [o0, o1) (slot_by_position's order), outside
// which every row's mask is false (a prefill's causal rows see a prefix of the prompt), and the
// slots [s0, s1) that hold them. Scores, softmax and p V skip the rest: the same bits, as a
// position no row sees adds an exact 0 to every sum (p V skips zero probabilities anyway).
struct VisibleRange {
  int64_t o0, o1, s0, s1;
};

// The VisibleRange of rows r0 .. r0 + rows of a group of batch b (row r: position (r0 + r) % Q,
// its mask row mask + (b Q + position) W): from the first to the last position any row sees.
inline VisibleRange visible_range(const bool* mask, int64_t b, int64_t Q, int64_t W,
                                  int64_t first, int64_t r0, int rows) {
  int64_t o0 = W, o1 = 0;
  for (int r = 0; r < rows; ++r) {
    const bool* m = mask + (b * Q + (r0 + r) % Q) * W;
    int64_t o = 0;
    while (o < o0 && !m[slot_by_position(o, W, first)]) ++o;
    o0 = o;
    for (o = W; o > o1 && !m[slot_by_position(o - 1, W, first)];) --o;
    o1 = o;
  }
  if (o0 >= o1) return {0, 0, 0, 0};
  const int64_t ctx = W - first;  // positions [0, ctx): slots first + o; then slot o - ctx
  if (o1 <= ctx) return {o0, o1, first + o0, first + o1};
  if (o0 >= ctx) return {o0, o1, o0 - ctx, o1 - ctx};
  return {o0, o1, 0, W};
}

// The attention of DecodeAttnArgs, with each query row given by load_q(b, h, i, dst): dst[0, D)
// = the row in fp32 (before the scale).
//
// Two schedules, the same arithmetic on every row (each score one chain over d, the softmax of
// softmax_row, each output one chain over the slots in position order: DecodeAttnArgs::first), so
// a row's result does not depend on which one ran, on the other rows, or on where its keys sit:
//  - many query rows (a wide step, a batch): one unit of work per (batch, kv head, kRows rows),
//    scores, softmax and p V together;
//  - few (a one- or few-token step: at one token 3 units of a GQA model for 2 threads, each
//    waiting on its own chains): the queries loaded once, scores per (batch, kv head, range of
//    keys) into shared rows, then softmax and p V per (batch, kv head, chunk of rows).
//
// T: the dtype of q and out; KV: the cache's element type, T or (T = fp32) fp16 (kv_half).
template <typename T, typename KV, typename LoadQ>
void attention(const DecodeAttnArgs& a, const LoadQ& load_q) {
  static_assert(std::is_same_v<KV, T> ||
                    (std::is_same_v<KV, c10::Half> && std::is_same_v<T, float>),
                "a half K/V cache goes with fp32 queries only");
  const int64_t G = a.Hq / a.Hkv, D = a.D, W = a.W, Q = a.Q;
  const int64_t ldk = (W + kKeyPad - 1) / kKeyPad * kKeyPad;  // a multiple of kVL too
  const int64_t rows_per_group = G * Q;  // the query rows that read one kv head
  const int64_t chunks = (rows_per_group + kRows - 1) / kRows;
  const KV* kp = static_cast<const KV*>(a.k);
  const KV* vp = static_cast<const KV*>(a.v);
  T* outp = static_cast<T*>(a.out);
  // Pass 1: the keys transposed in blocks, [ldk / kKeyPad][D][kKeyPad] fp32 per (b, kv head),
  // by 16 x 16 register transposes (unless the caller keeps them); V read in place when fp32 or
  // fp16 (rows sv_w apart; load_vec widens fp16), else (bf16) widened to fp32 [W, D].
  const int64_t groups = a.B * a.Hkv;
  constexpr bool kF32 = std::is_same_v<KV, float>;
  constexpr bool kInPlace = kF32 || std::is_same_v<KV, c10::Half>;  // V read where it is
  using E = ReadElement<KV>;  // the element of V as p V reads it, and of the caller's Kt
  static_assert(kKeyPad == 16, "a key block is one 16 x 16 transpose wide");
  float* kt_all = a.scratch;
  float* v_all = kt_all + groups * D * ldk;
  // per thread: scores kRows x ldk, q kRows x D, out kRows x D, probabilities ldk x kRows
  float* tmp_all = v_all + groups * W * D;
  const int64_t tmp_per_thread = 2 * kRows * ldk + 2 * kRows * D;
  float* shared_s = tmp_all + at::get_num_threads() * tmp_per_thread;  // few rows: all scores
  const int64_t ldv = kInPlace ? a.sv_w : D;
  auto v_rows = [&](int64_t g) -> const E* {
    if constexpr (kInPlace) {
      return vp + (g / a.Hkv) * a.sv_b + (g % a.Hkv) * a.sv_h;
    } else {
      return v_all + g * W * D;
    }
  };
  const int64_t grain1 = std::max<int64_t>(1, 16384 / std::max<int64_t>(W * D, 1));
  // The caller keeps Kt: nothing to transpose, and with V read in place no pass at all; with
  // bf16 V the pass only widens V.
  const bool kept = a.kt != nullptr;
  if (!(kept && kInPlace)) cpu::parallel_for(0, groups, grain1, [&](int64_t g0, int64_t g1) {
    alignas(64) float blk[16 * 16];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g / a.Hkv, h = g % a.Hkv;
      float* kt = kt_all + g * D * ldk;
      const KV* kb = kp + b * a.sk_b + h * a.sk_h;
      for (int64_t j0 = 0; !kept && j0 < W; j0 += kKeyPad) {
        const int jn = static_cast<int>(std::min<int64_t>(kKeyPad, W - j0));
        float* block = kt + j0 * D;  // block j0 / kKeyPad: [D][kKeyPad]
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
          const int dn = static_cast<int>(std::min<int64_t>(16, D - d0));
          if constexpr (kF32) {
            at::vec::transpose_mxn<float>(kb + j0 * a.sk_w + d0, a.sk_w, block + d0 * kKeyPad,
                                          kKeyPad, jn, dn);
          } else {
            for (int j = 0; j < jn; ++j) load_row(kb + (j0 + j) * a.sk_w + d0, blk + j * 16, dn);
            at::vec::transpose_mxn<float>(blk, 16, block + d0 * kKeyPad, kKeyPad, jn, dn);
          }
        }
        for (int64_t d = 0; d < D; ++d)  // the last block's padding keys: 0
          for (int j = jn; j < kKeyPad; ++j) block[d * kKeyPad + j] = 0.f;
      }
      if constexpr (!kInPlace) {
        float* vf = v_all + g * W * D;
        for (int64_t j = 0; j < W; ++j)
          load_row(vp + b * a.sv_b + h * a.sv_h + j * a.sv_w, vf + j * D, D);
      }
    }
  });
  // Scores of `rows` rows (q: rows x D) over key vectors [v0, v1) of group g, from the caller's
  // Kt (fp32, or fp16 with a half cache) or the one made above (fp32): the same values.
  const E* kt_kept = static_cast<const E*>(a.kt);
  auto group_scores = [&](int rows, const float* q, int64_t g, int64_t v0, int64_t v1, float* s) {
    if (kept) return scores(rows, q, D, kt_kept + g * D * a.ldkt, v0, v1, s, ldk);
    scores(rows, q, D, kt_all + g * D * ldk, v0, v1, s, ldk);
  };
  // Query rows r0 .. r0 + rows of group g (row r: head hk G + r / Q, position r % Q), scaled.
  auto load_rows = [&](int64_t g, int64_t r0, int rows, float* qf) {
    const int64_t b = g / a.Hkv, hk = g % a.Hkv;
    for (int r = 0; r < rows; ++r) {
      const int64_t h = hk * G + (r0 + r) / Q, i = (r0 + r) % Q;
      load_q(b, h, i, qf + r * D);
      for (int64_t d = 0; d < D; ++d) qf[r * D + d] *= a.scale;
    }
  };
  // Softmax of rows r0 .. r0 + rows of group g, their scores in s (rows ldk apart, clobbered),
  // into pt transposed (pt[j][r], kRows apart) for pv.
  // (over the VisibleRange vr: the slots outside it are neither read nor written)
  auto softmax_rows = [&](int64_t g, int64_t r0, int rows, const VisibleRange& vr, float* s,
                          bool* any, float* pt) {
    const int64_t b = g / a.Hkv;
    for (int r = 0; r < rows; ++r) {
      const int64_t i = (r0 + r) % Q;
      any[r] = exp_row(s + r * ldk, a.mask + (b * Q + i) * W, vr.s0, vr.s1);
    }
    // Lanes past `rows` zeroed in one pass (a fill per key compiled to a memset call per key).
    if (rows < kRows) std::fill(pt + vr.s0 * kRows, pt + vr.s1 * kRows, 0.f);
    for (int r = 0; r < rows; ++r)
      for (int64_t j = vr.s0; j < vr.s1; ++j) pt[j * kRows + r] = s[r * ldk + j];
    normalize_rows(pt, W, a.first, vr.o0, vr.o1, vr.s0, vr.s1, any, rows);
  };
  // Output features [d0, d1) of rows r0 .. r0 + rows of group g from of (rows D apart).
  auto store_rows = [&](int64_t g, int64_t r0, int rows, const float* of, const bool* any,
                        int64_t d0, int64_t d1) {
    const int64_t b = g / a.Hkv, hk = g % a.Hkv;
    for (int r = 0; r < rows; ++r) {
      const int64_t h = hk * G + (r0 + r) / Q, i = (r0 + r) % Q;
      T* o = outp + ((b * Q + i) * a.Hq + h) * D;
      for (int64_t d = d0; d < d1; ++d) o[d] = static_cast<T>(any[r] ? of[r * D + d] : 0.f);
    }
  };
  const int64_t threads = at::get_num_threads();
  const int64_t key_vectors = ldk / kVL;
  if (decode_attention_few_rows(a.B, a.Hkv, a.Hq, Q, threads)) {
    const VisibleRange all{0, W, 0, W};  // (a step's few rows see the whole context)
    // Every query row loaded (rotated, scaled) once, on this thread: a few dozen rows.
    float* shared_q = shared_s + groups * rows_per_group * ldk;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t r0 = 0; r0 < rows_per_group; r0 += kRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kRows, rows_per_group - r0));
        load_rows(g, r0, rows, shared_q + (g * rows_per_group + r0) * D);
      }
    }
    // Scores: per (group, range of key vectors), every row of the group.
    const int64_t kv_per_unit = std::max<int64_t>(1, 64 / kVL);
    const int64_t ranges = (key_vectors + kv_per_unit - 1) / kv_per_unit;
    cpu::parallel_for(0, groups * ranges, 1, [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t g = u / ranges, v0 = (u % ranges) * kv_per_unit;
        const int64_t v1 = std::min(key_vectors, v0 + kv_per_unit);
        for (int64_t r0 = 0; r0 < rows_per_group; r0 += kRows) {
          const int rows = static_cast<int>(std::min<int64_t>(kRows, rows_per_group - r0));
          const int64_t at = g * rows_per_group + r0;
          group_scores(rows, shared_q + at * D, g, v0, v1, shared_s + at * ldk);
        }
      }
    });
    // Softmax and p V: per (group, chunk of rows), each row's softmax once; chunks small enough
    // for ~4 units a thread, but of at least one position's rows of the group (its G query heads,
    // up to kRows): a chunk's softmax zeroes, sums and scales all kRows lanes of its transposed
    // probabilities over every slot whatever its rows, so at one token of a GQA group of 3 (3 kv
    // heads, 2 threads) 9 chunks of one row took ~2.5 % of an 8-bit step more than 3 of three
    // (2-core EPYC, 2026-12-05), though one thread then gets two chunks and the other one.
    const int64_t per_group = std::max<int64_t>(1, (4 * threads + groups - 1) / groups);
    const int64_t rchunk = std::min<int64_t>(
        kRows, std::max<int64_t>(G, (rows_per_group + per_group - 1) / per_group));
    const int64_t rchunks = (rows_per_group + rchunk - 1) / rchunk;
    cpu::parallel_for(0, groups * rchunks, 1, [&](int64_t u0, int64_t u1) {
      float* of = tmp_all + at::get_thread_num() * tmp_per_thread + kRows * ldk + kRows * D;
      float* pt = of + kRows * D;
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t g = u / rchunks, r0 = (u % rchunks) * rchunk;
        const int rows = static_cast<int>(std::min<int64_t>(rchunk, rows_per_group - r0));
        bool any[kRows];
        softmax_rows(g, r0, rows, all, shared_s + (g * rows_per_group + r0) * ldk, any, pt);
        pv(rows, pt, v_rows(g), ldv, W, a.first, 0, W, D, 0, D, of);
        store_rows(g, r0, rows, of, any, 0, D);
      }
    });
    return;
  }
  // Pass 2: per (b, kv head, chunk of kRows query rows), each chunk over what its rows may see
  // (VisibleRange: a prefill's causal chunks see the prompt up to their last position, half the
  // keys on average). A group's chunks are dealt from both ends in turn (its k-th unit: chunk
  // k / 2, or the (k / 2)-th from the end), so that a thread's contiguous share of the units is
  // about as much work as another's where later chunks see more.
  const int64_t work = groups * chunks;
  const int64_t grain2 = std::max<int64_t>(1, 32768 / std::max<int64_t>(kRows * W * D, 1));
  cpu::parallel_for(0, work, grain2, [&](int64_t w0, int64_t w1) {
    float* tmp = tmp_all + at::get_thread_num() * tmp_per_thread;
    float* s = tmp;                      // kRows x ldk
    float* qf = s + kRows * ldk;         // kRows x D
    float* of = qf + kRows * D;          // kRows x D
    float* pt = of + kRows * D;          // ldk x kRows
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t g = w / chunks, k = w % chunks;
      const int64_t r0 = (k % 2 == 0 ? k / 2 : chunks - 1 - k / 2) * kRows;
      const int rows = static_cast<int>(std::min<int64_t>(kRows, rows_per_group - r0));
      const VisibleRange vr = visible_range(a.mask, g / a.Hkv, Q, W, a.first, r0, rows);
      load_rows(g, r0, rows, qf);
      group_scores(rows, qf, g, vr.s0 / kVL, (vr.s1 + kVL - 1) / kVL, s);
      bool any[kRows];
      softmax_rows(g, r0, rows, vr, s, any, pt);
      pv(rows, pt, v_rows(g), ldv, W, a.first, vr.o0, vr.o1, D, 0, D, of);
      store_rows(g, r0, rows, of, any, 0, D);
    }
  });
}

// transformers' apply_rotary_pos_emb on one row: dst = x * cos + rotate_half(x) * sin, every
// product and the sum rounded to T (this file is compiled with -ffp-contract=off: no fusing).
template <typename T>
inline void rotate_row(const T* x, const T* cos, const T* sin, int64_t D, T* dst) {
  const int64_t half = D / 2;
  // The two halves apart (rotate_half: -x[d + half], then x[d - half]): loops without a branch,
  // which the compiler vectorises; the same roundings per element.
  // (jacobi/decode_step.h: rope_element, the CUDA kernel's formula too)
  const RoundTo<T> round;
  for (int64_t d = 0; d < half; ++d)
    dst[d] = static_cast<T>(
        decode::rope_element(to_f(x[d]), to_f(x[d + half]), true, to_f(cos[d]), to_f(sin[d]),
                             round));
  for (int64_t d = half; d < D; ++d)
    dst[d] = static_cast<T>(
        decode::rope_element(to_f(x[d]), to_f(x[d - half]), false, to_f(cos[d]), to_f(sin[d]),
                             round));
}

// T: the dtype of qkv, cos, sin and out; KV: the cache's element type, T or (T = fp32) fp16.
template <typename T, typename KV>
void rope_attn(const RopeAttnArgs& a) {
  const int64_t D = a.D, Q = a.Q, row = (a.Hq + 2 * a.Hkv) * D;
  const T* qkv = static_cast<const T*>(a.qkv);
  const T* cs = static_cast<const T*>(a.cos);
  const T* sn = static_cast<const T*>(a.sin);
  KV* kc = static_cast<KV*>(a.k_cache);
  KV* vc = static_cast<KV*>(a.v_cache);
  using KtE = ReadElement<KV>;  // the transposed keys' element
  KtE* ktc = static_cast<KtE*>(a.kt_cache);
  // k rotated and v copied into the cache (small: Q rows of Hkv heads); a half cache rounds the
  // rotated k (in T, as transformers rotates) and v to fp16 there.
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t i = 0; i < Q; ++i) {
      const T* src = qkv + (b * Q + i) * row;
      const T* c = cs + (b * Q + i) * D;
      const T* sv = sn + (b * Q + i) * D;
      for (int64_t h = 0; h < a.Hkv; ++h) {
        const int64_t at = ((b * a.Hkv + h) * a.capacity + a.slots[i]) * D;
        const T* vsrc = src + (a.Hq + a.Hkv + h) * D;
        if constexpr (std::is_same_v<KV, T>) {
          rotate_row(src + (a.Hq + h) * D, c, sv, D, kc + at);
          std::copy(vsrc, vsrc + D, vc + at);
        } else {
          T rot[512];  // head dims up to 512 (the op checks)
          rotate_row(src + (a.Hq + h) * D, c, sv, D, rot);
          for (int64_t d = 0; d < D; ++d) kc[at + d] = static_cast<KV>(to_f(rot[d]));
          for (int64_t d = 0; d < D; ++d) vc[at + d] = static_cast<KV>(to_f(vsrc[d]));
        }
        if (ktc != nullptr) {  // the same key in the transposed blocks
          KtE* col = ktc + (b * a.Hkv + h) * D * a.kt_ld + kt_slot(a.slots[i], D);
          for (int64_t d = 0; d < D; ++d) col[d * kKeyPad] = static_cast<KtE>(to_f(kc[at + d]));
        }
      }
    }
  const int64_t cache_h = a.capacity * D, cache_b = a.Hkv * cache_h;
  DecodeAttnArgs d{a.dtype, a.B, a.Hq, a.Hkv, Q, a.W, D,
                   nullptr, 0, 0, 0,
                   kc, cache_b, cache_h, D,
                   vc, cache_b, cache_h, D,
                   a.mask, a.scale, a.out, a.scratch, a.kt_cache, a.kt_ld, a.first,
                   a.kv_half};
  attention<T, KV>(d, [&](int64_t b, int64_t h, int64_t i, float* dst) {
    T rot[512];  // head dims up to 512 (the op checks)
    rotate_row(qkv + (b * Q + i) * row + h * D, cs + (b * Q + i) * D, sn + (b * Q + i) * D, D,
               rot);
    for (int64_t k = 0; k < D; ++k) dst[k] = to_f(rot[k]);
  });
}

// A row's sum of squares in double (the mean of squares, order-robust): each square exact (a
// float times itself fits a double), summed in kSquareLanes chains side by side (element i in
// chain i % kSquareLanes), then the chains pairwise in a fixed order. One chain ran a latency-bound
// add per element (~0.7 us a 576-wide row, 61 rows a one-token forward, on the calling thread).
// The order depends on n alone: a row gives the same bits in any call.
constexpr int kSquareLanes = 8;
static_assert(kSquareLanes == 8, "sum_of_squares adds its 8 chains by hand");
template <typename T>
inline double sum_of_squares(const T* v, int64_t n) {
  double acc[kSquareLanes] = {};
  int64_t i = 0;
  for (; i + kSquareLanes <= n; i += kSquareLanes) {
    for (int l = 0; l < kSquareLanes; ++l) {
      const double x = to_f(v[i + l]);
      acc[l] += x * x;
    }
  }
  for (int l = 0; i < n; ++i, ++l) {
    const double x = to_f(v[i]);
    acc[l] += x * x;
  }
  return ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
}

// Values a thread takes at least in the row-wise ops (RMSNorm, SiLU * up): the rows of a step of
// 8-16 tokens split among the threads, where they ran one after another on the calling thread
// while the others waited; one token's row stays there. Each row alone: the same bits at any
// split.
constexpr int64_t kRowOpGrain = 4096;

template <typename T>
void rms(const RmsNormArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* res = static_cast<const T*>(a.residual);
  const T* w = static_cast<const T*>(a.weight);
  T* hout = static_cast<T*>(a.h);
  T* y = static_cast<T*>(a.y);
  const int64_t n = a.n;
  const RoundTo<T> round;  // (the formulas: jacobi/decode_step.h, the CUDA kernel's too)
  cpu::parallel_for(0, a.rows, std::max<int64_t>(1, kRowOpGrain / std::max<int64_t>(n, 1)),
                   [&](int64_t r0, int64_t r1) {
                     std::vector<T> hbuf(hout == nullptr && res != nullptr ? n : 0);
                     for (int64_t r = r0; r < r1; ++r) {
                       const T* xr = x + r * n;
                       const T* hr = xr;
                       if (res != nullptr) {  // h = residual + x, rounded to T
                         T* hw = hout != nullptr ? hout + r * n : hbuf.data();
                         const T* rr = res + r * n;
                         for (int64_t i = 0; i < n; ++i)
                           hw[i] = static_cast<T>(
                               decode::residual_add(to_f(rr[i]), to_f(xr[i]), round));
                         hr = hw;
                       } else if (hout != nullptr) {
                         std::copy(xr, xr + n, hout + r * n);
                       }
                       T* yr = y + r * n;
                       const float inv =
                           decode::rms_inverse(sum_of_squares(hr, n), n, a.eps);
                       for (int64_t i = 0; i < n; ++i)
                         yr[i] = static_cast<T>(
                             decode::rms_output(to_f(hr[i]), inv, to_f(w[i]), round));
                     }
                   });
}

template <typename T>
void qk_rms(const QkRmsNormArgs& a) {
  T* qkv = static_cast<T*>(a.qkv);
  const T* wq = static_cast<const T*>(a.q_weight);
  const T* wk = static_cast<const T*>(a.k_weight);
  const int64_t D = a.D, per_token = a.heads + a.kv_heads, rows = a.tokens * per_token;
  const RoundTo<T> round;  // rms's formula, row by row (each head a row of D)
  cpu::parallel_for(0, rows, std::max<int64_t>(1, kRowOpGrain / std::max<int64_t>(D, 1)),
                   [&](int64_t r0, int64_t r1) {
                     for (int64_t r = r0; r < r1; ++r) {
                       const int64_t t = r / per_token, h = r % per_token;
                       T* x = qkv + t * a.row + h * D;
                       const T* w = h < a.heads ? wq : wk;
                       const float inv = decode::rms_inverse(sum_of_squares(x, D), D, a.eps);
                       for (int64_t i = 0; i < D; ++i)
                         x[i] = static_cast<T>(
                             decode::rms_output(to_f(x[i]), inv, to_f(w[i]), round));
                     }
                   });
}

template <typename T>
void silu_mul_impl(const SiluMulArgs& a) {
  const T* gu = static_cast<const T*>(a.gu);
  T* out = static_cast<T*>(a.out);
  const int64_t n = a.n;
  cpu::parallel_for(0, a.rows, std::max<int64_t>(1, kRowOpGrain / std::max<int64_t>(n, 1)),
                   [&](int64_t r0, int64_t r1) {
                     std::vector<float> act(n);
                     const Vec one(1.f);
                     for (int64_t r = r0; r < r1; ++r) {
                       const T* g = gu + r * 2 * n;
                       const T* u = g + n;
                       T* o = out + r * n;
                       load_row(g, act.data(), n);
                       for (int64_t i = 0; i < n; i += kVL) {
                         const int64_t c = std::min<int64_t>(kVL, n - i);
                         const Vec gv = Vec::loadu(act.data() + i, c);
                         (gv / (one + gv.neg().exp_u20())).store(act.data() + i, c);
                       }
                       for (int64_t i = 0; i < n; ++i)  // silu rounded to T, then times up
                         o[i] = static_cast<T>(
                             decode::silu_times_up(act[i], to_f(u[i]), RoundTo<T>{}));
                     }
                   });
}

// The first NaN of x[0, n), else the first of its maxima (torch's max(-1).indices). Two vector
// passes over the row: the largest value and whether any is NaN (lanes of a > m ? a : m, which no
// NaN enters), then the first index equal to it (== holds for -0 and +0 alike, as ties under > do).
// Through the op, a 49152-wide row on an AVX-512 EPYC took ~28 us in the scalar chunk walk this
// replaced (a compare and a branch per value), ~9 us here.
inline int64_t argmax_row(const float* x, int64_t n) {
  using V = at::vec::Vectorized<float>;
  constexpr int64_t W = V::size();
  constexpr int kAcc = 4;  // independent lanes of maxima: the compare-select latency hidden
  const int64_t nv = n / (W * kAcc) * (W * kAcc);
  float top = -std::numeric_limits<float>::infinity();
  bool nan = false;
  if (nv > 0) {
    V m[kAcc], bad[kAcc];
    for (int j = 0; j < kAcc; ++j) {
      m[j] = V(-std::numeric_limits<float>::infinity());
      bad[j] = V(0.f);
    }
    for (int64_t i = 0; i < nv; i += W * kAcc) {
      for (int j = 0; j < kAcc; ++j) {
        const V v = V::loadu(x + i + j * W);
        m[j] = V::blendv(m[j], v, v > m[j]);
        bad[j] = bad[j] | (v != v);
      }
    }
    for (int j = 1; j < kAcc; ++j) {
      m[0] = V::blendv(m[0], m[j], m[j] > m[0]);
      bad[0] = bad[0] | bad[j];
    }
    nan = bad[0].zero_mask() != (1 << W) - 1;
    alignas(64) float lanes[W];
    m[0].store(lanes);
    for (int64_t j = 0; j < W; ++j) top = lanes[j] > top ? lanes[j] : top;
  }
  for (int64_t i = nv; i < n; ++i) {
    nan = nan || x[i] != x[i];
    top = x[i] > top ? x[i] : top;
  }
  if (nan) {
    for (int64_t i = 0;; ++i)
      if (x[i] != x[i]) return i;
  }
  const V t(top);
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const int eq = ~(V::loadu(x + i) == t).zero_mask() & ((1 << W) - 1);  // lanes equal to top
    if (eq != 0) return i + __builtin_ctz(static_cast<unsigned>(eq));
  }
  for (; i < n; ++i)
    if (x[i] == top) return i;
  return 0;  // not reached: top is one of the values
}

// One row of greedy_candidates. Two passes over the vocabulary (a and E recomputed, the same
// operations both times): the largest lower bound, then the columns whose upper bound reaches it.
// A lane is non-finite where v - v is not 0 (inf - inf and NaN are NaN).
inline int64_t candidates_row(const float* y0, const float* y1, int64_t V, const float* w1,
                              float e, float t, int64_t cap, int32_t* cand) {
  using Vf = at::vec::Vectorized<float>;
  constexpr int64_t W = Vf::size();
  const int64_t nv = V / W * W;
  const Vf ve(e), vt(t), zero(0.f);
  float lo = -std::numeric_limits<float>::infinity();
  bool bad = false;
  {
    Vf m(-std::numeric_limits<float>::infinity()), nonfinite(0.f);
    for (int64_t j = 0; j < nv; j += W) {
      const Vf a = Vf::loadu(y0 + j) + Vf::loadu(y1 + j);
      const Vf E = Vf::loadu(w1 + j) * ve + vt;
      const Vf l = a - E, h = a + E;
      m = at::vec::maximum(m, l);
      nonfinite = nonfinite | ((l - l) != zero) | ((h - h) != zero);
    }
    bad = nonfinite.zero_mask() != (1 << W) - 1;
    alignas(64) float lanes[W];
    m.store(lanes);
    for (int64_t i = 0; i < W; ++i) lo = std::max(lo, lanes[i]);
  }
  for (int64_t j = nv; j < V; ++j) {
    const float a = y0[j] + y1[j], E = w1[j] * e + t;
    const float l = a - E, h = a + E;
    bad = bad || !std::isfinite(l) || !std::isfinite(h);
    lo = std::max(lo, l);
  }
  if (bad) return -1;
  int64_t n = 0;
  const Vf vlo(lo);
  for (int64_t j = 0; j < nv; j += W) {
    const Vf a = Vf::loadu(y0 + j) + Vf::loadu(y1 + j);
    const Vf h = a + (Vf::loadu(w1 + j) * ve + vt);
    unsigned hit = ~static_cast<unsigned>((h >= vlo).zero_mask()) & ((1u << W) - 1);
    while (hit != 0) {
      if (n == cap) return -1;
      cand[n++] = static_cast<int32_t>(j + __builtin_ctz(hit));
      hit &= hit - 1;
    }
  }
  for (int64_t j = nv; j < V; ++j) {
    if ((y0[j] + y1[j]) + (w1[j] * e + t) >= lo) {
      if (n == cap) return -1;
      cand[n++] = static_cast<int32_t>(j);
    }
  }
  return n;
}

}  // namespace

void greedy_candidates(const float* y0, const float* y1, int64_t ldy, int64_t M, int64_t V,
                       const float* w1, const float* e, float t, int64_t cap, int32_t* cand,
                       int64_t* count) {
  cpu::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      count[m] = candidates_row(y0 + m * ldy, y1 + m * ldy, V, w1, e[m], t, cap, cand + m * cap);
    }
  });
}

void argmax_f32(const float* x, int64_t rows, int64_t vocab, int64_t* out) {
  // one thread up to ~5 rows of a 49152-word vocabulary (a few us a row: about a fork's cost)
  const int64_t grain = std::max<int64_t>(1, (256 * 1024) / std::max<int64_t>(vocab, 1));
  cpu::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) out[r] = argmax_row(x + r * vocab, vocab);
  });
}

template <typename T, typename KV>
void plain_attention(const DecodeAttnArgs& a) {
  const T* qp = static_cast<const T*>(a.q);
  attention<T, KV>(a, [&](int64_t b, int64_t h, int64_t i, float* dst) {
    load_row(qp + b * a.sq_b + h * a.sq_h + i * a.sq_q, dst, a.D);
  });
}

// (kv_half with a bf16 dtype is refused by the ops.)
void decode_attention(const DecodeAttnArgs& a) {
  if (a.dtype != LinearDType::f32) return plain_attention<c10::BFloat16, c10::BFloat16>(a);
  if (a.kv_half) return plain_attention<float, c10::Half>(a);
  return plain_attention<float, float>(a);
}

void rope_attention(const RopeAttnArgs& a) {
  if (a.dtype != LinearDType::f32) return rope_attn<c10::BFloat16, c10::BFloat16>(a);
  if (a.kv_half) return rope_attn<float, c10::Half>(a);
  return rope_attn<float, float>(a);
}

void qk_rms_norm(const QkRmsNormArgs& a) {
  if (a.dtype == LinearDType::f32) return qk_rms<float>(a);
  return qk_rms<c10::BFloat16>(a);
}

void silu_mul(const SiluMulArgs& a) {
  if (a.dtype == LinearDType::f32) return silu_mul_impl<float>(a);
  return silu_mul_impl<c10::BFloat16>(a);
}

void rms_norm(const RmsNormArgs& a) {
  if (a.dtype == LinearDType::f32) return rms<float>(a);
  return rms<c10::BFloat16>(a);
}

}  // namespace jacobi::cpu::JACOBI_ISA

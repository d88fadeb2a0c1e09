// The fused small ops of a CUDA decoding step (decode_cuda.h): RMSNorm with the residual add,
// SiLU times up, rotary + K/V write + split-K attention over the step plan, the split combine,
// and the K/V commit of all layers. The formulas are jacobi/decode_step.h's (the CPU kernels'),
// the online softmax jacobi/online_softmax.h's.
//
// Attention, per (split, tile of kRows query rows, batch x kv head): the tile's queries rotated
// into shared memory; the split's keys (step_key_slot's order: the committed slots, then the
// step's own tokens) in chunks of kKeys: K and V into shared memory (the step's own keys
// rotated from qkv directly, so no block reads a cache slot that another block writes in this
// launch), scores masked by the plan's rule, the online softmax per row, then p V with each
// thread owning one feature of a few rows. Each split leaves (max, sum, unnormalised output)
// and the combine merges them; every capacity runs the same two launches. A split past a
// sequence's keys returns at once and writes nothing: the combine reads only the splits that
// hold keys (decode_step.h: step_live_splits). Committed K/V are read 16 bytes a load. Rows of a
// GQA group share their kv head's loads (no repeat_kv).
//
// Built without --use_fast_math (CMakeLists.txt; decode_step.h says why).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/decode_cuda.h"
#include "jacobi/decode_step.h"
#include "jacobi/online_softmax.h"

namespace jacobi::cuda {
namespace {

namespace dm = jacobi::decode;

template <typename T>
struct Elem;
template <>
struct Elem<float> {
  static __device__ __forceinline__ float load(const float* p) { return *p; }
  static __device__ __forceinline__ void store(float* p, float v) { *p = v; }
  static __device__ __forceinline__ float round(float v) { return v; }
};
template <>
struct Elem<__nv_bfloat16> {
  static __device__ __forceinline__ float load(const __nv_bfloat16* p) {
    return __bfloat162float(*p);
  }
  static __device__ __forceinline__ void store(__nv_bfloat16* p, float v) {
    *p = __float2bfloat16_rn(v);
  }
  static __device__ __forceinline__ float round(float v) {
    return __bfloat162float(__float2bfloat16_rn(v));
  }
};
// Load16<T>::kN elements of T from 16 bytes at p (16-byte aligned), as floats. One vector load
// (the bf16 halves of each word widened in registers, exactly as __bfloat162float does).
template <typename T>
struct Load16;
template <>
struct Load16<float> {
  static constexpr int kN = 4;
  static __device__ __forceinline__ void load(const float* p, float (&out)[kN]) {
    const float4 v = *reinterpret_cast<const float4*>(p);
    out[0] = v.x, out[1] = v.y, out[2] = v.z, out[3] = v.w;
  }
};
template <>
struct Load16<__nv_bfloat16> {
  static constexpr int kN = 8;
  static __device__ __forceinline__ void load(const __nv_bfloat16* p, float (&out)[kN]) {
    const uint4 v = *reinterpret_cast<const uint4*>(p);
    const unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // little endian: element 2 i in the low half
      out[2 * i] = __uint_as_float(w[i] << 16);
      out[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
    }
  }
};

template <typename T>
struct RoundTo {
  __device__ __forceinline__ float operator()(float v) const { return Elem<T>::round(v); }
};

__device__ __forceinline__ float warp_max(float v) {
  for (int o = 16; o > 0; o /= 2) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
__device__ __forceinline__ float warp_sum(float v) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ double warp_sum(double v) {
  for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

// ---- RMSNorm ----------------------------------------------------------------------------------
constexpr int kNormThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kNormThreads) rms_norm_kernel(RmsNormLaunch a) {
  using E = Elem<T>;
  const RoundTo<T> round;
  const int64_t row = blockIdx.x, n = a.n;
  const T* x = static_cast<const T*>(a.x) + row * n;
  const T* res = a.residual ? static_cast<const T*>(a.residual) + row * n : nullptr;
  T* h = a.h ? static_cast<T*>(a.h) + row * n : nullptr;
  const T* w = static_cast<const T*>(a.weight);
  T* y = static_cast<T*>(a.y) + row * n;
  // h element i (the residual add rounded to T): each thread reads back only what it wrote.
  auto h_at = [&](int64_t i) {
    const float xi = E::load(x + i);
    return res ? dm::residual_add(E::load(res + i), xi, round) : xi;
  };
  double ss = 0.0;  // squares exact in double (decode_step.h: rms_inverse)
  for (int64_t i = threadIdx.x; i < n; i += kNormThreads) {
    const float hi = h_at(i);
    if (h) E::store(h + i, hi);
    ss += static_cast<double>(hi) * static_cast<double>(hi);
  }
  __shared__ double part[kNormThreads / 32];
  __shared__ float inv_s;
  ss = warp_sum(ss);
  if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
  __syncthreads();
  if (threadIdx.x == 0) {
    double total = 0.0;
    for (int i = 0; i < kNormThreads / 32; ++i) total += part[i];
    inv_s = dm::rms_inverse(total, n, a.eps);
  }
  __syncthreads();
  const float inv = inv_s;
  for (int64_t i = threadIdx.x; i < n; i += kNormThreads)
    E::store(y + i, dm::rms_output(h_at(i), inv, E::load(w + i), round));
}

// ---- Qwen3's q/k norms: one warp a head, in place ---------------------------------------------
template <typename T>
__global__ void __launch_bounds__(32) qk_rms_norm_kernel(QkRmsNormLaunch a) {
  using E = Elem<T>;
  const RoundTo<T> round;
  const int64_t per_token = a.heads + a.kv_heads, r = blockIdx.x;
  const int64_t t = r / per_token, head = r % per_token;
  T* x = static_cast<T*>(a.qkv) + t * a.row + head * a.D;
  const T* w = static_cast<const T*>(head < a.heads ? a.q_weight : a.k_weight);
  double ss = 0.0;  // (rms_norm_kernel's sum: squares exact in double)
  for (int64_t i = threadIdx.x; i < a.D; i += 32) {
    const double v = E::load(x + i);
    ss += v * v;
  }
  const float inv = dm::rms_inverse(warp_sum(ss), a.D, a.eps);
  for (int64_t i = threadIdx.x; i < a.D; i += 32)  // (each lane rewrites only what it read)
    E::store(x + i, dm::rms_output(E::load(x + i), inv, E::load(w + i), round));
}

// ---- SiLU times up ------------------------------------------------------------------------------
template <typename T>
__global__ void __launch_bounds__(256) silu_mul_kernel(int64_t rows, int64_t n, const T* gu,
                                                        T* out) {
  using E = Elem<T>;
  const int64_t total = rows * n;
  for (int64_t e = blockIdx.x * int64_t{256} + threadIdx.x; e < total;
       e += int64_t{gridDim.x} * 256) {
    const int64_t r = e / n, i = e % n;
    const T* g = gu + r * 2 * n;
    E::store(out + e, dm::silu_times_up(dm::silu(E::load(g + i)), E::load(g + n + i),
                                        RoundTo<T>{}));
  }
}

// ---- rotary + K/V write + split-K attention ------------------------------------------------
constexpr int kThreads = 128;
constexpr int kWarps = kThreads / 32;
constexpr int kRows = 16;  // query rows (token, head of the group) per block
constexpr int kKeys = 32;  // keys per chunk: one per lane in the softmax
static_assert(kDecodeSplitKeys % kKeys == 0, "a split holds whole chunks");
static_assert(kRows % kWarps == 0, "each warp owns whole rows in the softmax");
constexpr int kScores = kRows * kKeys / kThreads;  // scores per thread and chunk
constexpr int kDotChains = 4;                      // partial sums per score
static_assert(kRows * kKeys % kThreads == 0 && kDotChains == 4, "the score loop's shape");

// Feature d of head `head` of token (b, i) of qkv, rotated (rope_element) and rounded to T.
template <typename T>
__device__ __forceinline__ float rotated(const RopeAttentionLaunch& a, int64_t b, int64_t i,
                                         int64_t head, int64_t d) {
  using E = Elem<T>;
  const int64_t D = a.D, row = (a.Hq + 2 * a.Hkv) * D;
  const T* x = static_cast<const T*>(a.qkv) + (b * a.Q + i) * row + head * D;
  const int64_t t = (b * a.Q + i) * D + d;
  return dm::rope_element(E::load(x + d), E::load(x + dm::rope_partner(d, D)), d < D / 2,
                          E::load(static_cast<const T*>(a.cos) + t),
                          E::load(static_cast<const T*>(a.sin) + t), RoundTo<T>{});
}

template <typename T, int D>
__global__ void __launch_bounds__(kThreads, 1) rope_attention_kernel(RopeAttentionLaunch a) {
  using E = Elem<T>;
  constexpr int kRowGroups = kThreads / D;          // p V: threads per feature
  constexpr int kOwned = kRows / kRowGroups;        // rows each thread accumulates
  __shared__ float qs[kRows][D];
  __shared__ float ks[kKeys][D + 1];                // +1: lanes read different keys' features
  __shared__ float vs[kKeys][D];
  __shared__ float ps[kRows][kKeys];
  __shared__ float corr_s[kRows];
  __shared__ int64_t row_seg[kRows], row_off[kRows], row_tok[kRows];
  __shared__ int64_t key_seg[kKeys], key_off[kKeys], key_tok[kKeys];  // key_tok -1: committed

  const int split = blockIdx.x;
  const int64_t bh = blockIdx.z, b = bh / a.Hkv, kvh = bh % a.Hkv;
  const int64_t G = a.Hq / a.Hkv, rows = a.Q * G;
  const int64_t row0 = int64_t{blockIdx.y} * kRows;
  const dm::StepRange range = dm::step_committed(a.lo[b], a.hi[b], a.Q, a.capacity);
  const int64_t lo = range.lo, hi = range.hi;
  const int64_t nkeys = dm::step_keys(lo, hi, a.Q);
  const int64_t k0 = int64_t{split} * kDecodeSplitKeys;
  // Past the sequence's keys: nothing to see, nothing to write (the combine stops before this
  // split). Split 0 always holds keys (nkeys >= Q >= 1), so the cache write below still runs.
  if (k0 >= nkeys) return;
  const int64_t k1 = min(nkeys, k0 + kDecodeSplitKeys);
  const int64_t kv_head = (b * a.Hkv + kvh) * a.capacity;  // first slot of this head's cache
  const int64_t qkv_row = (a.Hq + 2 * a.Hkv) * D;

  // The step's K/V into the cache, once per (batch, kv head); read back by later steps only.
  if (split == 0 && blockIdx.y == 0) {
    for (int64_t e = threadIdx.x; e < a.Q * D; e += kThreads) {
      const int64_t i = e / D, d = e % D;
      const int64_t at = (kv_head + i) * D + d;
      E::store(static_cast<T*>(a.k_cache) + at, rotated<T>(a, b, i, a.Hq + kvh, d));
      const T* v = static_cast<const T*>(a.qkv) + (b * a.Q + i) * qkv_row;
      static_cast<T*>(a.v_cache)[at] = v[(a.Hq + a.Hkv + kvh) * D + d];
    }
  }
  // The tile's queries (row r: token (row0 + r) / G, head kvh G + (row0 + r) % G), rotated.
  for (int e = threadIdx.x; e < kRows * D; e += kThreads) {
    const int r = e / D, d = e % D;
    const int64_t rg = row0 + r;
    qs[r][d] = rg < rows ? rotated<T>(a, b, rg / G, kvh * G + rg % G, d) : 0.f;
  }
  if (threadIdx.x < kRows) {
    const int64_t rg = row0 + threadIdx.x;
    const bool live = rg < rows;
    row_tok[threadIdx.x] = live ? rg / G : -1;
    row_seg[threadIdx.x] = live ? a.seg[b * a.seg_stride + rg / G] : -1;
    row_off[threadIdx.x] = live ? a.off[b * a.off_stride + rg / G] : 0;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const float to_log2 = a.scale * attn::kLog2e;
  attn::SoftmaxRow state[kRows / kWarps];  // the rows this warp owns: warp + kWarps * k
  for (auto& s : state) s = attn::softmax_init();
  float acc[kOwned];
  for (float& v : acc) v = 0.f;
  const int feature = threadIdx.x % D, group = threadIdx.x / D;

  for (int64_t c0 = k0; c0 < k1; c0 += kKeys) {
    __syncthreads();  // the previous chunk's readers are done (and the rows' metadata is in)
    // kN features of one key a thread and pass: a committed key's in one 16-byte load each of K
    // and V (a row of D elements is a multiple of 16 bytes, the caches 16-byte aligned: the op
    // checks), a step's own key rotated from qkv as the cache write above makes it.
    constexpr int kN = Load16<T>::kN, kVecs = D / kN;
    static_assert(D % kN == 0, "a cache row is whole 16-byte vectors");
    for (int e = threadIdx.x; e < kKeys * kVecs; e += kThreads) {
      const int j = e / kVecs, d0 = (e % kVecs) * kN;
      const int64_t t = c0 + j;
      float kv[kN], vv[kN];
#pragma unroll
      for (int u = 0; u < kN; ++u) kv[u] = vv[u] = 0.f;
      if (t < k1) {
        const int64_t slot = dm::step_key_slot(t, lo, hi);
        if (t < hi - lo) {
          Load16<T>::load(static_cast<const T*>(a.k_cache) + (kv_head + slot) * D + d0, kv);
          Load16<T>::load(static_cast<const T*>(a.v_cache) + (kv_head + slot) * D + d0, vv);
        } else {  // the step's own token `slot`
          const T* v = static_cast<const T*>(a.qkv) + (b * a.Q + slot) * qkv_row +
                       (a.Hq + a.Hkv + kvh) * D + d0;
#pragma unroll
          for (int u = 0; u < kN; ++u) {
            kv[u] = rotated<T>(a, b, slot, a.Hq + kvh, d0 + u);
            vv[u] = E::load(v + u);
          }
        }
      }
#pragma unroll
      for (int u = 0; u < kN; ++u) {
        ks[j][d0 + u] = kv[u];
        vs[j][d0 + u] = vv[u];
      }
    }
    if (threadIdx.x < kKeys) {
      const int64_t t = c0 + threadIdx.x;
      const bool scratch = t < k1 && t >= hi - lo;
      const int64_t tok = scratch ? t - (hi - lo) : -1;
      key_tok[threadIdx.x] = t < k1 ? tok : -2;  // -2: past the split
      key_seg[threadIdx.x] = scratch ? a.seg[b * a.seg_stride + tok] : -1;
      key_off[threadIdx.x] = scratch ? a.off[b * a.off_stride + tok] : 0;
    }
    __syncthreads();
    // Scores, masked by the plan (decode_step.h: step_sees_*), in raw units. This thread's
    // kScores scores side by side, each in kDotChains interleaved partial sums (feature d in
    // chain d % kDotChains): independent FMA chains instead of one dependent chain of D. A
    // row's score is the same expression whichever tile, warp or step it falls in.
    float dots[kScores][kDotChains];
#pragma unroll
    for (int u = 0; u < kScores; ++u)
#pragma unroll
      for (int c = 0; c < kDotChains; ++c) dots[u][c] = 0.f;
#pragma unroll 4
    for (int d = 0; d < D; d += kDotChains) {
#pragma unroll
      for (int u = 0; u < kScores; ++u) {
        const int p = threadIdx.x + u * kThreads, r = p / kKeys, j = p % kKeys;
#pragma unroll
        for (int c = 0; c < kDotChains; ++c)
          dots[u][c] = fmaf(qs[r][d + c], ks[j][d + c], dots[u][c]);
      }
    }
#pragma unroll
    for (int u = 0; u < kScores; ++u) {
      const int p = threadIdx.x + u * kThreads, r = p / kKeys, j = p % kKeys;
      const int64_t tok = key_tok[j];
      bool visible = row_tok[r] >= 0 && tok != -2;
      if (visible) {
        visible = tok < 0 ? dm::step_sees_committed(row_seg[r], lo + (c0 + j), lo, hi)
                          : dm::step_sees_scratch(row_seg[r], row_off[r], key_seg[j], key_off[j],
                                                  tok == row_tok[r]);
      }
      ps[r][j] = visible ? (dots[u][0] + dots[u][1]) + (dots[u][2] + dots[u][3]) : -INFINITY;
    }
    __syncthreads();
    // Online softmax: warp w owns rows w, w + kWarps, ...; lane j holds key j.
#pragma unroll
    for (int k = 0; k < kRows / kWarps; ++k) {
      const int r = warp + kWarps * k;
      const float x = ps[r][lane];
      const float corr = attn::softmax_rescale(state[k], warp_max(x), to_log2);
      const float base = attn::softmax_exp_base(state[k]) * to_log2;
      const float p = exp2f(x * to_log2 - base);
      attn::softmax_add(state[k], corr, warp_sum(p));
      ps[r][lane] = p;
      if (lane == 0) corr_s[r] = corr;
    }
    __syncthreads();
    // p V: this thread's feature of rows group, group + kRowGroups, ...
#pragma unroll
    for (int k = 0; k < kOwned; ++k) {
      const int r = group + kRowGroups * k;
      float o = acc[k] * corr_s[r];
#pragma unroll 8
      for (int j = 0; j < kKeys; ++j) o = fmaf(ps[r][j], vs[j][feature], o);
      acc[k] = o;
    }
  }
  // The split's partials: rows past the tile's end are not stored.
  const int64_t nrows = a.B * a.Q * a.Hq;
  auto row_index = [&](int r) {  // [B, Q, Hq] flat index of tile row r
    const int64_t rg = row0 + r;
    return (b * a.Q + rg / G) * a.Hq + kvh * G + rg % G;
  };
#pragma unroll
  for (int k = 0; k < kRows / kWarps; ++k) {
    const int r = warp + kWarps * k;
    if (lane == 0 && row0 + r < rows) {
      float* st = a.partial_stats + (int64_t{split} * nrows + row_index(r)) * 2;
      st[0] = state[k].max;
      st[1] = state[k].sum;
    }
  }
#pragma unroll
  for (int k = 0; k < kOwned; ++k) {
    const int r = group + kRowGroups * k;
    if (row0 + r < rows)
      a.partial_out[(int64_t{split} * nrows + row_index(r)) * D + feature] = acc[k];
  }
}

// One block per row [B, Q, Hq], one thread per feature: the splits that hold keys merged
// (decode_step.h; those past the sequence's keys wrote nothing, and would weigh 0).
template <typename T, int D>
__global__ void __launch_bounds__(D) combine_kernel(RopeAttentionLaunch a) {
  const int64_t row = blockIdx.x, nrows = a.B * a.Q * a.Hq, b = row / (a.Q * a.Hq);
  const dm::StepRange range = dm::step_committed(a.lo[b], a.hi[b], a.Q, a.capacity);
  const int64_t live = min(a.splits, dm::step_live_splits(dm::step_keys(range.lo, range.hi, a.Q),
                                                          kDecodeSplitKeys));
  const float to_log2 = a.scale * attn::kLog2e;
  float all_max = -INFINITY;
  for (int64_t s = 0; s < live; ++s)
    all_max = fmaxf(all_max, a.partial_stats[(s * nrows + row) * 2]);
  float num = 0.f, den = 0.f;
  for (int64_t s = 0; s < live; ++s) {
    const float* st = a.partial_stats + (s * nrows + row) * 2;
    const float w = dm::split_weight(st[0], all_max, to_log2);
    if (w == 0.f) continue;  // (a split that saw nothing: its output is 0, its sum 0)
    den = fmaf(w, st[1], den);
    num = fmaf(w, a.partial_out[(s * nrows + row) * D + threadIdx.x], num);
  }
  const float inv = den > 0.f ? 1.f / den : 0.f;
  Elem<T>::store(static_cast<T*>(a.out) + row * D + threadIdx.x, num * inv);
}

template <typename T, int D>
cudaError_t launch_attention(const RopeAttentionLaunch& a, cudaStream_t stream) {
  const int64_t tiles = (a.Q * (a.Hq / a.Hkv) + kRows - 1) / kRows;
  const dim3 grid(static_cast<unsigned>(a.splits), static_cast<unsigned>(tiles),
                  static_cast<unsigned>(a.B * a.Hkv));
  rope_attention_kernel<T, D><<<grid, kThreads, 0, stream>>>(a);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  combine_kernel<T, D><<<static_cast<unsigned>(a.B * a.Q * a.Hq), D, 0, stream>>>(a);
  return cudaGetLastError();
}

// ---- the greedy pick ----------------------------------------------------------------------------
constexpr int kArgmaxThreads = 256;

template <typename T>
__device__ __forceinline__ auto logit(const T* p) {
  if constexpr (std::is_same_v<T, double>) {
    return *p;
  } else if constexpr (std::is_same_v<T, float>) {
    return *p;
  } else if constexpr (std::is_same_v<T, __half>) {
    return __half2float(*p);  // (exact: the order of values and NaNs is kept)
  } else {
    return __bfloat162float(*p);
  }
}

// Each thread scans a strided share of the row, then the block's picks combine by the same
// order (greedy_better: any combination order gives the same index).
template <typename T>
__global__ void __launch_bounds__(kArgmaxThreads) argmax_kernel(const T* x, int64_t vocab,
                                                                int64_t* out) {
  using V = decltype(logit(x));
  const T* row = x + int64_t{blockIdx.x} * vocab;
  V best = logit(row);
  int64_t best_i = 0;
  for (int64_t i = threadIdx.x; i < vocab; i += kArgmaxThreads) {
    const V v = logit(row + i);
    if (dm::greedy_better(v, i, best, best_i)) best = v, best_i = i;
  }
  __shared__ V vals[kArgmaxThreads];
  __shared__ int64_t idx[kArgmaxThreads];
  vals[threadIdx.x] = best;
  idx[threadIdx.x] = best_i;
  __syncthreads();
  for (int half = kArgmaxThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      const int o = threadIdx.x + half;
      if (dm::greedy_better(vals[o], idx[o], vals[threadIdx.x], idx[threadIdx.x])) {
        vals[threadIdx.x] = vals[o];
        idx[threadIdx.x] = idx[o];
      }
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) out[blockIdx.x] = idx[0];
}

// ---- K/V commit --------------------------------------------------------------------------------
// One block per (cache, sequence, head): the rows move as 32-bit words where every row and
// cache start is 4-byte aligned, else as 16-bit ones. Disjoint ranges (the
// runtime's: scratch to after the committed tokens) copy in parallel; overlapping ones slot by
// slot in commit_nth's order.
constexpr int kCommitThreads = 128;
constexpr int kCommitUnitsPerThread = 4;  // units staged per thread and pass (a pass: 2 KB of u32)

// U: the unit rows move in (32 bits, or 16 where a row or a cache is not 4-byte aligned).
template <typename U>
__global__ void __launch_bounds__(kCommitThreads) kv_commit_kernel(KvCommitLaunch a) {
  const int64_t b = blockIdx.y, h = blockIdx.z;
  const int64_t s = a.src[b], d = a.dst[b], n = a.n[b];
  if (!dm::commit_moves(s, d, n) || !dm::commit_fits(s, d, n, a.capacity)) return;
  const int64_t units = a.row_bytes / static_cast<int64_t>(sizeof(U));
  auto* head = static_cast<U*>(a.caches[blockIdx.x]) + (b * a.H + h) * a.capacity * units;
  if (!dm::commit_overlaps(s, d, n)) {
    for (int64_t e = threadIdx.x; e < n * units; e += blockDim.x)
      head[(d + e / units) * units + e % units] = head[(s + e / units) * units + e % units];
    return;
  }
  // Overlapping: slot by slot in commit_nth's order, each slot read before any thread writes
  // (a write may land on a slot another thread still reads: the barriers order them).
  constexpr int64_t kPass = int64_t{kCommitThreads} * kCommitUnitsPerThread;
  for (int64_t k = 0; k < n; ++k) {
    const int64_t x = dm::commit_nth(k, s, d, n);
    for (int64_t u0 = 0; u0 < units; u0 += kPass) {
      U v[kCommitUnitsPerThread];
#pragma unroll
      for (int u = 0; u < kCommitUnitsPerThread; ++u) {
        const int64_t e = u0 + threadIdx.x + u * kCommitThreads;
        v[u] = e < units ? head[(s + x) * units + e] : U{0};
      }
      __syncthreads();
#pragma unroll
      for (int u = 0; u < kCommitUnitsPerThread; ++u) {
        const int64_t e = u0 + threadIdx.x + u * kCommitThreads;
        if (e < units) head[(d + x) * units + e] = v[u];
      }
      __syncthreads();
    }
  }
}

}  // namespace

cudaError_t rms_norm(const RmsNormLaunch& a, cudaStream_t stream) {
  if (a.rows <= 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(a.rows);
  if (a.dtype == DecodeDType::kFloat32)
    rms_norm_kernel<float><<<grid, kNormThreads, 0, stream>>>(a);
  else
    rms_norm_kernel<__nv_bfloat16><<<grid, kNormThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t qk_rms_norm(const QkRmsNormLaunch& a, cudaStream_t stream) {
  const int64_t rows = a.tokens * (a.heads + a.kv_heads);
  if (rows <= 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(rows);
  if (a.dtype == DecodeDType::kFloat32)
    qk_rms_norm_kernel<float><<<grid, 32, 0, stream>>>(a);
  else
    qk_rms_norm_kernel<__nv_bfloat16><<<grid, 32, 0, stream>>>(a);
  return cudaGetLastError();
}

cudaError_t silu_mul(DecodeDType dtype, int64_t rows, int64_t n, const void* gu, void* out,
                     cudaStream_t stream) {
  const int64_t total = rows * n;
  if (total <= 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>(std::min<int64_t>((total + 255) / 256, 4096));
  if (dtype == DecodeDType::kFloat32)
    silu_mul_kernel<float><<<grid, 256, 0, stream>>>(rows, n, static_cast<const float*>(gu),
                                                      static_cast<float*>(out));
  else
    silu_mul_kernel<__nv_bfloat16><<<grid, 256, 0, stream>>>(
        rows, n, static_cast<const __nv_bfloat16*>(gu), static_cast<__nv_bfloat16*>(out));
  return cudaGetLastError();
}

cudaError_t argmax(LogitsDType dtype, const void* x, int64_t rows, int64_t vocab, int64_t* out,
                   cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  if (vocab <= 0) return cudaErrorInvalidValue;
  const unsigned grid = static_cast<unsigned>(rows);
  switch (dtype) {
    case LogitsDType::kFloat32:
      argmax_kernel<<<grid, kArgmaxThreads, 0, stream>>>(static_cast<const float*>(x), vocab, out);
      break;
    case LogitsDType::kBFloat16:
      argmax_kernel<<<grid, kArgmaxThreads, 0, stream>>>(static_cast<const __nv_bfloat16*>(x),
                                                         vocab, out);
      break;
    case LogitsDType::kFloat16:
      argmax_kernel<<<grid, kArgmaxThreads, 0, stream>>>(static_cast<const __half*>(x), vocab,
                                                         out);
      break;
    case LogitsDType::kFloat64:
      argmax_kernel<<<grid, kArgmaxThreads, 0, stream>>>(static_cast<const double*>(x), vocab,
                                                         out);
      break;
  }
  return cudaGetLastError();
}

bool decode_attention_head_dim_ok(int64_t D) { return D == 64 || D == 128; }

cudaError_t rope_attention(const RopeAttentionLaunch& a, cudaStream_t stream) {
  if (a.B * a.Q * a.Hq == 0) return cudaSuccess;
  const bool f32 = a.dtype == DecodeDType::kFloat32;
  if (a.D == 64)
    return f32 ? launch_attention<float, 64>(a, stream)
               : launch_attention<__nv_bfloat16, 64>(a, stream);
  if (a.D == 128)
    return f32 ? launch_attention<float, 128>(a, stream)
               : launch_attention<__nv_bfloat16, 128>(a, stream);
  return cudaErrorInvalidValue;
}

cudaError_t kv_commit(const KvCommitLaunch& a, cudaStream_t stream) {
  if (a.count <= 0 || a.B <= 0 || a.H <= 0) return cudaSuccess;
  if (a.row_bytes <= 0 || a.row_bytes % 2 != 0) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(a.count), static_cast<unsigned>(a.B),
                  static_cast<unsigned>(a.H));
  // 32-bit units only where every address they touch is 4-byte aligned: each row's size and
  // each cache's start (a 16-bit view into a larger buffer may start 2 bytes into a word).
  bool words = a.row_bytes % 4 == 0;
  for (int i = 0; i < a.count; ++i)
    words = words && reinterpret_cast<uintptr_t>(a.caches[i]) % 4 == 0;
  if (words)
    kv_commit_kernel<uint32_t><<<grid, kCommitThreads, 0, stream>>>(a);
  else
    kv_commit_kernel<uint16_t><<<grid, kCommitThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace jacobi::cuda

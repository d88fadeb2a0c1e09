// The small ops of a CPU decoding step (decode_cpu.h). Compiled once per vector ISA (isa.h).
//
// Attention: per (batch, kv head), the keys are transposed once into Kt [D, W] (fp32, W padded
// to the vector width), so a row's scores over 16 keys are one chain of D fused multiply-adds
// with q[d] broadcast: no horizontal sums, and rows in groups of kRows share each Kt load. The
// softmax runs over the whole row of scores at once (W is the cache length: thousands at most),
// then out = p V, one chain over the keys in slot order per output feature. Every row is
// computed alone in the same order whatever the others are, as decode_cpu.h promises.
#include "cpu/decode_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>

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

template <typename T>
inline float to_f(T v) {
  return static_cast<float>(v);
}

// dst[0, n) = src[0, n) in fp32.
template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = to_f(src[i]);
}

// Scores of `rows` query rows (q: rows x D fp32, pre-scaled) against keys [j0, j0 + kVL) of Kt
// (D x ldk): s[r][j] = sum_d q[r][d] * Kt[d][j0 + j], d in order.
template <int R>
inline void score_tile(const float* q, int64_t D, const float* kt, int64_t ldk, int64_t j0,
                       float* s, int64_t lds) {
  Vec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Vec(0.f);
  for (int64_t d = 0; d < D; ++d) {
    const Vec kv = Vec::loadu(kt + d * ldk + j0);
    for (int r = 0; r < R; ++r) acc[r] = at::vec::fmadd(Vec(q[r * D + d]), kv, acc[r]);
  }
  for (int r = 0; r < R; ++r) acc[r].store(s + r * lds + j0);
}

// out[r][:] = sum_j p[r][j] * V[j][:] (rows of V ldv apart), j in slot order (only where p > 0: masked slots are 0).
template <int R>
inline void pv_tile(const float* p, int64_t lds, const float* v, int64_t ldv, int64_t W,
                    int64_t D, int64_t d0, float* out) {
  const int64_t n = std::min<int64_t>(kVL, D - d0);
  Vec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Vec(0.f);
  for (int64_t j = 0; j < W; ++j) {
    const Vec vv = Vec::loadu(v + j * ldv + d0, n);
    for (int r = 0; r < R; ++r) {
      const float pr = p[r * lds + j];
      if (pr != 0.f) acc[r] = at::vec::fmadd(Vec(pr), vv, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) acc[r].store(out + r * D + d0, n);
}

// The attention of DecodeAttnArgs, with each query row given by load_q(b, h, i, dst): dst[0, D)
// = the row in fp32 (before the scale).
template <typename T, typename LoadQ>
void attention(const DecodeAttnArgs& a, const LoadQ& load_q) {
  const int64_t G = a.Hq / a.Hkv, D = a.D, W = a.W, Q = a.Q;
  const int64_t ldk = (W + kKeyPad - 1) / kKeyPad * kKeyPad;  // a multiple of kVL too
  const int64_t rows_per_group = G * Q;  // the query rows that read one kv head
  const int64_t chunks = (rows_per_group + kRows - 1) / kRows;
  const T* kp = static_cast<const T*>(a.k);
  const T* vp = static_cast<const T*>(a.v);
  T* outp = static_cast<T*>(a.out);
  // Pass 1: Kt [D, ldk] in fp32 per (b, kv head), by 16 x 16 register transposes; V read in
  // place when fp32 (rows sv_w apart), else widened to fp32 [W, D].
  const int64_t groups = a.B * a.Hkv;
  constexpr bool kF32 = std::is_same_v<T, float>;
  float* kt_all = a.scratch;
  float* v_all = kt_all + groups * D * ldk;
  float* tmp_all = v_all + groups * W * D;  // per thread: scores kRows x ldk, q kRows x D, out
  const int64_t tmp_per_thread = kRows * ldk + 2 * kRows * D;
  const int64_t ldv = kF32 ? a.sv_w : D;
  auto v_rows = [&](int64_t g) -> const float* {
    if constexpr (kF32) {
      return vp + (g / a.Hkv) * a.sv_b + (g % a.Hkv) * a.sv_h;
    } else {
      return v_all + g * W * D;
    }
  };
  const int64_t grain1 = std::max<int64_t>(1, 16384 / std::max<int64_t>(W * D, 1));
  // The caller keeps Kt: nothing to transpose, and with fp32 V (read in place) no pass at all;
  // with bf16 / fp16 V the pass only widens V.
  const bool kept = a.kt != nullptr;
  if (!(kept && kF32)) at::parallel_for(0, groups, grain1, [&](int64_t g0, int64_t g1) {
    alignas(64) float blk[16 * 16];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g / a.Hkv, h = g % a.Hkv;
      float* kt = kt_all + g * D * ldk;
      const T* kb = kp + b * a.sk_b + h * a.sk_h;
      for (int64_t j0 = 0; !kept && j0 < W; j0 += 16) {
        const int jn = static_cast<int>(std::min<int64_t>(16, W - j0));
        for (int64_t d0 = 0; d0 < D; d0 += 16) {
          const int dn = static_cast<int>(std::min<int64_t>(16, D - d0));
          if constexpr (kF32) {
            at::vec::transpose_mxn<float>(kb + j0 * a.sk_w + d0, a.sk_w, kt + d0 * ldk + j0, ldk,
                                          jn, dn);
          } else {
            for (int j = 0; j < jn; ++j) load_row(kb + (j0 + j) * a.sk_w + d0, blk + j * 16, dn);
            at::vec::transpose_mxn<float>(blk, 16, kt + d0 * ldk + j0, ldk, jn, dn);
          }
        }
      }
      for (int64_t d = 0; !kept && d < D; ++d)
        for (int64_t j = W; j < ldk; ++j) kt[d * ldk + j] = 0.f;
      if constexpr (!kF32) {
        float* vf = v_all + g * W * D;
        for (int64_t j = 0; j < W; ++j)
          load_row(vp + b * a.sv_b + h * a.sv_h + j * a.sv_w, vf + j * D, D);
      }
    }
  });
  // Pass 2: per (b, kv head, chunk of kRows query rows).
  const int64_t work = groups * chunks;
  const int64_t grain2 = std::max<int64_t>(1, 32768 / std::max<int64_t>(kRows * W * D, 1));
  at::parallel_for(0, work, grain2, [&](int64_t w0, int64_t w1) {
    float* tmp = tmp_all + at::get_thread_num() * tmp_per_thread;
    float* s = tmp;                      // kRows x ldk
    float* qf = s + kRows * ldk;         // kRows x D
    float* of = qf + kRows * D;          // kRows x D
    for (int64_t w = w0; w < w1; ++w) {
      const int64_t g = w / chunks, c = w % chunks;
      const int64_t b = g / a.Hkv, hk = g % a.Hkv;
      const int64_t r0 = c * kRows;
      const int rows = static_cast<int>(std::min<int64_t>(kRows, rows_per_group - r0));
      // row r of the group: query head hk * G + r / Q, position r % Q
      for (int r = 0; r < rows; ++r) {
        const int64_t h = hk * G + (r0 + r) / Q, i = (r0 + r) % Q;
        load_q(b, h, i, qf + r * D);
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] *= a.scale;
      }
      const float* kt = kept ? a.kt + g * D * a.ldkt : kt_all + g * D * ldk;
      const int64_t ldt = kept ? a.ldkt : ldk;  // Kt's row stride
      for (int64_t j0 = 0; j0 < ldk; j0 += kVL) {
        switch (rows) {
          case 8: score_tile<8>(qf, D, kt, ldt, j0, s, ldk); break;
          case 7: score_tile<7>(qf, D, kt, ldt, j0, s, ldk); break;
          case 6: score_tile<6>(qf, D, kt, ldt, j0, s, ldk); break;
          case 5: score_tile<5>(qf, D, kt, ldt, j0, s, ldk); break;
          case 4: score_tile<4>(qf, D, kt, ldt, j0, s, ldk); break;
          case 3: score_tile<3>(qf, D, kt, ldt, j0, s, ldk); break;
          case 2: score_tile<2>(qf, D, kt, ldt, j0, s, ldk); break;
          default: score_tile<1>(qf, D, kt, ldt, j0, s, ldk); break;
        }
      }
      // softmax per row over its visible slots (masked: probability exactly 0)
      bool any[kRows];
      for (int r = 0; r < rows; ++r) {
        const int64_t i = (r0 + r) % Q;
        const bool* m = a.mask + (b * Q + i) * W;
        float* sr = s + r * ldk;
        float mx = kNegInf;
        for (int64_t j = 0; j < W; ++j) {
          if (!m[j]) sr[j] = kNegInf;
          mx = std::max(mx, sr[j]);
        }
        for (int64_t j = W; j < ldk; ++j) sr[j] = kNegInf;
        any[r] = mx != kNegInf;
        if (!any[r]) {
          std::fill(sr, sr + ldk, 0.f);
          continue;
        }
        Vec sum(0.f);
        const Vec vmx(mx);
        for (int64_t j = 0; j < ldk; j += kVL) {
          const Vec e = (Vec::loadu(sr + j) - vmx).exp_u20();
          e.store(sr + j);
          sum = sum + e;
        }
        const float inv = 1.f / at::vec::vec_reduce_all<float>(
                                    [](Vec& x, Vec& y) { return x + y; }, sum);
        const Vec vinv(inv);
        for (int64_t j = 0; j < ldk; j += kVL) (Vec::loadu(sr + j) * vinv).store(sr + j);
      }
      const float* vf = v_rows(g);
      for (int64_t d0 = 0; d0 < D; d0 += kVL) {
        switch (rows) {
          case 8: pv_tile<8>(s, ldk, vf, ldv, W, D, d0, of); break;
          case 7: pv_tile<7>(s, ldk, vf, ldv, W, D, d0, of); break;
          case 6: pv_tile<6>(s, ldk, vf, ldv, W, D, d0, of); break;
          case 5: pv_tile<5>(s, ldk, vf, ldv, W, D, d0, of); break;
          case 4: pv_tile<4>(s, ldk, vf, ldv, W, D, d0, of); break;
          case 3: pv_tile<3>(s, ldk, vf, ldv, W, D, d0, of); break;
          case 2: pv_tile<2>(s, ldk, vf, ldv, W, D, d0, of); break;
          default: pv_tile<1>(s, ldk, vf, ldv, W, D, d0, of); break;
        }
      }
      for (int r = 0; r < rows; ++r) {
        const int64_t h = hk * G + (r0 + r) / Q, i = (r0 + r) % Q;
        T* o = outp + ((b * Q + i) * a.Hq + h) * D;
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(any[r] ? of[r * D + d] : 0.f);
      }
    }
  });
}

// transformers' apply_rotary_pos_emb on one row: dst = x * cos + rotate_half(x) * sin, every
// product and the sum rounded to T (this file is compiled with -ffp-contract=off: no fusing).
template <typename T>
inline void rotate_row(const T* x, const T* cos, const T* sin, int64_t D, T* dst) {
  const int64_t half = D / 2;
  for (int64_t d = 0; d < D; ++d) {
    const T rh = d < half ? static_cast<T>(-to_f(x[d + half])) : x[d - half];
    const T a = static_cast<T>(to_f(x[d]) * to_f(cos[d]));
    const T b = static_cast<T>(to_f(rh) * to_f(sin[d]));
    dst[d] = static_cast<T>(to_f(a) + to_f(b));
  }
}

template <typename T>
void rope_attn(const RopeAttnArgs& a) {
  const int64_t D = a.D, Q = a.Q, row = (a.Hq + 2 * a.Hkv) * D;
  const T* qkv = static_cast<const T*>(a.qkv);
  const T* cs = static_cast<const T*>(a.cos);
  const T* sn = static_cast<const T*>(a.sin);
  T* kc = static_cast<T*>(a.k_cache);
  T* vc = static_cast<T*>(a.v_cache);
  // k rotated and v copied into the cache (small: Q rows of Hkv heads).
  for (int64_t b = 0; b < a.B; ++b)
    for (int64_t i = 0; i < Q; ++i) {
      const T* src = qkv + (b * Q + i) * row;
      const T* c = cs + (b * Q + i) * D;
      const T* sv = sn + (b * Q + i) * D;
      for (int64_t h = 0; h < a.Hkv; ++h) {
        const int64_t at = ((b * a.Hkv + h) * a.capacity + a.slots[i]) * D;
        rotate_row(src + (a.Hq + h) * D, c, sv, D, kc + at);
        std::copy(src + (a.Hq + a.Hkv + h) * D, src + (a.Hq + a.Hkv + h + 1) * D, vc + at);
        if (a.kt_cache != nullptr) {  // the same key, a column of the transposed copy
          float* col = a.kt_cache + (b * a.Hkv + h) * D * a.kt_ld + a.slots[i];
          for (int64_t d = 0; d < D; ++d) col[d * a.kt_ld] = to_f(kc[at + d]);
        }
      }
    }
  const int64_t cache_h = a.capacity * D, cache_b = a.Hkv * cache_h;
  DecodeAttnArgs d{a.dtype, a.B, a.Hq, a.Hkv, Q, a.W, D,
                   nullptr, 0, 0, 0,
                   kc, cache_b, cache_h, D,
                   vc, cache_b, cache_h, D,
                   a.mask, a.scale, a.out, a.scratch, a.kt_cache, a.kt_ld};
  attention<T>(d, [&](int64_t b, int64_t h, int64_t i, float* dst) {
    T rot[512];  // head dims up to 512 (the op checks)
    rotate_row(qkv + (b * Q + i) * row + h * D, cs + (b * Q + i) * D, sn + (b * Q + i) * D, D,
               rot);
    for (int64_t k = 0; k < D; ++k) dst[k] = to_f(rot[k]);
  });
}

template <typename T>
void rms(const RmsNormArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* res = static_cast<const T*>(a.residual);
  const T* w = static_cast<const T*>(a.weight);
  T* hout = static_cast<T*>(a.h);
  T* y = static_cast<T*>(a.y);
  const int64_t n = a.n;
  at::parallel_for(0, a.rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1)),
                   [&](int64_t r0, int64_t r1) {
                     std::vector<T> hbuf(hout == nullptr && res != nullptr ? n : 0);
                     for (int64_t r = r0; r < r1; ++r) {
                       const T* xr = x + r * n;
                       const T* hr = xr;
                       if (res != nullptr) {  // h = residual + x, rounded to T
                         T* hw = hout != nullptr ? hout + r * n : hbuf.data();
                         const T* rr = res + r * n;
                         for (int64_t i = 0; i < n; ++i)
                           hw[i] = static_cast<T>(to_f(rr[i]) + to_f(xr[i]));
                         hr = hw;
                       } else if (hout != nullptr) {
                         std::copy(xr, xr + n, hout + r * n);
                       }
                       T* yr = y + r * n;
                       double ss = 0.0;  // in double: the mean of squares, order-robust
                       for (int64_t i = 0; i < n; ++i) {
                         const float v = to_f(hr[i]);
                         ss += static_cast<double>(v) * v;
                       }
                       const float var = static_cast<float>(ss / static_cast<double>(n));
                       const float inv = 1.f / std::sqrt(var + a.eps);
                       for (int64_t i = 0; i < n; ++i) {
                         const T normed = static_cast<T>(to_f(hr[i]) * inv);
                         yr[i] = static_cast<T>(to_f(w[i]) * to_f(normed));
                       }
                     }
                   });
}

template <typename T>
void silu_mul_impl(const SiluMulArgs& a) {
  const T* gu = static_cast<const T*>(a.gu);
  T* out = static_cast<T*>(a.out);
  const int64_t n = a.n;
  at::parallel_for(0, a.rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1)),
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
                         o[i] = static_cast<T>(to_f(static_cast<T>(act[i])) * to_f(u[i]));
                     }
                   });
}

}  // namespace

template <typename T>
void plain_attention(const DecodeAttnArgs& a) {
  const T* qp = static_cast<const T*>(a.q);
  attention<T>(a, [&](int64_t b, int64_t h, int64_t i, float* dst) {
    load_row(qp + b * a.sq_b + h * a.sq_h + i * a.sq_q, dst, a.D);
  });
}

void decode_attention(const DecodeAttnArgs& a) {
  if (a.dtype == LinearDType::f32) return plain_attention<float>(a);
  return plain_attention<c10::BFloat16>(a);
}

void rope_attention(const RopeAttnArgs& a) {
  if (a.dtype == LinearDType::f32) return rope_attn<float>(a);
  return rope_attn<c10::BFloat16>(a);
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

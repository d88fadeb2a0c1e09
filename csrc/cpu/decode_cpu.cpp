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
#include <vector>

namespace jacobi::cpu::JACOBI_ISA {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int kVL = Vec::size();
constexpr int kRows = 4;  // query rows sharing each load of Kt / V (decode_cpu.h's scratch size)
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

// out[r][:] = sum_j p[r][j] * V[j][:], j in slot order (only where p > 0: masked slots are 0).
template <int R>
inline void pv_tile(const float* p, int64_t lds, const float* v, int64_t W, int64_t D,
                    int64_t d0, float* out) {
  const int64_t n = std::min<int64_t>(kVL, D - d0);
  Vec acc[R];
  for (int r = 0; r < R; ++r) acc[r] = Vec(0.f);
  for (int64_t j = 0; j < W; ++j) {
    const Vec vv = Vec::loadu(v + j * D + d0, n);
    for (int r = 0; r < R; ++r) {
      const float pr = p[r * lds + j];
      if (pr != 0.f) acc[r] = at::vec::fmadd(Vec(pr), vv, acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) acc[r].store(out + r * D + d0, n);
}

template <typename T>
void attention(const DecodeAttnArgs& a) {
  const int64_t G = a.Hq / a.Hkv, D = a.D, W = a.W, Q = a.Q;
  const int64_t ldk = (W + kKeyPad - 1) / kKeyPad * kKeyPad;  // a multiple of kVL too
  const int64_t rows_per_group = G * Q;  // the query rows that read one kv head
  const int64_t chunks = (rows_per_group + kRows - 1) / kRows;
  const T* qp = static_cast<const T*>(a.q);
  const T* kp = static_cast<const T*>(a.k);
  const T* vp = static_cast<const T*>(a.v);
  T* outp = static_cast<T*>(a.out);
  // Pass 1: Kt [D, ldk] and V [W, D] in fp32 per (b, kv head).
  const int64_t groups = a.B * a.Hkv;
  float* kt_all = a.scratch;
  float* v_all = kt_all + groups * D * ldk;
  float* tmp_all = v_all + groups * W * D;  // per thread: scores kRows x ldk, q kRows x D, out
  const int64_t tmp_per_thread = kRows * ldk + 2 * kRows * D;
  const int64_t grain1 = std::max<int64_t>(1, 16384 / std::max<int64_t>(W * D, 1));
  at::parallel_for(0, groups, grain1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t b = g / a.Hkv, h = g % a.Hkv;
      float* kt = kt_all + g * D * ldk;
      float* vf = v_all + g * W * D;
      for (int64_t j = 0; j < W; ++j) {
        const T* kr = kp + b * a.sk_b + h * a.sk_h + j * a.sk_w;
        for (int64_t d = 0; d < D; ++d) kt[d * ldk + j] = to_f(kr[d]);
        load_row(vp + b * a.sv_b + h * a.sv_h + j * a.sv_w, vf + j * D, D);
      }
      for (int64_t d = 0; d < D; ++d)
        for (int64_t j = W; j < ldk; ++j) kt[d * ldk + j] = 0.f;
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
        const T* qr = qp + b * a.sq_b + h * a.sq_h + i * a.sq_q;
        for (int64_t d = 0; d < D; ++d) qf[r * D + d] = to_f(qr[d]) * a.scale;
      }
      const float* kt = kt_all + g * D * ldk;
      for (int64_t j0 = 0; j0 < ldk; j0 += kVL) {
        switch (rows) {
          case 4: score_tile<4>(qf, D, kt, ldk, j0, s, ldk); break;
          case 3: score_tile<3>(qf, D, kt, ldk, j0, s, ldk); break;
          case 2: score_tile<2>(qf, D, kt, ldk, j0, s, ldk); break;
          default: score_tile<1>(qf, D, kt, ldk, j0, s, ldk); break;
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
      const float* vf = v_all + g * W * D;
      for (int64_t d0 = 0; d0 < D; d0 += kVL) {
        switch (rows) {
          case 4: pv_tile<4>(s, ldk, vf, W, D, d0, of); break;
          case 3: pv_tile<3>(s, ldk, vf, W, D, d0, of); break;
          case 2: pv_tile<2>(s, ldk, vf, W, D, d0, of); break;
          default: pv_tile<1>(s, ldk, vf, W, D, d0, of); break;
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

template <typename T>
void rms(const RmsNormArgs& a) {
  const T* x = static_cast<const T*>(a.x);
  const T* w = static_cast<const T*>(a.weight);
  T* y = static_cast<T*>(a.y);
  const int64_t n = a.n;
  at::parallel_for(0, a.rows, std::max<int64_t>(1, 65536 / std::max<int64_t>(n, 1)),
                   [&](int64_t r0, int64_t r1) {
                     for (int64_t r = r0; r < r1; ++r) {
                       const T* xr = x + r * n;
                       T* yr = y + r * n;
                       double ss = 0.0;  // in double: the mean of squares, order-robust
                       for (int64_t i = 0; i < n; ++i) {
                         const float v = to_f(xr[i]);
                         ss += static_cast<double>(v) * v;
                       }
                       const float var = static_cast<float>(ss / static_cast<double>(n));
                       const float inv = 1.f / std::sqrt(var + a.eps);
                       for (int64_t i = 0; i < n; ++i) {
                         const T normed = static_cast<T>(to_f(xr[i]) * inv);
                         yr[i] = static_cast<T>(to_f(w[i]) * to_f(normed));
                       }
                     }
                   });
}

}  // namespace

void decode_attention(const DecodeAttnArgs& a) {
  if (a.dtype == LinearDType::f32) return attention<float>(a);
  return attention<c10::BFloat16>(a);
}

void rms_norm(const RmsNormArgs& a) {
  if (a.dtype == LinearDType::f32) return rms<float>(a);
  return rms<c10::BFloat16>(a);
}

}  // namespace jacobi::cpu::JACOBI_ISA

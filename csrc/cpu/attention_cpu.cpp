// Block-causal flash attention on the CPU: forward (online softmax, saves the log-sum-exp) and
// backward (recomputes P from the lse). Compiled once per vector ISA (see csrc/cpu/isa.h).
//
// Every tile product is an fp32 row-major A * B through at::native::cpublas::brgemm; K^T (and
// V^T) are laid out once per head so no product needs a transposed operand, and bf16/fp16
// inputs are widened to fp32 on load (fp32 accumulation; outputs rounded once). Softmax and the
// elementwise backward are at::vec::Vectorized loops. Memory beyond the outputs: the fp32 K^T /
// V^T copies, per-thread tile buffers, the fp32 lse/delta rows and, in the backward, fp32 dQ
// accumulators (one per key-tile chunk; see AttnBwdArgs).
#include "cpu/attention_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/native/CPUBlas.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>
#include <vector>

namespace jacobi::cpu::JACOBI_ISA {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// C[M x N] (+)= A[M x K] B[K x N], row-major fp32. cpublas::brgemm is the GEMM entry that
// libtorch exports (the cpublas::gemm overloads are internal to libtorch_cpu): a oneDNN JIT
// micro-kernel specialised for the shape where available, else cpublas::gemm (MKL).
inline void mm(int64_t M, int64_t N, int64_t K, const float* A, int64_t lda, const float* B,
               int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  at::native::cpublas::brgemm(M, N, K, lda, ldb, ldc, accumulate, A, B, C, /*is_vnni=*/false);
}

// dst[j * ldd + i] = src[i * lds + j] for i < rows, j < cols, in 16x16 blocks for the caches.
template <typename T>
inline void transpose(const T* src, int64_t lds, int64_t rows, int64_t cols, float* dst,
                      int64_t ldd) {
  constexpr int64_t kB = 16;
  for (int64_t i0 = 0; i0 < rows; i0 += kB)
    for (int64_t j0 = 0; j0 < cols; j0 += kB) {
      const int64_t i1 = std::min(rows, i0 + kB), j1 = std::min(cols, j0 + kB);
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t j = j0; j < j1; ++j) dst[j * ldd + i] = static_cast<float>(src[i * lds + j]);
    }
}

template <typename T>
inline void load_float(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    at::vec::convert(src, dst, n);
  }
}

template <typename T>
inline void store_float(const float* src, T* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    at::vec::convert(src, dst, n);
  }
}

inline float row_max(const float* x, int64_t n) {
  int64_t i = 0;
  float m = kNegInf;
  if (n >= Vec::size()) {
    Vec vm(kNegInf);
    for (; i + Vec::size() <= n; i += Vec::size()) vm = at::vec::maximum(vm, Vec::loadu(x + i));
    m = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, vm);
  }
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// x = exp(x - sub) in place; returns the sum. exp_u20 is ATen's fast exp (what PyTorch's own CPU
// flash attention uses); exp(-inf) = 0 keeps masked entries out.
inline float exp_sub_sum(float* x, int64_t n, float sub) {
  int64_t i = 0;
  const Vec vs(sub);
  Vec acc(0.f);
  for (; i + Vec::size() <= n; i += Vec::size()) {
    Vec e = (Vec::loadu(x + i) - vs).exp_u20();
    e.store(x + i);
    acc = acc + e;
  }
  float s = at::vec::vec_reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, acc);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - sub);
    s += x[i];
  }
  return s;
}

inline void exp_sub(float* x, int64_t n, float sub) {
  int64_t i = 0;
  const Vec vs(sub);
  for (; i + Vec::size() <= n; i += Vec::size()) (Vec::loadu(x + i) - vs).exp_u20().store(x + i);
  for (; i < n; ++i) x[i] = std::exp(x[i] - sub);
}

inline void scale_row(float* x, int64_t n, float a) {
  int64_t i = 0;
  const Vec va(a);
  for (; i + Vec::size() <= n; i += Vec::size()) (Vec::loadu(x + i) * va).store(x + i);
  for (; i < n; ++i) x[i] *= a;
}

// ds = p * (dp - delta), written over dp.
inline void ds_row(const float* p, float* dp, int64_t n, float delta) {
  int64_t i = 0;
  const Vec vd(delta);
  for (; i + Vec::size() <= n; i += Vec::size())
    (Vec::loadu(p + i) * (Vec::loadu(dp + i) - vd)).store(dp + i);
  for (; i < n; ++i) dp[i] = p[i] * (dp[i] - delta);
}

inline float dot_row(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  Vec acc(0.f);
  for (; i + Vec::size() <= n; i += Vec::size())
    acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float s = at::vec::vec_reduce_all<float>([](Vec& x, Vec& y) { return x + y; }, acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// Sets the scores of invisible (query, key) pairs of a PARTIAL tile pair to -inf. The tile is
// walked in rectangles of one query block x one key block, so the block table is consulted
// once per rectangle, never per element.
void apply_mask(float* s, int64_t lds, int32_t r0, int M, int32_t c0, int N, const int32_t* tb,
                const BlockTable& t) {
  for (int i0 = 0; i0 < M;) {
    const int qb = tb[r0 + i0];
    int i1 = i0 + 1;
    while (i1 < M && tb[r0 + i1] == qb) ++i1;
    for (int j0 = 0; j0 < N;) {
      const int kb = tb[c0 + j0];
      int j1 = j0 + 1;
      while (j1 < N && tb[c0 + j1] == kb) ++j1;
      if (kb == qb) {
        for (int i = i0; i < i1; ++i) {
          // key c0 + j is visible iff c0 + j <= r0 + i
          const int first_hidden = std::max(j0, r0 + i - c0 + 1);
          for (int j = first_hidden; j < j1; ++j) s[i * lds + j] = kNegInf;
        }
      } else if (!(kb < qb && block_visible(t, qb, kb))) {
        for (int i = i0; i < i1; ++i)
          for (int j = j0; j < j1; ++j) s[i * lds + j] = kNegInf;
      }
      j0 = j1;
    }
    i0 = i1;
  }
}

// Runs items 0..n-1 (in the given order: most expensive first) on all threads, each thread
// pulling the next item from a shared counter. Items write disjoint outputs, so the result does
// not depend on which thread ran what.
template <typename Buf, typename MakeBuf, typename F>
void run_items(const std::vector<int64_t>& order, MakeBuf&& make_buf, F&& f) {
  const int64_t n = static_cast<int64_t>(order.size());
  if (n == 0) return;
  std::atomic<int64_t> next{0};
  const int64_t nt = std::min<int64_t>(at::get_num_threads(), n);
  at::parallel_for(0, nt, 1, [&](int64_t, int64_t) {
    Buf buf = make_buf();
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) f(order[i], buf);
  });
}

std::vector<int64_t> order_by_cost(const std::vector<int64_t>& cost) {
  std::vector<int64_t> order(cost.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  return order;
}

int max_tile(const std::vector<int32_t>& st) {
  int m = 0;
  for (size_t i = 0; i + 1 < st.size(); ++i) m = std::max(m, st[i + 1] - st[i]);
  return m;
}

// Rows [r0, r0 + M) of one head as fp32 times `mult`, into dst [M x D]. The copy makes every
// GEMM operand fp32 (bf16/fp16 inputs are widened once per tile) and folds the softmax scale in.
template <typename T>
inline void load_rows(const T* src, int64_t lds, int64_t M, int64_t D, float mult, float* dst) {
  for (int64_t i = 0; i < M; ++i) {
    load_float(src + i * lds, dst + i * D, D);
    if (mult != 1.f) scale_row(dst + i * D, D, mult);
  }
}

// K^T (and V^T / widened K or V) of every (batch, kv head) in fp32, so that all tile products
// are plain row-major A * B. O(S * D) per head, computed once per call.
template <typename T>
void prepare_kv(const AttnDims& d, const T* x, Strides4 sx, float* xt, float* xf) {
  const int64_t S = d.S, D = d.D;
  constexpr int64_t kRows = 64;
  const int64_t chunks = (S + kRows - 1) / kRows;
  at::parallel_for(0, d.B * d.Hkv * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t c = it % chunks, bh = it / chunks, h = bh % d.Hkv, b = bh / d.Hkv;
      const int64_t r0 = c * kRows, r1 = std::min(S, r0 + kRows);
      const T* src = x + b * sx.b + h * sx.h + r0 * sx.s;
      if (xt != nullptr) transpose(src, sx.s, r1 - r0, D, xt + bh * D * S + r0, S);
      if (xf != nullptr)
        for (int64_t r = r0; r < r1; ++r)
          load_float(src + (r - r0) * sx.s, xf + (bh * S + r) * D, D);
    }
  });
}

// ---- forward --------------------------------------------------------------------------------

struct FwdBuf {
  std::vector<float> q, s, acc, m, l;
};

template <typename T>
void fwd_impl(const AttnFwdArgs& a, const AttnPlan& plan, const BlockTable& table) {
  const auto& d = a.dims;
  const int64_t D = d.D, G = d.Hq / d.Hkv, S = d.S;
  const int bq = max_tile(plan.q_start), bk = max_tile(plan.k_start);
  const int nq = plan.num_q_tiles();
  const T* q = static_cast<const T*>(a.q);
  const T* v = static_cast<const T*>(a.v);
  T* out = static_cast<T*>(a.out);
  prepare_kv<T>(d, static_cast<const T*>(a.k), a.sk, a.kt, nullptr);
  if (a.vf != nullptr) prepare_kv<T>(d, v, a.sv, nullptr, a.vf);

  // item = (b * Hq + h) * nq + qt
  std::vector<int64_t> cost(d.B * d.Hq * nq);
  for (int64_t bh = 0; bh < d.B * d.Hq; ++bh)
    for (int qt = 0; qt < nq; ++qt) cost[bh * nq + qt] = plan.q_cost[qt];
  const auto order = order_by_cost(cost);

  auto make_buf = [&] {
    FwdBuf b;
    b.q.resize(static_cast<size_t>(bq) * D);
    b.s.resize(static_cast<size_t>(bq) * bk);
    b.acc.resize(static_cast<size_t>(bq) * D);
    b.m.resize(bq);
    b.l.resize(bq);
    return b;
  };
  run_items<FwdBuf>(order, make_buf, [&](int64_t item, FwdBuf& buf) {
    const int qt = static_cast<int>(item % nq);
    const int64_t h = (item / nq) % d.Hq, b = item / nq / d.Hq, bhk = b * d.Hkv + h / G;
    const int32_t r0 = plan.q_start[qt], r1 = plan.q_start[qt + 1];
    const int M = r1 - r0;
    float* qs = buf.q.data();
    load_rows(q + b * a.sq.b + h * a.sq.h + r0 * a.sq.s, a.sq.s, M, D, a.scale, qs);
    const float* kt = a.kt + bhk * D * S;
    const float* vrows;
    int64_t ldv;
    if (a.vf != nullptr) {
      vrows = a.vf + bhk * S * D;
      ldv = D;
    } else {
      vrows = reinterpret_cast<const float*>(v) + b * a.sv.b + (h / G) * a.sv.h;
      ldv = a.sv.s;
    }
    float* s = buf.s.data();
    float* acc = buf.acc.data();
    std::fill(acc, acc + static_cast<size_t>(M) * D, 0.f);
    std::fill(buf.m.begin(), buf.m.begin() + M, kNegInf);
    std::fill(buf.l.begin(), buf.l.begin() + M, 0.f);

    for (int e = plan.fwd_ptr[qt]; e < plan.fwd_ptr[qt + 1]; ++e) {
      const int ktile = plan.fwd_kt[e];
      const int32_t c0 = plan.k_start[ktile];
      const int N = plan.k_start[ktile + 1] - c0;
      mm(M, N, D, qs, D, kt + c0, S, s, bk, false);  // scale * Q K^T
      if (plan.fwd_partial[e]) apply_mask(s, bk, r0, M, c0, N, plan.token_block.data(), table);
      for (int i = 0; i < M; ++i) {
        float* row = s + static_cast<int64_t>(i) * bk;
        const float m_old = buf.m[i];
        const float m_new = std::max(m_old, row_max(row, N));
        if (m_new == kNegInf) {  // nothing visible to this row yet
          std::fill(row, row + N, 0.f);
          continue;
        }
        const float sum = exp_sub_sum(row, N, m_new);
        const float corr = std::exp(m_old - m_new);  // 0 when m_old = -inf
        buf.l[i] = buf.l[i] * corr + sum;
        if (corr != 1.f) scale_row(acc + static_cast<int64_t>(i) * D, D, corr);
        buf.m[i] = m_new;
      }
      mm(M, D, N, s, bk, vrows + c0 * ldv, ldv, acc, D, true);  // O += P V
    }
    T* op = out + ((b * d.Hq + h) * S + r0) * D;
    float* lp = a.lse + (b * d.Hq + h) * S + r0;
    for (int i = 0; i < M; ++i) {
      const float l = buf.l[i];
      float* arow = acc + static_cast<int64_t>(i) * D;
      // Every row sees at least itself, so l > 0; the guard keeps a malformed table finite.
      scale_row(arow, D, l > 0.f ? 1.f / l : 0.f);
      store_float(arow, op + static_cast<int64_t>(i) * D, D);
      lp[i] = l > 0.f ? buf.m[i] + std::log(l) : kNegInf;
    }
  });
}

// ---- backward -------------------------------------------------------------------------------

struct BwdBuf {
  std::vector<float> q, dout, s, dp, t, dk, dv;
};

template <typename T>
void bwd_impl(const AttnBwdArgs& a, const AttnPlan& plan, const BlockTable& table) {
  const auto& d = a.dims;
  const int64_t D = d.D, G = d.Hq / d.Hkv, S = d.S;
  const int bq = max_tile(plan.q_start), bk = max_tile(plan.k_start);
  const int nk = plan.num_k_tiles();
  const int C = std::max(1, std::min(a.chunks, nk));
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  const T* dout = static_cast<const T*>(a.dout);
  const T* out = static_cast<const T*>(a.out);
  T* dq = static_cast<T*>(a.dq);
  T* dk = static_cast<T*>(a.dk);
  T* dv = static_cast<T*>(a.dv);
  // fp32 with one chunk accumulates straight into dq.
  float* dq_acc = a.dq_acc != nullptr ? a.dq_acc : reinterpret_cast<float*>(a.dq);
  const int64_t acc_size = d.B * d.Hq * S * D;
  prepare_kv<T>(d, k, a.sk, a.kt, a.kf);
  prepare_kv<T>(d, v, a.sv, a.vt, nullptr);

  // delta = rowsum(dout * out), and zeroed dQ accumulators.
  const int64_t rows = d.B * d.Hq * S;
  at::parallel_for(0, rows, 256, [&](int64_t r_begin, int64_t r_end) {
    std::vector<float> x(D), y(D);
    for (int64_t r = r_begin; r < r_end; ++r) {
      const int64_t s_ = r % S, bh = r / S, h = bh % d.Hq, b = bh / d.Hq;
      load_float(dout + b * a.sdo.b + h * a.sdo.h + s_ * a.sdo.s, x.data(), D);
      load_float(out + b * a.so.b + h * a.so.h + s_ * a.so.s, y.data(), D);
      a.delta[r] = dot_row(x.data(), y.data(), D);
      for (int c = 0; c < C; ++c) std::fill_n(dq_acc + c * acc_size + r * D, D, 0.f);
    }
  });

  // item = (b * Hkv + hk) * C + chunk; chunk c owns key tiles c, c + C, c + 2C, ...
  std::vector<int64_t> cost(d.B * d.Hkv * C, 0);
  for (int64_t bh = 0; bh < d.B * d.Hkv; ++bh)
    for (int kt = 0; kt < nk; ++kt) cost[bh * C + kt % C] += plan.k_cost[kt];
  const auto order = order_by_cost(cost);

  auto make_buf = [&] {
    BwdBuf b;
    b.q.resize(static_cast<size_t>(bq) * D);
    b.dout.resize(static_cast<size_t>(bq) * D);
    b.s.resize(static_cast<size_t>(bq) * bk);
    b.dp.resize(static_cast<size_t>(bq) * bk);
    b.t.resize(static_cast<size_t>(bq) * bk);
    b.dk.resize(static_cast<size_t>(bk) * D);
    b.dv.resize(static_cast<size_t>(bk) * D);
    return b;
  };
  run_items<BwdBuf>(order, make_buf, [&](int64_t item, BwdBuf& buf) {
    const int chunk = static_cast<int>(item % C);
    const int64_t hk = (item / C) % d.Hkv, b = item / C / d.Hkv, bhk = b * d.Hkv + hk;
    const float* kt = a.kt + bhk * D * S;
    const float* vt = a.vt + bhk * D * S;
    const float* krows;
    int64_t ldk;
    if (a.kf != nullptr) {
      krows = a.kf + bhk * S * D;
      ldk = D;
    } else {
      krows = reinterpret_cast<const float*>(k) + b * a.sk.b + hk * a.sk.h;
      ldk = a.sk.s;
    }
    float* dqc = dq_acc + chunk * acc_size;
    float *s = buf.s.data(), *dp = buf.dp.data(), *tr = buf.t.data();
    float *qs = buf.q.data(), *dos = buf.dout.data();
    for (int ktile = chunk; ktile < nk; ktile += C) {
      const int32_t c0 = plan.k_start[ktile];
      const int N = plan.k_start[ktile + 1] - c0;
      std::fill_n(buf.dk.data(), static_cast<size_t>(N) * D, 0.f);
      std::fill_n(buf.dv.data(), static_cast<size_t>(N) * D, 0.f);
      for (int e = plan.bwd_ptr[ktile]; e < plan.bwd_ptr[ktile + 1]; ++e) {
        const int qt = plan.bwd_qt[e];
        const int32_t r0 = plan.q_start[qt];
        const int M = plan.q_start[qt + 1] - r0;
        for (int64_t g = 0; g < G; ++g) {
          const int64_t h = hk * G + g;
          load_rows(q + b * a.sq.b + h * a.sq.h + r0 * a.sq.s, a.sq.s, M, D, a.scale, qs);
          load_rows(dout + b * a.sdo.b + h * a.sdo.h + r0 * a.sdo.s, a.sdo.s, M, D, 1.f, dos);
          const float* lse = a.lse + (b * d.Hq + h) * S + r0;
          const float* delta = a.delta + (b * d.Hq + h) * S + r0;
          // P = exp(scale * Q K^T - lse)
          mm(M, N, D, qs, D, kt + c0, S, s, bk, false);
          if (plan.bwd_partial[e]) apply_mask(s, bk, r0, M, c0, N, plan.token_block.data(), table);
          for (int i = 0; i < M; ++i) {
            float* row = s + static_cast<int64_t>(i) * bk;
            if (lse[i] == kNegInf) {
              std::fill(row, row + N, 0.f);
            } else {
              exp_sub(row, N, lse[i]);
            }
          }
          // dP = dO V^T; dS = P * (dP - delta)
          mm(M, N, D, dos, D, vt + c0, S, dp, bk, false);
          for (int i = 0; i < M; ++i)
            ds_row(s + static_cast<int64_t>(i) * bk, dp + static_cast<int64_t>(i) * bk, N,
                   delta[i]);
          // dV += P^T dO; dK += dS^T (scale Q); dQ += dS K (scaled once at the end)
          transpose(s, bk, M, N, tr, bq);
          mm(N, D, M, tr, bq, dos, D, buf.dv.data(), D, true);
          transpose(dp, bk, M, N, tr, bq);
          mm(N, D, M, tr, bq, qs, D, buf.dk.data(), D, true);
          mm(M, D, N, dp, bk, krows + c0 * ldk, ldk, dqc + ((b * d.Hq + h) * S + r0) * D, D, true);
        }
      }
      store_float(buf.dk.data(), dk + (bhk * S + c0) * D, static_cast<int64_t>(N) * D);
      store_float(buf.dv.data(), dv + (bhk * S + c0) * D, static_cast<int64_t>(N) * D);
    }
  });

  // dQ = scale * (sum of the chunk accumulators, in chunk order: deterministic).
  at::parallel_for(0, rows, 256, [&](int64_t r_begin, int64_t r_end) {
    std::vector<float> x(D);
    for (int64_t r = r_begin; r < r_end; ++r) {
      std::copy_n(dq_acc + r * D, D, x.data());
      for (int c = 1; c < C; ++c) {
        const float* src = dq_acc + c * acc_size + r * D;
        for (int64_t j = 0; j < D; ++j) x[j] += src[j];
      }
      scale_row(x.data(), D, a.scale);
      store_float(x.data(), dq + r * D, D);
    }
  });
}

}  // namespace

void block_attention_fwd(const AttnFwdArgs& args, const AttnPlan& plan, const BlockTable& table) {
  switch (args.dtype) {
    case DType::f32:
      return fwd_impl<float>(args, plan, table);
    case DType::bf16:
      return fwd_impl<c10::BFloat16>(args, plan, table);
    case DType::f16:
      return fwd_impl<c10::Half>(args, plan, table);
  }
}

void block_attention_bwd(const AttnBwdArgs& args, const AttnPlan& plan, const BlockTable& table) {
  switch (args.dtype) {
    case DType::f32:
      return bwd_impl<float>(args, plan, table);
    case DType::bf16:
      return bwd_impl<c10::BFloat16>(args, plan, table);
    case DType::f16:
      return bwd_impl<c10::Half>(args, plan, table);
  }
}

}  // namespace jacobi::cpu::JACOBI_ISA

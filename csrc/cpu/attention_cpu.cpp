// Block-causal flash attention on the CPU: forward (online softmax, saves the log-sum-exp) and
// backward (recomputes P from the lse). Compiled once per vector ISA (see csrc/cpu/isa.h).
//
// Every tile product is an fp32 row-major A * B through at::native::cpublas::brgemm; operands
// are laid out once per call (K^T, and in the backward group-interleaved Q / dO and their
// transposes) so that no product needs a transposed operand, and bf16/fp16 inputs are widened to
// fp32 there (fp32 accumulation; outputs rounded once). Softmax and the elementwise backward are
// at::vec::Vectorized loops. Memory beyond the outputs is O(B * H * S * D): those layouts, the
// fp32 dQ^T accumulators (one per key-tile chunk) and per-thread tile buffers.
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

#include "jacobi/online_softmax.h"

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

// dst[j * ldd + i] = src[i * lds + j] for i < rows, j < cols. fp32 goes through ATen's
// (AVX-512 16x16 register) transpose; widening sources in 16x16 blocks for the caches.
template <typename T>
inline void transpose(const T* src, int64_t lds, int64_t rows, int64_t cols, float* dst,
                      int64_t ldd) {
  constexpr int64_t kB = 16;
  for (int64_t i0 = 0; i0 < rows; i0 += kB)
    for (int64_t j0 = 0; j0 < cols; j0 += kB) {
      const int64_t i1 = std::min(rows, i0 + kB), j1 = std::min(cols, j0 + kB);
      if constexpr (std::is_same_v<T, float>) {
        at::vec::transpose_mxn<float>(src + i0 * lds + j0, lds, dst + j0 * ldd + i0, ldd,
                                      static_cast<int>(i1 - i0), static_cast<int>(j1 - j0));
      } else {
        for (int64_t i = i0; i < i1; ++i)
          for (int64_t j = j0; j < j1; ++j) dst[j * ldd + i] = static_cast<float>(src[i * lds + j]);
      }
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

inline void scale_row(float* x, int64_t n, float a) {
  int64_t i = 0;
  const Vec va(a);
  for (; i + Vec::size() <= n; i += Vec::size()) (Vec::loadu(x + i) * va).store(x + i);
  for (; i < n; ++i) x[i] *= a;
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

// Tokens [t0, t0 + M) (processing order) of one head as fp32 times `mult`, into dst [M x D];
// row_of maps a token to its memory row. The copy makes every GEMM operand fp32 (bf16/fp16 are
// widened once per tile), folds the softmax scale in and applies the token order.
template <typename T>
inline void load_rows(const T* head, int64_t lds, const int32_t* row_of, int64_t t0, int64_t M,
                      int64_t D, float mult, float* dst, int64_t ldd) {
  for (int64_t i = 0; i < M; ++i) {
    load_float(head + row_of[t0 + i] * lds, dst + i * ldd, D);
    if (mult != 1.f) scale_row(dst + i * ldd, D, mult);
  }
}

// Runs f(b, h, r0, r1) over (batch, head, 64-token chunk) in parallel: the O(S * D) layout passes.
template <typename F>
void for_row_chunks(int64_t B, int64_t H, int64_t S, F&& f) {
  constexpr int64_t kRows = 64;
  const int64_t chunks = (S + kRows - 1) / kRows;
  at::parallel_for(0, B * H * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t it = begin; it < end; ++it) {
      const int64_t c = it % chunks, bh = it / chunks;
      f(bh / H, bh % H, c * kRows, std::min(S, (c + 1) * kRows));
    }
  });
}

// Tokens [r0, r1) of kv head (b, h): x in processing order as fp32 rows into xf
// [B, Hkv, S, D] and, if xt is given, transposed into xt [B, Hkv, D, S].
template <typename T>
void prepare_kv_rows(const AttnDims& d, const T* x, Strides4 sx, const int32_t* row_of, int64_t b,
                     int64_t h, int64_t r0, int64_t r1, float* xt, float* xf) {
  const int64_t S = d.S, D = d.D, bh = b * d.Hkv + h;
  float* rows = xf + (bh * S + r0) * D;
  load_rows(x + b * sx.b + h * sx.h, sx.s, row_of, r0, r1 - r0, D, 1.f, rows, D);
  if (xt != nullptr) transpose(rows, D, r1 - r0, D, xt + bh * D * S + r0, S);
}

// ---- forward --------------------------------------------------------------------------------
//
// Work item = (batch, kv head, query tile), with the G = Hq / Hkv query heads of the group
// stacked into one [G*M x D] operand: every tile product is a single GEMM with G times the rows,
// and K^T / V tiles are read once per group. fp32 workspace, in the table's processing order:
// K^T [B, Hkv, D, S], K [B, Hkv, S, D], V [B, Hkv, S, D].

struct FwdBuf {
  std::vector<float> q, s, acc;
  std::vector<jacobi::attn::SoftmaxRow> rows;  // online softmax (jacobi/online_softmax.h)
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
  const int32_t* row_of = a.row_of;
  const int64_t kv = d.B * d.Hkv * S * D;
  float* ws_kt = a.workspace;
  float* ws_k = ws_kt + kv;
  float* ws_v = ws_k + kv;
  // One parallel pass for both (each pass ends in a barrier, which costs a scheduler time slice
  // whenever a thread has been preempted on a busy machine).
  for_row_chunks(d.B, d.Hkv, S, [&](int64_t b, int64_t h, int64_t r0, int64_t r1) {
    prepare_kv_rows(d, static_cast<const T*>(a.k), a.sk, row_of, b, h, r0, r1, ws_kt, ws_k);
    prepare_kv_rows(d, v, a.sv, row_of, b, h, r0, r1, nullptr, ws_v);
  });

  std::vector<int64_t> cost(d.B * d.Hkv * nq);
  for (int64_t bh = 0; bh < d.B * d.Hkv; ++bh)
    for (int qt = 0; qt < nq; ++qt) cost[bh * nq + qt] = plan.q_cost[qt];
  const auto order = order_by_cost(cost);

  const int64_t gbq = G * bq;
  auto make_buf = [&] {
    FwdBuf b;
    b.q.resize(gbq * D);
    b.s.resize(gbq * bk);
    b.acc.resize(gbq * D);
    b.rows.resize(gbq);
    return b;
  };
  run_items<FwdBuf>(order, make_buf, [&](int64_t item, FwdBuf& buf) {
    const int qt = static_cast<int>(item % nq);
    const int64_t bhk = item / nq, b = bhk / d.Hkv, hk = bhk % d.Hkv;
    const int32_t r0 = plan.q_start[qt], r1 = plan.q_start[qt + 1];
    const int64_t M = r1 - r0, GM = G * M;
    float* qs = buf.q.data();  // row g * M + i: head hk * G + g, token r0 + i
    for (int64_t g = 0; g < G; ++g)
      load_rows(q + b * a.sq.b + (hk * G + g) * a.sq.h, a.sq.s, row_of, r0, M, D, a.scale,
                qs + g * M * D, D);
    const float* kt = ws_kt + bhk * D * S;
    const float* vrows = ws_v + bhk * S * D;
    const int64_t ldv = D;
    float* s = buf.s.data();
    float* acc = buf.acc.data();
    std::fill_n(acc, GM * D, 0.f);
    std::fill_n(buf.rows.begin(), GM, jacobi::attn::softmax_init());

    for (int e = plan.fwd_ptr[qt]; e < plan.fwd_ptr[qt + 1]; ++e) {
      const int ktile = plan.fwd_kt[e];
      const int32_t c0 = plan.k_start[ktile];
      const int N = plan.k_start[ktile + 1] - c0;
      mm(GM, N, D, qs, D, kt + c0, S, s, bk, false);  // scale * Q K^T
      if (plan.fwd_partial[e])
        for (int64_t g = 0; g < G; ++g)
          apply_mask(s + g * M * bk, bk, r0, M, c0, N, plan.token_block.data(), table);
      for (int64_t i = 0; i < GM; ++i) {
        float* row = s + i * bk;
        // Scores are pre-scaled: units are natural logits (to_log2 = log2 e).
        jacobi::attn::SoftmaxRow& st = buf.rows[i];
        const float corr = jacobi::attn::softmax_rescale(st, row_max(row, N), jacobi::attn::kLog2e);
        if (st.max == kNegInf) {  // nothing visible to this row yet
          std::fill(row, row + N, 0.f);
          continue;
        }
        const float sum = exp_sub_sum(row, N, jacobi::attn::softmax_exp_base(st));
        jacobi::attn::softmax_add(st, corr, sum);
        if (corr != 1.f) scale_row(acc + i * D, D, corr);
      }
      mm(GM, D, N, s, bk, vrows + c0 * ldv, ldv, acc, D, true);  // O += P V
    }
    for (int64_t g = 0; g < G; ++g) {
      const int64_t bh = b * d.Hq + hk * G + g;
      for (int64_t i = 0; i < M; ++i) {
        const int64_t row = g * M + i;
        const jacobi::attn::SoftmaxRow& st = buf.rows[row];
        float* arow = acc + row * D;
        // Every row sees at least itself, so sum > 0; a malformed table gives 0 and lse -inf.
        scale_row(arow, D, jacobi::attn::softmax_inv_sum(st));
        const int64_t mem = row_of[r0 + i];
        store_float(arow, out + (bh * S + mem) * D, D);
        a.lse[bh * S + mem] = jacobi::attn::softmax_lse(st, 1.f);
      }
    }
  });
}

// ---- backward -------------------------------------------------------------------------------
//
// Computed transposed, key rows x query columns, so that every product is a plain A * B with no
// per-tile transpose: S^T = K Q^T, dP^T = V dO^T, dV += P^T dO, dK += dS^T Q, dQ^T += K^T dS^T.
// The G query heads of a kv group are interleaved into one column space, column c = s * G + g
// (token s, head hk * G + g), so a query tile of all G heads is one contiguous column range.
// fp32 workspace, in order:
//   kt     K^T                 [B, Hkv, D, S]
//   qt     Q^T                 [B, Hkv, D, S*G]      (columns c = s*G + g)
//   qr     Q                   [B, Hkv, S*G, D]
//   dot    dO^T                [B, Hkv, D, S*G]
//   dor    dO                  [B, Hkv, S*G, D]
//   lse    lse (-inf -> +inf)  [B, Hkv, S*G]
//   delta  rowsum(dO * O)      [B, Hkv, S*G]
//   dqt    dQ^T per chunk      [chunks, B, Hkv, D, S*G]
//   kf, vf K, V as fp32 rows   [B, Hkv, S, D]
// All in the table's processing order; AttnBwdArgs::row_of maps back to memory rows.

// Transposed mask: rows are keys [c0, c0 + N), columns are queries [r0, r0 + M) x G heads.
void apply_mask_t(float* s, int64_t lds, int32_t c0, int N, int32_t r0, int M, int64_t G,
                  const int32_t* tb, const BlockTable& t) {
  for (int j0 = 0; j0 < N;) {
    const int kb = tb[c0 + j0];
    int j1 = j0 + 1;
    while (j1 < N && tb[c0 + j1] == kb) ++j1;
    for (int i0 = 0; i0 < M;) {
      const int qb = tb[r0 + i0];
      int i1 = i0 + 1;
      while (i1 < M && tb[r0 + i1] == qb) ++i1;
      if (kb == qb) {
        for (int j = j0; j < j1; ++j) {
          // query r0 + i sees key c0 + j iff c0 + j <= r0 + i
          const int hidden_end = std::min(i1, std::max(i0, c0 + j - r0));
          std::fill(s + j * lds + i0 * G, s + j * lds + hidden_end * G, kNegInf);
        }
      } else if (!(kb < qb && block_visible(t, qb, kb))) {
        for (int j = j0; j < j1; ++j)
          std::fill(s + j * lds + i0 * G, s + j * lds + i1 * G, kNegInf);
      }
      i0 = i1;
    }
    j0 = j1;
  }
}

// x = exp(x * scale - lse[c]) along a row of S^T.
inline void exp_scale_sub(float* x, const float* lse, int64_t n, float scale) {
  int64_t i = 0;
  const Vec vs(scale);
  for (; i + Vec::size() <= n; i += Vec::size())
    at::vec::fmsub(Vec::loadu(x + i), vs, Vec::loadu(lse + i)).exp_u20().store(x + i);
  for (; i < n; ++i) x[i] = std::exp(x[i] * scale - lse[i]);
}

// dp = p * (dp - delta[c]) along a row.
inline void ds_row_vec(const float* p, float* dp, const float* delta, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::size() <= n; i += Vec::size())
    (Vec::loadu(p + i) * (Vec::loadu(dp + i) - Vec::loadu(delta + i))).store(dp + i);
  for (; i < n; ++i) dp[i] = p[i] * (dp[i] - delta[i]);
}

struct BwdBuf {
  std::vector<float> pt, dpt, dk, dv;
};

template <typename T>
void bwd_impl(const AttnBwdArgs& a, const AttnPlan& plan, const BlockTable& table) {
  const auto& d = a.dims;
  const int64_t D = d.D, G = d.Hq / d.Hkv, S = d.S, SG = S * G;
  const int bq = max_tile(plan.q_start), bk = max_tile(plan.k_start);
  const int nk = plan.num_k_tiles();
  const int C = std::max(1, a.chunks);
  const T* q = static_cast<const T*>(a.q);
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  const T* dout = static_cast<const T*>(a.dout);
  const T* out = static_cast<const T*>(a.out);
  const int64_t kv = d.B * d.Hkv * S * D, qo = d.B * d.Hq * S * D, nrows = d.B * d.Hq * S;
  float* ws_kt = a.workspace;
  float* ws_qt = ws_kt + kv;
  float* ws_qr = ws_qt + qo;
  float* ws_dot = ws_qr + qo;
  float* ws_dor = ws_dot + qo;
  float* ws_lse = ws_dor + qo;
  float* ws_delta = ws_lse + nrows;
  float* ws_dqt = ws_delta + nrows;
  float* ws_kf = ws_dqt + C * qo;
  float* ws_vf = ws_kf + kv;
  const int32_t* row_of = a.row_of;

  // One parallel pass: K, V (rows, K^T) and the group-interleaved Q, dO (rows and transposed),
  // lse and delta, all in processing order.
  for_row_chunks(d.B, d.Hkv, S, [&](int64_t b, int64_t hk, int64_t r0, int64_t r1) {
    prepare_kv_rows(d, k, a.sk, row_of, b, hk, r0, r1, ws_kt, ws_kf);
    prepare_kv_rows(d, v, a.sv, row_of, b, hk, r0, r1, nullptr, ws_vf);
    const int64_t bhk = b * d.Hkv + hk, n = (r1 - r0) * G;
    float* qr = ws_qr + (bhk * SG + r0 * G) * D;
    float* dor = ws_dor + (bhk * SG + r0 * G) * D;
    std::vector<float> orow(D);
    for (int64_t s_ = r0; s_ < r1; ++s_) {
      for (int64_t g = 0; g < G; ++g) {
        const int64_t h = hk * G + g, c = (s_ - r0) * G + g, bh = b * d.Hq + h;
        const int64_t mem = row_of[s_];
        load_float(q + b * a.sq.b + h * a.sq.h + mem * a.sq.s, qr + c * D, D);
        load_float(dout + b * a.sdo.b + h * a.sdo.h + mem * a.sdo.s, dor + c * D, D);
        load_float(out + b * a.so.b + h * a.so.h + mem * a.so.s, orow.data(), D);
        const float lse = a.lse[bh * S + mem];
        ws_lse[bhk * SG + s_ * G + g] =
            lse == kNegInf ? std::numeric_limits<float>::infinity() : lse;
        ws_delta[bhk * SG + s_ * G + g] = dot_row(dor + c * D, orow.data(), D);
      }
    }
    transpose(qr, D, n, D, ws_qt + bhk * D * SG + r0 * G, SG);
    transpose(dor, D, n, D, ws_dot + bhk * D * SG + r0 * G, SG);
  });
  // touched[(chunk * B * Hkv + bhk) * nq + qt]: the chunk wrote that query tile's dQ^T columns.
  // The first write overwrites instead of accumulating, so the accumulators need no zeroing
  // pass (which would also page in C fresh buffers up front).
  const int nq = plan.num_q_tiles();
  std::vector<uint8_t> touched(static_cast<size_t>(C) * d.B * d.Hkv * nq, 0);

  // item = (b * Hkv + hk) * C + chunk. Key tiles go to chunks greedily, most expensive first,
  // each to the chunk with the least work so far: equal items balance best on the threads.
  std::vector<std::vector<int>> chunk_tiles(C);
  std::vector<int64_t> chunk_cost(C, 0);
  for (int64_t kt : order_by_cost(plan.k_cost)) {
    const int c = static_cast<int>(std::min_element(chunk_cost.begin(), chunk_cost.end()) -
                                   chunk_cost.begin());
    chunk_tiles[c].push_back(static_cast<int>(kt));
    chunk_cost[c] += plan.k_cost[kt];
  }
  std::vector<int64_t> cost(d.B * d.Hkv * C);
  for (int64_t i = 0; i < static_cast<int64_t>(cost.size()); ++i) cost[i] = chunk_cost[i % C];
  const auto order = order_by_cost(cost);

  const int64_t ldt = G * bq;  // leading dim of the [N x G*M] tiles
  auto make_buf = [&] {
    BwdBuf b;
    b.pt.resize(bk * ldt);
    b.dpt.resize(bk * ldt);
    b.dk.resize(bk * D);
    b.dv.resize(bk * D);
    return b;
  };
  T* dk = static_cast<T*>(a.dk);
  T* dv = static_cast<T*>(a.dv);
  run_items<BwdBuf>(order, make_buf, [&](int64_t item, BwdBuf& buf) {
    const int chunk = static_cast<int>(item % C);
    const int64_t bhk = item / C, b = bhk / d.Hkv, hk = bhk % d.Hkv;
    const float* kt = ws_kt + bhk * D * S;
    const float* krows = ws_kf + bhk * S * D;
    const float* vrows = ws_vf + bhk * S * D;
    const int64_t ldk = D, ldv = D;
    const float* qt = ws_qt + bhk * D * SG;
    const float* qr = ws_qr + bhk * SG * D;
    const float* dot = ws_dot + bhk * D * SG;
    const float* dor = ws_dor + bhk * SG * D;
    const float* lse = ws_lse + bhk * SG;
    const float* delta = ws_delta + bhk * SG;
    float* dqt = ws_dqt + chunk * qo + bhk * D * SG;
    uint8_t* seen = touched.data() + (chunk * d.B * d.Hkv + bhk) * nq;
    float *pt = buf.pt.data(), *dpt = buf.dpt.data();
    for (const int ktile : chunk_tiles[chunk]) {
      const int32_t c0 = plan.k_start[ktile];
      const int64_t N = plan.k_start[ktile + 1] - c0;
      std::fill_n(buf.dk.data(), N * D, 0.f);
      std::fill_n(buf.dv.data(), N * D, 0.f);
      for (int e = plan.bwd_ptr[ktile]; e < plan.bwd_ptr[ktile + 1]; ++e) {
        const int qtile = plan.bwd_qt[e];
        const int32_t r0 = plan.q_start[qtile];
        const int64_t M = plan.q_start[qtile + 1] - r0, GM = G * M, col0 = r0 * G;
        // P^T = exp(scale * K Q^T - lse)
        mm(N, GM, D, krows + c0 * ldk, ldk, qt + col0, SG, pt, ldt, false);
        if (plan.bwd_partial[e])
          apply_mask_t(pt, ldt, c0, static_cast<int>(N), r0, static_cast<int>(M), G,
                       plan.token_block.data(), table);
        for (int64_t j = 0; j < N; ++j) exp_scale_sub(pt + j * ldt, lse + col0, GM, a.scale);
        // dS^T = P^T * (V dO^T - delta)
        mm(N, GM, D, vrows + c0 * ldv, ldv, dot + col0, SG, dpt, ldt, false);
        for (int64_t j = 0; j < N; ++j) ds_row_vec(pt + j * ldt, dpt + j * ldt, delta + col0, GM);
        mm(N, D, GM, pt, ldt, dor + col0 * D, D, buf.dv.data(), D, true);  // dV += P^T dO
        mm(N, D, GM, dpt, ldt, qr + col0 * D, D, buf.dk.data(), D, true);  // dK += dS^T Q
        // dQ^T += K^T dS^T
        mm(D, GM, N, kt + c0, S, dpt, ldt, dqt + col0, SG, seen[qtile] != 0);
        seen[qtile] = 1;
      }
      // dK carries the softmax scale (S = scale * Q K^T); dV does not.
      scale_row(buf.dk.data(), N * D, a.scale);
      for (int64_t j = 0; j < N; ++j) {
        const int64_t mem = row_of[c0 + j];
        store_float(buf.dk.data() + j * D, dk + (bhk * S + mem) * D, D);
        store_float(buf.dv.data() + j * D, dv + (bhk * S + mem) * D, D);
      }
    }
  });

  // dQ = scale * (sum of the chunks' dQ^T, in chunk order: deterministic), back to [B, Hq, S, D],
  // one (batch, kv head, query tile) at a time.
  T* dq = static_cast<T*>(a.dq);
  at::parallel_for(0, d.B * d.Hkv * nq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> sum, rows;
    for (int64_t it = begin; it < end; ++it) {
      const int qtile = static_cast<int>(it % nq);
      const int64_t bhk = it / nq, b = bhk / d.Hkv, hk = bhk % d.Hkv;
      const int64_t r0 = plan.q_start[qtile], r1 = plan.q_start[qtile + 1], n = (r1 - r0) * G;
      sum.assign(D * n, 0.f);
      rows.resize(n * D);
      for (int c = 0; c < C; ++c) {
        if (!touched[(c * d.B * d.Hkv + bhk) * nq + qtile]) continue;
        for (int64_t dd = 0; dd < D; ++dd) {
          const float* src = ws_dqt + c * qo + bhk * D * SG + dd * SG + r0 * G;
          float* dst = sum.data() + dd * n;
          for (int64_t j = 0; j < n; ++j) dst[j] += src[j];
        }
      }
      transpose(sum.data(), n, D, n, rows.data(), D);  // rows[c * D + dd]
      for (int64_t s_ = r0; s_ < r1; ++s_)
        for (int64_t g = 0; g < G; ++g) {
          float* r = rows.data() + ((s_ - r0) * G + g) * D;
          scale_row(r, D, a.scale);
          store_float(r, dq + ((b * d.Hq + hk * G + g) * S + row_of[s_]) * D, D);
        }
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

// Backward kernels. With P = exp(scale * Q K^T - lse) recomputed from the forward's LSE and
// D_i = rowsum(dO * O)_i (precomputed):
//   dV = P^T dO,   dP = dO V^T,   dS = P * (dP - D),   dK = scale * dS^T Q,   dQ = scale * dS K.
//
// dK/dV kernel: grid (ceil(S / 64) key tiles, B * Hkv). A CTA keeps K/V of its key tile in shared
// memory and dK/dV in registers, and walks every (query head of its GQA group, query tile) whose
// plan entry for this key tile is not empty. dQ, when not deterministic, is accumulated with fp32
// atomics into dq_accum (the fast default, as in FlashAttention-2).
// dQ kernel (deterministic=True): grid (ceil(S / 64) query tiles, B * Hq), the forward's shape:
// it recomputes P and dS per key tile and accumulates dQ in registers: no atomics, run-to-run
// bit-identical, at the price of recomputing Q K^T and dO V^T once more.
#pragma once

#include <cute/tensor.hpp>

#include "cuda/attention/attention_cuda.h"
#include "cuda/attention/kernel_traits.h"
#include "cuda/attention/mask.h"
#include "cuda/attention/utils.h"

namespace jacobi::cuda::attn {

using namespace cute;

constexpr float kLog2e = 1.4426950408889634f;

// lse (natural log) -> the exp2 offset of P; a row that saw nothing (lse = -inf) gets +inf so that
// its P is exp2(x - inf) = 0 instead of NaN.
__device__ __forceinline__ float lse_to_log2_offset(float lse) {
  return lse == -INFINITY ? INFINITY : lse * kLog2e;
}

template <class Kt, bool kAtomicDq>
__global__ void __launch_bounds__(Kt::kNThreads) block_attention_bwd_dkdv_kernel(const BwdParams p) {
  using Element = typename Kt::Element;
  constexpr int kBlockM = Kt::kBlockM;
  constexpr int kBlockN = Kt::kBlockN;
  constexpr int kHeadDim = Kt::kHeadDim;
  constexpr int kNThreads = Kt::kNThreads;
  using SmemLayoutQ = typename Kt::SmemLayoutQ;
  using SmemLayoutKV = typename Kt::SmemLayoutKV;

  extern __shared__ __align__(128) char smem_raw[];
  Element* smem_q = reinterpret_cast<Element*>(smem_raw);
  Element* smem_do = smem_q + size(SmemLayoutQ{});
  Element* smem_k = smem_do + size(SmemLayoutQ{});
  Element* smem_v = smem_k + size(SmemLayoutKV{});
  Element* smem_p = smem_v + size(SmemLayoutKV{});
  Element* smem_ds = smem_p + size(typename Kt::SmemLayoutPdS{});
  float* smem_lse = reinterpret_cast<float*>(smem_ds + size(typename Kt::SmemLayoutPdS{}));
  float* smem_dsum = smem_lse + kBlockM;
  uint64_t* smem_mask = reinterpret_cast<uint64_t*>(smem_dsum + kBlockM);

  const int tid = threadIdx.x;
  const int n_block = blockIdx.x;
  const int b = blockIdx.y / p.heads_kv;
  const int hk = blockIdx.y % p.heads_kv;
  const int group = p.heads_q / p.heads_kv;
  const int S = p.seq_len;
  const Plan& plan = p.plan;
  const int nt = plan.num_tiles;
  const int col0 = n_block * kBlockN;
  const float scale_log2 = p.scale * kLog2e;

  const Element* k =
      static_cast<const Element*>(p.k) + b * p.k_stride.batch + hk * p.k_stride.head;
  const Element* v =
      static_cast<const Element*>(p.v) + b * p.v_stride.batch + hk * p.v_stride.head;
  gather_rows_async<kBlockN, kHeadDim, kNThreads, SmemLayoutKV>(smem_k, k, p.k_stride.row,
                                                                plan.perm, col0, S, tid);
  gather_rows_async<kBlockN, kHeadDim, kNThreads, SmemLayoutKV>(smem_v, v, p.v_stride.row,
                                                                plan.perm, col0, S, tid);
  cp_async_commit();

  Tensor sQ = make_tensor(make_smem_ptr(smem_q), SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem_do), SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), SmemLayoutKV{});
  Tensor sP = make_tensor(make_smem_ptr(smem_p), typename Kt::SmemLayoutPdS{});
  Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename Kt::SmemLayoutPdS{});
  Tensor sQt = make_tensor(make_smem_ptr(smem_q), typename Kt::SmemLayoutQt{});
  Tensor sQtNoSwizzle = make_tensor(make_smem_ptr(smem_q), typename Kt::SmemLayoutQtNoSwizzle{});
  Tensor sdOt = make_tensor(make_smem_ptr(smem_do), typename Kt::SmemLayoutQt{});
  Tensor sdOtNoSwizzle =
      make_tensor(make_smem_ptr(smem_do), typename Kt::SmemLayoutQtNoSwizzle{});
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Kt::SmemLayoutKt{});
  Tensor sKtNoSwizzle = make_tensor(make_smem_ptr(smem_k), typename Kt::SmemLayoutKtNoSwizzle{});
  Tensor sPt = make_tensor(make_smem_ptr(smem_p), typename Kt::SmemLayoutPdSt{});
  Tensor sPtNoSwizzle = make_tensor(make_smem_ptr(smem_p), typename Kt::SmemLayoutPdStNoSwizzle{});
  Tensor sdSt = make_tensor(make_smem_ptr(smem_ds), typename Kt::SmemLayoutPdSt{});
  Tensor sdStNoSwizzle =
      make_tensor(make_smem_ptr(smem_ds), typename Kt::SmemLayoutPdStNoSwizzle{});

  typename Kt::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  auto copy_a = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, tiled_mma);
  auto thr_copy_a = copy_a.get_thread_slice(tid);
  auto copy_b = make_tiled_copy_B(typename Kt::SmemCopyAtom{}, tiled_mma);
  auto thr_copy_b = copy_b.get_thread_slice(tid);
  auto copy_at = make_tiled_copy_A(typename Kt::SmemCopyAtomTransposed{}, tiled_mma);
  auto thr_copy_at = copy_at.get_thread_slice(tid);
  auto copy_bt = make_tiled_copy_B(typename Kt::SmemCopyAtomTransposed{}, tiled_mma);
  auto thr_copy_bt = copy_bt.get_thread_slice(tid);

  // S = Q K^T and dP = dO V^T: [query rows, key rows].
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tSsQ = thr_copy_a.partition_S(sQ);
  Tensor tSsK = thr_copy_b.partition_S(sK);
  Tensor tdPrdO = thr_mma.partition_fragment_A(sdO);
  Tensor tdPrV = thr_mma.partition_fragment_B(sV);
  Tensor tdPsdO = thr_copy_a.partition_S(sdO);
  Tensor tdPsV = thr_copy_b.partition_S(sV);
  // dV += P^T dO and dK += dS^T Q: [key rows, head dim], contracting over query rows.
  Tensor tdVrPt = thr_mma.partition_fragment_A(sPtNoSwizzle);
  Tensor tdVrdOt = thr_mma.partition_fragment_B(sdOtNoSwizzle);
  Tensor tdVsPt = thr_copy_at.partition_S(sPt);
  Tensor tdVsdOt = thr_copy_bt.partition_S(sdOt);
  Tensor tdKrdSt = thr_mma.partition_fragment_A(sdStNoSwizzle);
  Tensor tdKrQt = thr_mma.partition_fragment_B(sQtNoSwizzle);
  Tensor tdKsdSt = thr_copy_at.partition_S(sdSt);
  Tensor tdKsQt = thr_copy_bt.partition_S(sQt);

  Tensor acc_dk = partition_fragment_C(tiled_mma, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  Tensor acc_dv = partition_fragment_C(tiled_mma, Shape<Int<kBlockN>, Int<kHeadDim>>{});
  clear(acc_dk);
  clear(acc_dv);

  auto copy_store = make_tiled_copy_C(typename Kt::SmemCopyAtomStore{}, tiled_mma);
  auto thr_copy_store = copy_store.get_thread_slice(tid);
  Tensor tPsP = thr_copy_store.partition_D(sP);
  Tensor tPsdS = thr_copy_store.partition_D(sdS);

  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tScS = thr_mma.partition_C(cS);
  Tensor coords = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));

  for (int hi = 0; hi < group; ++hi) {
    const int h = hk * group + hi;
    const Element* q =
        static_cast<const Element*>(p.q) + b * p.q_stride.batch + h * p.q_stride.head;
    const Element* dout =
        static_cast<const Element*>(p.dout) + b * p.do_stride.batch + h * p.do_stride.head;
    const float* lse_bh = p.lse + (int64_t(b) * p.heads_q + h) * S;
    const float* dsum_bh = p.dsum + (int64_t(b) * p.heads_q + h) * S;
    for (int i = 0; i < nt; ++i) {
      const uint8_t cls = plan.tile_class[int64_t(i) * nt + n_block];
      if (cls == jacobi::attn::kTileEmpty) continue;
      const int row0 = i * kBlockM;
      // Every reader of sQ/sdO/sP/sdS/masks of the previous step passed the barrier at its end.
      gather_rows_async<kBlockM, kHeadDim, kNThreads, SmemLayoutQ>(smem_q, q, p.q_stride.row,
                                                                   plan.perm, row0, S, tid);
      gather_rows_async<kBlockM, kHeadDim, kNThreads, SmemLayoutQ>(smem_do, dout, p.do_stride.row,
                                                                   plan.perm, row0, S, tid);
      cp_async_commit();
      for (int r = tid; r < kBlockM; r += kNThreads) {
        const int pos = row0 + r;
        const int tok = pos < S ? __ldg(plan.perm + pos) : -1;
        smem_lse[r] = tok >= 0 ? lse_to_log2_offset(lse_bh[tok]) : INFINITY;
        smem_dsum[r] = tok >= 0 ? dsum_bh[tok] : 0.f;
      }
      if (cls == jacobi::attn::kTilePartial) {
        build_tile_mask<kBlockM, kNThreads>(smem_mask, row0, col0, plan, S, tid);
      }
      cp_async_wait<0>();
      __syncthreads();

      Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
      Tensor acc_dp = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
      clear(acc_s);
      clear(acc_dp);
      gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, copy_a, copy_b, thr_copy_a, thr_copy_b);
      gemm_ss(acc_dp, tdPrdO, tdPrV, tdPsdO, tdPsV, tiled_mma, copy_a, copy_b, thr_copy_a,
              thr_copy_b);
      Tensor scores = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
      Tensor dp = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
      if (cls == jacobi::attn::kTilePartial) apply_tile_mask(scores, coords, smem_mask);
      CUTE_UNROLL
      for (int r = 0; r < size<0>(scores); ++r) {
        const int row = get<0>(coords(r, 0));
        const float lse2 = smem_lse[row];
        const float dsum = smem_dsum[row];
        CUTE_UNROLL
        for (int c = 0; c < size<1>(scores); ++c) {
          const float pr = exp2f(scores(r, c) * scale_log2 - lse2);
          scores(r, c) = pr;
          dp(r, c) = pr * (dp(r, c) - dsum);
        }
      }
      Tensor rP = convert_fragment<Element>(acc_s);
      Tensor rdS = convert_fragment<Element>(acc_dp);
      cute::copy(copy_store, thr_copy_store.retile_S(rP), tPsP);
      cute::copy(copy_store, thr_copy_store.retile_S(rdS), tPsdS);
      __syncthreads();

      gemm_ss(acc_dv, tdVrPt, tdVrdOt, tdVsPt, tdVsdOt, tiled_mma, copy_at, copy_bt, thr_copy_at,
              thr_copy_bt);
      gemm_ss(acc_dk, tdKrdSt, tdKrQt, tdKsdSt, tdKsQt, tiled_mma, copy_at, copy_bt, thr_copy_at,
              thr_copy_bt);
      if constexpr (kAtomicDq) {
        // dQ partial of this key tile: dS [query, key] times K, B operand K^T via ldmatrix.trans,
        // in column chunks of kDqCols (d=256: two chunks of 128, so the partial accumulator
        // does not sit on top of the dK/dV ones at full width: ptxas spilled at one chunk).
        constexpr int kDqCols = Kt::kDqCols;
        Tensor tdQrdS = thr_mma.partition_fragment_A(sdS);
        Tensor tdQsdS = thr_copy_a.partition_S(sdS);
        float* dq_bh = p.dq_accum + (int64_t(b) * p.heads_q + h) * int64_t(S) * kHeadDim;
        CUTE_UNROLL
        for (int chunk = 0; chunk < kHeadDim / kDqCols; ++chunk) {
          Tensor sKtc = local_tile(sKt, Shape<Int<kDqCols>, Int<kBlockN>>{}, make_coord(chunk, 0));
          Tensor sKtcNoSwizzle =
              local_tile(sKtNoSwizzle, Shape<Int<kDqCols>, Int<kBlockN>>{}, make_coord(chunk, 0));
          Tensor tdQrKt = thr_mma.partition_fragment_B(sKtcNoSwizzle);
          Tensor tdQsKt = thr_copy_bt.partition_S(sKtc);
          Tensor acc_dq = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kDqCols>>{});
          clear(acc_dq);
          gemm_ss(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, tiled_mma, copy_a, copy_bt, thr_copy_a,
                  thr_copy_bt);
          Tensor cQ = make_identity_tensor(Shape<Int<kBlockM>, Int<kDqCols>>{});
          Tensor tQcQ = thr_mma.partition_C(cQ);
          Tensor qcoords = make_tensor(tQcQ.data(), acc_rowcol(tQcQ.layout()));
          Tensor dq = make_tensor(acc_dq.data(), acc_rowcol(acc_dq.layout()));
          CUTE_UNROLL
          for (int r = 0; r < size<0>(dq); ++r) {
            const int pos = row0 + get<0>(qcoords(r, 0));
            if (pos < S) {
              float* dst = dq_bh + int64_t(__ldg(plan.perm + pos)) * kHeadDim + chunk * kDqCols;
              CUTE_UNROLL
              for (int c = 0; c < size<1>(dq); ++c) {
                atomicAdd(dst + get<1>(qcoords(0, c)), dq(r, c));
              }
            }
          }
        }
      }
      __syncthreads();
    }
  }

  // ---- epilogue: dK (scaled) and dV through smem (reusing sK / sV) to the permuted rows ----
  cp_async_wait<0>();  // K/V may still be in flight when no query tile sees this key tile
  __syncthreads();
  CUTE_UNROLL
  for (int e = 0; e < size(acc_dk); ++e) acc_dk(e) *= p.scale;
  Tensor rdK = convert_fragment<Element>(acc_dk);
  Tensor rdV = convert_fragment<Element>(acc_dv);
  cute::copy(copy_store, thr_copy_store.retile_S(rdK), thr_copy_store.partition_D(sK));
  cute::copy(copy_store, thr_copy_store.retile_S(rdV), thr_copy_store.partition_D(sV));
  __syncthreads();
  Element* dk = static_cast<Element*>(p.dk) + b * p.dk_stride.batch + hk * p.dk_stride.head;
  Element* dv = static_cast<Element*>(p.dv) + b * p.dv_stride.batch + hk * p.dv_stride.head;
  scatter_rows<kBlockN, kHeadDim, kNThreads, SmemLayoutKV>(dk, p.dk_stride.row, smem_k, plan.perm,
                                                           col0, S, tid);
  scatter_rows<kBlockN, kHeadDim, kNThreads, SmemLayoutKV>(dv, p.dv_stride.row, smem_v, plan.perm,
                                                           col0, S, tid);
}

template <class Kt>
__global__ void __launch_bounds__(Kt::kNThreads) block_attention_bwd_dq_kernel(const BwdParams p) {
  using Element = typename Kt::Element;
  constexpr int kBlockM = Kt::kBlockM;
  constexpr int kBlockN = Kt::kBlockN;
  constexpr int kHeadDim = Kt::kHeadDim;
  constexpr int kNThreads = Kt::kNThreads;
  using SmemLayoutQ = typename Kt::SmemLayoutQ;
  using SmemLayoutKV = typename Kt::SmemLayoutKV;

  extern __shared__ __align__(128) char smem_raw[];
  Element* smem_q = reinterpret_cast<Element*>(smem_raw);
  Element* smem_do = smem_q + size(SmemLayoutQ{});
  Element* smem_k = smem_do + size(SmemLayoutQ{});
  Element* smem_v = smem_k + size(SmemLayoutKV{});
  // dS tile (only with kDsInSmem) and then the mask words.
  Element* smem_ds = smem_v + size(SmemLayoutKV{});
  constexpr int kSmemDs = Kt::kDsInSmem ? int(size(typename Kt::SmemLayoutPdS{})) : 0;
  uint64_t* smem_mask = reinterpret_cast<uint64_t*>(smem_ds + kSmemDs);

  const int tid = threadIdx.x;
  const int m_block = blockIdx.x;
  const int b = blockIdx.y / p.heads_q;
  const int h = blockIdx.y % p.heads_q;
  const int hk = h / (p.heads_q / p.heads_kv);
  const int S = p.seq_len;
  const Plan& plan = p.plan;
  const int nt = plan.num_tiles;
  const int row0 = m_block * kBlockM;
  const float scale_log2 = p.scale * kLog2e;

  const Element* q = static_cast<const Element*>(p.q) + b * p.q_stride.batch + h * p.q_stride.head;
  const Element* dout =
      static_cast<const Element*>(p.dout) + b * p.do_stride.batch + h * p.do_stride.head;
  const Element* k =
      static_cast<const Element*>(p.k) + b * p.k_stride.batch + hk * p.k_stride.head;
  const Element* v =
      static_cast<const Element*>(p.v) + b * p.v_stride.batch + hk * p.v_stride.head;
  gather_rows_async<kBlockM, kHeadDim, kNThreads, SmemLayoutQ>(smem_q, q, p.q_stride.row,
                                                               plan.perm, row0, S, tid);
  gather_rows_async<kBlockM, kHeadDim, kNThreads, SmemLayoutQ>(smem_do, dout, p.do_stride.row,
                                                               plan.perm, row0, S, tid);
  cp_async_commit();

  Tensor sQ = make_tensor(make_smem_ptr(smem_q), SmemLayoutQ{});
  Tensor sdO = make_tensor(make_smem_ptr(smem_do), SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), SmemLayoutKV{});
  Tensor sV = make_tensor(make_smem_ptr(smem_v), SmemLayoutKV{});
  Tensor sKt = make_tensor(make_smem_ptr(smem_k), typename Kt::SmemLayoutKt{});
  Tensor sKtNoSwizzle = make_tensor(make_smem_ptr(smem_k), typename Kt::SmemLayoutKtNoSwizzle{});

  typename Kt::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  auto copy_a = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, tiled_mma);
  auto thr_copy_a = copy_a.get_thread_slice(tid);
  auto copy_b = make_tiled_copy_B(typename Kt::SmemCopyAtom{}, tiled_mma);
  auto thr_copy_b = copy_b.get_thread_slice(tid);
  auto copy_bt = make_tiled_copy_B(typename Kt::SmemCopyAtomTransposed{}, tiled_mma);
  auto thr_copy_bt = copy_bt.get_thread_slice(tid);

  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tSsQ = thr_copy_a.partition_S(sQ);
  Tensor tSsK = thr_copy_b.partition_S(sK);
  Tensor tdPrdO = thr_mma.partition_fragment_A(sdO);
  Tensor tdPrV = thr_mma.partition_fragment_B(sV);
  Tensor tdPsdO = thr_copy_a.partition_S(sdO);
  Tensor tdPsV = thr_copy_b.partition_S(sV);
  Tensor tdQrKt = thr_mma.partition_fragment_B(sKtNoSwizzle);
  Tensor tdQsKt = thr_copy_bt.partition_S(sKt);
  Tensor acc_dq = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_dq);

  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tScS = thr_mma.partition_C(cS);
  Tensor coords = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));

  // This thread's rows: their LSE offset and D_i, loaded once.
  constexpr int kRows = decltype(size<0>(coords))::value;
  float lse2[kRows], dsum[kRows];
  {
    const float* lse_bh = p.lse + (int64_t(b) * p.heads_q + h) * S;
    const float* dsum_bh = p.dsum + (int64_t(b) * p.heads_q + h) * S;
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const int pos = row0 + get<0>(coords(r, 0));
      const int tok = pos < S ? __ldg(plan.perm + pos) : -1;
      lse2[r] = tok >= 0 ? lse_to_log2_offset(lse_bh[tok]) : INFINITY;
      dsum[r] = tok >= 0 ? dsum_bh[tok] : 0.f;
    }
  }

  for (int j = 0; j < nt; ++j) {
    const uint8_t cls = plan.tile_class[int64_t(m_block) * nt + j];
    if (cls == jacobi::attn::kTileEmpty) continue;
    // Readers of K/V/mask of the previous step passed the barrier at its end.
    gather_rows_async<kBlockN, kHeadDim, kNThreads, SmemLayoutKV>(smem_k, k, p.k_stride.row,
                                                                  plan.perm, j * kBlockN, S, tid);
    gather_rows_async<kBlockN, kHeadDim, kNThreads, SmemLayoutKV>(smem_v, v, p.v_stride.row,
                                                                  plan.perm, j * kBlockN, S, tid);
    cp_async_commit();
    if (cls == jacobi::attn::kTilePartial) {
      build_tile_mask<kBlockM, kNThreads>(smem_mask, row0, j * kBlockN, plan, S, tid);
    }
    cp_async_wait<0>();
    __syncthreads();

    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    Tensor acc_dp = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    clear(acc_dp);
    gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, copy_a, copy_b, thr_copy_a, thr_copy_b);
    gemm_ss(acc_dp, tdPrdO, tdPrV, tdPsdO, tdPsV, tiled_mma, copy_a, copy_b, thr_copy_a,
            thr_copy_b);
    Tensor scores = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    Tensor dp = make_tensor(acc_dp.data(), acc_rowcol(acc_dp.layout()));
    if (cls == jacobi::attn::kTilePartial) apply_tile_mask(scores, coords, smem_mask);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        const float pr = exp2f(scores(r, c) * scale_log2 - lse2[r]);
        dp(r, c) = pr * (dp(r, c) - dsum[r]);
      }
    }
    Tensor rdS = convert_fragment<Element>(acc_dp);
    if constexpr (Kt::kDsInSmem) {
      // Warps split the key columns of dS too: the whole dS row block goes through smem so that
      // every warp reads its rows over all keys as the A operand of dQ += dS K.
      Tensor sdS = make_tensor(make_smem_ptr(smem_ds), typename Kt::SmemLayoutPdS{});
      auto copy_store = make_tiled_copy_C(typename Kt::SmemCopyAtomStore{}, tiled_mma);
      auto thr_copy_store = copy_store.get_thread_slice(tid);
      cute::copy(copy_store, thr_copy_store.retile_S(rdS), thr_copy_store.partition_D(sdS));
      __syncthreads();
      Tensor tdQrdS = thr_mma.partition_fragment_A(sdS);
      Tensor tdQsdS = thr_copy_a.partition_S(sdS);
      gemm_ss(acc_dq, tdQrdS, tdQrKt, tdQsdS, tdQsKt, tiled_mma, copy_a, copy_bt, thr_copy_a,
              thr_copy_bt);
    } else {
      Tensor tdQrdS = make_tensor(rdS.data(), acc_as_a_operand(rdS.layout()));
      gemm_rs(acc_dq, tdQrdS, tdQrKt, tdQsKt, tiled_mma, copy_bt, thr_copy_bt);
    }
    __syncthreads();
  }

  cp_async_wait<0>();  // Q/dO may still be in flight when no key tile was visible
  __syncthreads();
  CUTE_UNROLL
  for (int e = 0; e < size(acc_dq); ++e) acc_dq(e) *= p.scale;
  Tensor rdQ = convert_fragment<Element>(acc_dq);
  auto copy_store = make_tiled_copy_C(typename Kt::SmemCopyAtomStore{}, tiled_mma);
  auto thr_copy_store = copy_store.get_thread_slice(tid);
  cute::copy(copy_store, thr_copy_store.retile_S(rdQ), thr_copy_store.partition_D(sQ));
  __syncthreads();
  Element* dq = static_cast<Element*>(p.dq) + b * p.dq_stride.batch + h * p.dq_stride.head;
  scatter_rows<kBlockM, kHeadDim, kNThreads, SmemLayoutQ>(dq, p.dq_stride.row, smem_q, plan.perm,
                                                          row0, S, tid);
}

template <class Kernel>
cudaError_t set_smem(Kernel kernel, int smem) {
  if (smem <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
}

template <typename Element, int kHeadDim>
cudaError_t run_bwd(const BwdParams& p, cudaStream_t stream) {
  using KtKV = BwdDkdvTraits<Element, kHeadDim>;
  using KtQ = BwdDqTraits<Element, kHeadDim>;
  const int nt = p.plan.num_tiles;
  cudaError_t e;
  if (p.deterministic) {
    auto kernel = &block_attention_bwd_dkdv_kernel<KtKV, false>;
    if ((e = set_smem(kernel, KtKV::kSmemSize)) != cudaSuccess) return e;
    kernel<<<dim3(nt, p.batch * p.heads_kv), KtKV::kNThreads, KtKV::kSmemSize, stream>>>(p);
    if ((e = cudaGetLastError()) != cudaSuccess) return e;
    auto dq_kernel = &block_attention_bwd_dq_kernel<KtQ>;
    constexpr int smem_q = KtQ::kSmemSize;
    if ((e = set_smem(dq_kernel, smem_q)) != cudaSuccess) return e;
    dq_kernel<<<dim3(nt, p.batch * p.heads_q), KtQ::kNThreads, smem_q, stream>>>(p);
  } else {
    auto kernel = &block_attention_bwd_dkdv_kernel<KtKV, true>;
    if ((e = set_smem(kernel, KtKV::kSmemSize)) != cudaSuccess) return e;
    kernel<<<dim3(nt, p.batch * p.heads_kv), KtKV::kNThreads, KtKV::kSmemSize, stream>>>(p);
  }
  return cudaGetLastError();
}

}  // namespace jacobi::cuda::attn

// Forward kernel: out = softmax(scale * q k^T + mask) v over the block table, and the LSE.
//
// Grid: (ceil(S / kBlockM) query tiles, B * Hq). Each CTA walks the plan row of its query tile
// (in stream order, see jacobi/attention_plan.h): empty key tiles are skipped without a load,
// full tiles run unmasked, partial tiles are masked on the score fragments. Pipeline as in
// FlashAttention-2, one buffer each for K and V: V(j) loads while S = Q K(j)^T runs, K(next)
// loads while softmax and O += P V(j) run.
#pragma once

#include <cute/tensor.hpp>

#include "cuda/attention/attention_cuda.h"
#include "cuda/attention/kernel_traits.h"
#include "cuda/attention/mask.h"
#include "cuda/attention/softmax.h"
#include "cuda/attention/utils.h"

namespace jacobi::cuda::attn {

using namespace cute;

// Class of key tile j for a query tile made of kSub plan rows starting at plan row i0.
template <int kSub>
__device__ __forceinline__ uint8_t query_tile_class(const Plan& plan, int i0, int j) {
  uint8_t c = plan.tile_class[int64_t(i0) * plan.num_tiles + j];
  CUTE_UNROLL
  for (int s = 1; s < kSub; ++s) {
    if (i0 + s < plan.num_tiles) {  // rows past the end do not exist: they do not widen the class
      c = jacobi::attn::combine_class(c, plan.tile_class[int64_t(i0 + s) * plan.num_tiles + j]);
    }
  }
  return c;
}

template <int kSub>
__device__ __forceinline__ int next_key_tile(const Plan& plan, int i0, int j) {
  for (; j < plan.num_tiles; ++j) {
    if (query_tile_class<kSub>(plan, i0, j) != jacobi::attn::kTileEmpty) return j;
  }
  return j;
}

template <class Kt>
__global__ void __launch_bounds__(Kt::kNThreads) block_attention_fwd_kernel(const FwdParams p) {
  using Element = typename Kt::Element;
  constexpr int kBlockM = Kt::kBlockM;
  constexpr int kBlockN = Kt::kBlockN;
  constexpr int kHeadDim = Kt::kHeadDim;
  constexpr int kNThreads = Kt::kNThreads;
  constexpr int kSub = kBlockM / jacobi::attn::kPlanTile;

  extern __shared__ __align__(128) char smem_raw[];
  Element* smem_q = reinterpret_cast<Element*>(smem_raw);
  Element* smem_k = smem_q + size(typename Kt::SmemLayoutQ{});
  Element* smem_v = smem_k + size(typename Kt::SmemLayoutKV{});
  uint64_t* smem_mask = reinterpret_cast<uint64_t*>(smem_v + size(typename Kt::SmemLayoutKV{}));

  const int tid = threadIdx.x;
  const int m_block = blockIdx.x;
  const int b = blockIdx.y / p.heads_q;
  const int h = blockIdx.y % p.heads_q;
  const int hk = h / (p.heads_q / p.heads_kv);  // GQA: K/V are read in place, never repeated
  const int S = p.seq_len;
  const Plan& plan = p.plan;
  const int row0 = m_block * kBlockM;  // permuted position of the tile's first row
  const int i0 = m_block * kSub;       // its first plan row

  const Element* q = static_cast<const Element*>(p.q) + b * p.q_stride.batch + h * p.q_stride.head;
  const Element* k =
      static_cast<const Element*>(p.k) + b * p.k_stride.batch + hk * p.k_stride.head;
  const Element* v =
      static_cast<const Element*>(p.v) + b * p.v_stride.batch + hk * p.v_stride.head;

  Tensor sQ = make_tensor(make_smem_ptr(smem_q), typename Kt::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(smem_k), typename Kt::SmemLayoutKV{});
  Tensor sVt = make_tensor(make_smem_ptr(smem_v), typename Kt::SmemLayoutVt{});
  Tensor sVtNoSwizzle = make_tensor(make_smem_ptr(smem_v), typename Kt::SmemLayoutVtNoSwizzle{});

  typename Kt::TiledMma tiled_mma;
  auto thr_mma = tiled_mma.get_thread_slice(tid);
  Tensor tSrQ = thr_mma.partition_fragment_A(sQ);
  Tensor tSrK = thr_mma.partition_fragment_B(sK);
  Tensor tOrVt = thr_mma.partition_fragment_B(sVtNoSwizzle);
  Tensor acc_o = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kHeadDim>>{});
  clear(acc_o);

  auto smem_tiled_copy_q = make_tiled_copy_A(typename Kt::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_q = smem_tiled_copy_q.get_thread_slice(tid);
  Tensor tSsQ = smem_thr_copy_q.partition_S(sQ);
  auto smem_tiled_copy_k = make_tiled_copy_B(typename Kt::SmemCopyAtom{}, tiled_mma);
  auto smem_thr_copy_k = smem_tiled_copy_k.get_thread_slice(tid);
  Tensor tSsK = smem_thr_copy_k.partition_S(sK);
  auto smem_tiled_copy_v = make_tiled_copy_B(typename Kt::SmemCopyAtomTransposed{}, tiled_mma);
  auto smem_thr_copy_v = smem_tiled_copy_v.get_thread_slice(tid);
  Tensor tOsVt = smem_thr_copy_v.partition_S(sVt);

  // (row, col) of every score accumulator element, for masks.
  Tensor cS = make_identity_tensor(Shape<Int<kBlockM>, Int<kBlockN>>{});
  Tensor tScS = thr_mma.partition_C(cS);

  int j = next_key_tile<kSub>(plan, i0, 0);
  gather_rows_async<kBlockM, kHeadDim, kNThreads, typename Kt::SmemLayoutQ>(
      smem_q, q, p.q_stride.row, plan.perm, row0, S, tid);
  if (j < plan.num_tiles) {
    gather_rows_async<kBlockN, kHeadDim, kNThreads, typename Kt::SmemLayoutKV>(
        smem_k, k, p.k_stride.row, plan.perm, j * kBlockN, S, tid);
  }
  cp_async_commit();

  constexpr int kRows = decltype(size<0>(acc_rowcol(acc_o.layout())))::value;
  OnlineSoftmax<kRows> softmax;
  const float scale_log2 = p.scale * 1.4426950408889634f;

  while (j < plan.num_tiles) {
    const int j_next = next_key_tile<kSub>(plan, i0, j + 1);
    const uint8_t cls = query_tile_class<kSub>(plan, i0, j);
    Tensor acc_s = partition_fragment_C(tiled_mma, Shape<Int<kBlockM>, Int<kBlockN>>{});
    clear(acc_s);
    // The mask words of the previous partial tile were consumed before the last barrier.
    if (cls == jacobi::attn::kTilePartial) {
      build_tile_mask<kBlockM, kNThreads>(smem_mask, row0, j * kBlockN, plan, S, tid);
    }
    cp_async_wait<0>();
    __syncthreads();  // K(j) (and Q) and the mask landed; every thread is done reading V(j-1)
    gather_rows_async<kBlockN, kHeadDim, kNThreads, typename Kt::SmemLayoutKV>(
        smem_v, v, p.v_stride.row, plan.perm, j * kBlockN, S, tid);
    cp_async_commit();

    gemm_ss(acc_s, tSrQ, tSrK, tSsQ, tSsK, tiled_mma, smem_tiled_copy_q, smem_tiled_copy_k,
            smem_thr_copy_q, smem_thr_copy_k);

    Tensor scores = make_tensor(acc_s.data(), acc_rowcol(acc_s.layout()));
    if (cls == jacobi::attn::kTilePartial) {
      Tensor coords = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
      apply_tile_mask(scores, coords, smem_mask);
    }

    cp_async_wait<0>();
    __syncthreads();  // V(j) landed; every thread is done reading K(j)
    if (j_next < plan.num_tiles) {
      gather_rows_async<kBlockN, kHeadDim, kNThreads, typename Kt::SmemLayoutKV>(
          smem_k, k, p.k_stride.row, plan.perm, j_next * kBlockN, S, tid);
      cp_async_commit();
    }

    Tensor out_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
    softmax.update(scores, out_rc, scale_log2);

    Tensor rP = convert_fragment<Element>(acc_s);
    Tensor tOrP = make_tensor(rP.data(), acc_as_a_operand(rP.layout()));
    gemm_rs(acc_o, tOrP, tOrVt, tOsVt, tiled_mma, smem_tiled_copy_v, smem_thr_copy_v);
    j = j_next;
  }

  // ---- epilogue: normalise, LSE, O through smem (reusing sQ) to the permuted rows ----
  Tensor out_rc = make_tensor(acc_o.data(), acc_rowcol(acc_o.layout()));
  float lse[kRows];
  softmax.finalize(out_rc, p.scale, lse);

  {
    Tensor coords = make_tensor(tScS.data(), acc_rowcol(tScS.layout()));
    float* lse_bh = p.lse + (int64_t(b) * p.heads_q + h) * S;
    if (get<1>(coords(0, 0)) == 0) {  // one thread per row: the one holding column 0
      CUTE_UNROLL
      for (int r = 0; r < kRows; ++r) {
        const int pos = row0 + get<0>(coords(r, 0));
        if (pos < S) lse_bh[__ldg(plan.perm + pos)] = lse[r];
      }
    }
  }

  cp_async_wait<0>();  // Q may still be in flight when no key tile was visible
  __syncthreads();     // every thread is done with sQ (and sV)
  Tensor rO = convert_fragment<Element>(acc_o);
  Tensor sO = make_tensor(make_smem_ptr(smem_q), typename Kt::SmemLayoutQ{});
  auto smem_tiled_copy_o = make_tiled_copy_C(typename Kt::SmemCopyAtomStore{}, tiled_mma);
  auto smem_thr_copy_o = smem_tiled_copy_o.get_thread_slice(tid);
  cute::copy(smem_tiled_copy_o, smem_thr_copy_o.retile_S(rO), smem_thr_copy_o.partition_D(sO));
  __syncthreads();
  Element* out =
      static_cast<Element*>(p.out) + b * p.o_stride.batch + h * p.o_stride.head;
  scatter_rows<kBlockM, kHeadDim, kNThreads, typename Kt::SmemLayoutQ>(out, p.o_stride.row, smem_q,
                                                                       plan.perm, row0, S, tid);
}

template <class Kt>
cudaError_t launch_fwd(const FwdParams& p, cudaStream_t stream) {
  auto kernel = &block_attention_fwd_kernel<Kt>;
  constexpr int smem = Kt::kSmemSize;
  if (smem > 48 * 1024) {
    const cudaError_t e =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return e;
  }
  const dim3 grid((p.seq_len + Kt::kBlockM - 1) / Kt::kBlockM, p.batch * p.heads_q);
  kernel<<<grid, Kt::kNThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jacobi::cuda::attn

namespace jacobi::cuda::attn {

// 128 x 64 tiles. d=64: 4 warps (32 rows each). d >= 96: 8 warps of 16 rows; with 4 warps at
// d=128 the 128-float output accumulator per thread plus the plan bookkeeping spilled (ptxas: 255
// registers, 76 B spill stores), 8 warps halve every accumulator at the price of ldmatrix reuse
// across rows. (At d=256 that is still 128 floats of output per thread, as in FlashAttention-2's
// 64-row, 4-warp tiles for that head dim.)
template <typename Element, int kHeadDim>
cudaError_t run_fwd(const FwdParams& p, cudaStream_t stream) {
  return launch_fwd<FwdTraits<Element, kHeadDim, 128, kHeadDim <= 64 ? 4 : 8>>(p, stream);
}

}  // namespace jacobi::cuda::attn

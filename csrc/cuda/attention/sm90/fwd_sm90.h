// The sm_90a block-causal attention forward: TMA loads, wgmma (GMMA), warp
// specialisation, an mbarrier pipeline, driven by the host-built per-CTA tile lists.
//
// One CTA = one 128-row query tile of one (batch, query head), 3 warpgroups (384 threads):
//   warpgroup 0, the producer (setmaxnreg 40): one thread issues TMA loads: the Q tile once, then
//     for each listed key tile of this query tile (jacobi/tile_list.h fwd list, ascending) its K
//     and V tiles into a 2-stage ring (cutlass::PipelineTmaAsync: "full" barriers complete on
//     the TMA transaction bytes, "empty" ones when all 256 consumer threads have released).
//   warpgroups 1-2, the consumers (setmaxnreg 232): 64 query rows each (the 64xNx16 wgmma atom,
//     two atoms along M). Per listed tile: S = Q K^T (wgmma, both operands in shared memory),
//     the pair's bit mask only if the list says "partial" (fully visible tiles skip the mask
//     arithmetic; fully masked tiles are not listed, so never loaded), the online softmax of
//     jacobi/online_softmax.h (the CPU kernel's bookkeeping), then O += P V (wgmma with P from
//     registers, V read transposed from shared memory: no copy).
// Q, K and V are read in stream order (attention_plan.h), as contiguous [B, H, S, D] tensors that
// the op gathers once (index_select with the lists' perm), so every tile is one TMA box. Output
// rows and the lse are scattered straight back to token order through perm in the epilogue.
//
// Tile 128 x 128 for head dims 64 and 128 (bf16, fp16); the op falls back to the sm_80 kernel
// for the rest. Not yet here (docs/sm90_attention.md, perf to-do): the softmax of one tile
// overlapped with the QK^T wgmma of the next, warpgroup ping-pong, a TMA store epilogue.
#pragma once

#include <cuda_runtime_api.h>

// clang-format off: cute/tensor.hpp first (the atom headers rely on it)
#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
// clang-format on
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/numeric_types.h>
#include <cutlass/pipeline/sm90_pipeline.hpp>

#include "cuda/attention/attention_cuda.h"
#include "cuda/attention/sm90/attention_sm90.h"
#include "cuda/attention/sm90/fragment_layouts.h"
#include "cuda/attention/sm90/wg_gemm.h"
#include "jacobi/online_softmax.h"
#include "jacobi/tile_list.h"

namespace jacobi::cuda::attn::sm90 {


template <typename Element_, int kHeadDim_>
struct FwdTraits {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kTileM, kBlockN = kTileN, kStages = 2;
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kMmaThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kMmaThreads;
  static constexpr int kProducerRegs = 40, kConsumerRegs = 232;  // 40*128 + 232*256 <= 64K
  static_assert(kHeadDim == 64 || kHeadDim == 128, "sm_90a forward: head dims 64 and 128");
  static_assert(kBlockN == 128, "the mask epilogue reads 4 mask words (128 columns) per row");

  using TileQK = cute::Shape<cute::Int<kBlockM>, cute::Int<kBlockN>, cute::Int<kHeadDim>>;
  using TilePV = cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>, cute::Int<kBlockN>>;
  using WarpgroupsAlongM = cute::Layout<cute::Shape<cute::Int<kConsumerWarpgroups>, cute::_1, cute::_1>>;
  using MmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float, TileQK>(), WarpgroupsAlongM{}));
  // P (registers, K-major) x V^T read from V's own shared-memory tile (MN-major).
  using MmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float, TilePV, cute::GMMA::Major::K,
                                 cute::GMMA::Major::MN>(),
      WarpgroupsAlongM{}));

  // 128-byte swizzled K-major tiles (a head-dim row of 64 elements is one swizzle row).
  using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemQ = decltype(cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}));
  using SmemKV = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStages>>{}));
  // V^T (head dim x keys x stage) as a view of the same bytes.
  using SmemVt = decltype(cute::composition(
      SmemKV{}, cute::make_ordered_layout(
                    cute::Shape<cute::Int<kHeadDim>, cute::Int<kBlockN>, cute::Int<kStages>>{},
                    cute::Step<cute::_2, cute::_1, cute::_3>{})));

  // Global tensors as TMA sees them: (S, D, H, B), contiguous rows.
  using GmemLayout = cute::Layout<cute::Shape<int32_t, int32_t, int32_t, int32_t>,
                                  cute::Stride<int64_t, cute::_1, int64_t, int64_t>>;
  using GmemTensor = decltype(cute::make_tensor(
      cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemLayout{}));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, SmemQ{},
                                            cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{},
                                            cute::_1{}));
  using TmaKV = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{}, GmemTensor{}, cute::take<0, 2>(SmemKV{}),
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{}, cute::_1{}));
  static constexpr uint32_t kTmaBytesQ = kBlockM * kHeadDim * sizeof(Element);
  static constexpr uint32_t kTmaBytesKV = kBlockN * kHeadDim * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemQ>> q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemKV>> k;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<SmemKV>> v;
    typename Pipeline::SharedStorage pipe_k;
    typename Pipeline::SharedStorage pipe_v;
    uint64_t barrier_q;
  };

  struct Params {
    TmaQ tma_q;
    TmaKV tma_k, tma_v;
    void* out;       // [B, Hq, S, D], token order, o_stride
    float* lse;      // [B, Hq, S], token order
    Strides o_stride;
    const int32_t* perm;  // [S] stream position -> token
    jacobi::attn::TileLists lists;
    int32_t batch, heads_q, heads_kv, seq_len;
    float scale, to_log2;  // softmax scale; scale * log2(e)
  };
};

namespace detail {

// Max / sum over the 4 threads (a quad) that share a row of the accumulator.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace detail

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1) fwd_sm90_kernel(const __grid_constant__ typename T::Params p) {
  using namespace cute;
  using Element = typename T::Element;
  using Pipeline = typename T::Pipeline;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);

  const int m_block = blockIdx.x;
  const int b = blockIdx.y / p.heads_q, h = blockIdx.y % p.heads_q;
  const int h_kv = h / (p.heads_q / p.heads_kv);
  const int e_begin = p.lists.fwd_ptr[m_block], e_end = p.lists.fwd_ptr[m_block + 1];
  const int warpgroup = threadIdx.x / 128;

  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename T::SmemQ{});
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename T::SmemKV{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemKV{});
  Tensor sVt = make_tensor(make_smem_ptr(ss.v.data()), typename T::SmemVt{});

  if (threadIdx.x == 0) Barrier::init(&ss.barrier_q, 1);
  typename Pipeline::Params pp;
  pp.transaction_bytes = T::kTmaBytesKV;
  pp.role = warpgroup == 0 ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
  pp.is_leader = threadIdx.x == 0;
  pp.num_consumers = T::kMmaThreads;
  Pipeline pipe_k(ss.pipe_k, pp, Shape<_1, _1, _1>{});
  Pipeline pipe_v(ss.pipe_v, pp, Shape<_1, _1, _1>{});
  __syncthreads();  // barrier initialisation visible to every warp

  if (warpgroup == 0) {
    // ---- producer: one thread issues every TMA load --------------------------------------------
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (threadIdx.x != 0 || e_end == e_begin) return;
    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.seq_len, int32_t(T::kHeadDim), p.heads_q, p.batch));
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.seq_len, int32_t(T::kHeadDim), p.heads_kv, p.batch));
    Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.seq_len, int32_t(T::kHeadDim), p.heads_kv, p.batch));
    Tensor gQ = local_tile(mQ(_, _, h, b), Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{}, make_coord(m_block, 0));
    Tensor gK = local_tile(mK(_, _, h_kv, b), Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{}, make_coord(_, 0));
    Tensor gV = local_tile(mV(_, _, h_kv, b), Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{}, make_coord(_, 0));
    auto [tQg, tQs] = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto [tKg, tKs] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVg, tVs] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    Barrier::arrive_and_expect_tx(&ss.barrier_q, T::kTmaBytesQ);
    copy(p.tma_q.with(ss.barrier_q), tQg, tQs);
    auto st = cutlass::make_producer_start_state<Pipeline>();
    for (int e = e_begin; e < e_end; ++e) {
      const int n_block = p.lists.fwd_tile[e];
      pipe_k.producer_acquire(st);
      copy(p.tma_k.with(*pipe_k.producer_get_barrier(st)), tKg(_, n_block), tKs(_, st.index()));
      pipe_v.producer_acquire(st);
      copy(p.tma_v.with(*pipe_v.producer_get_barrier(st)), tVg(_, n_block), tVs(_, st.index()));
      ++st;
    }
    pipe_k.producer_tail(st);  // do not leave while loads are in flight
    pipe_v.producer_tail(st);
    return;
  }

  // ---- consumers -------------------------------------------------------------------------------
  cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
  const int tidx = threadIdx.x - 128;
  typename T::MmaQK mma_qk;
  typename T::MmaPV mma_pv;
  auto thr_qk = mma_qk.get_thread_slice(tidx);
  auto thr_pv = mma_pv.get_thread_slice(tidx);
  Tensor tSrQ = thr_qk.partition_fragment_A(sQ);   // smem descriptors
  Tensor tSrK = thr_qk.partition_fragment_B(sK);   // (MMA, N, K, stage)
  Tensor tOrV = thr_pv.partition_fragment_B(sVt);  // (MMA, D, N, stage)
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{});
  clear(tOrO);
  // Tile coordinates (row, col) of this thread's S and O elements.
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kBlockN>>{}));
  Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{}));
  Tensor cS = make_tensor(tScS.data(), rowcol(tScS.layout()));
  Tensor O = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
  Tensor cO = make_tensor(tOcO.data(), rowcol(tOcO.layout()));
  constexpr int kRows = decltype(size<0>(O))::value;  // 2: this thread's rows (of a quad's 8)
  jacobi::attn::SoftmaxRow row[kRows];
  CUTE_UNROLL
  for (int m = 0; m < kRows; ++m) row[m] = jacobi::attn::softmax_init();

  if (e_end > e_begin) Barrier::wait(&ss.barrier_q, 0);
  typename T::PipelineState st;  // consumer start: stage 0, phase 0
  for (int e = e_begin; e < e_end; ++e) {
    Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<T::kBlockM>, Int<T::kBlockN>>{});
    pipe_k.consumer_wait(st);
    wg_gemm<true, false>(mma_qk, tSrQ, tSrK(_, _, _, st.index()), tSrS);
    warpgroup_wait<0>();
    pipe_k.consumer_release(st);
    Tensor S = make_tensor(tSrS.data(), rowcol(tSrS.layout()));

    // Partial pair: the precomputed bit mask (4 words = 128 columns per row, one 16-byte load).
    const int mask = p.lists.fwd_mask[e];
    if (mask >= 0) {
      CUTE_UNROLL
      for (int m = 0; m < kRows; ++m) {
        const int r = get<0>(cS(m, 0));
        const uint4 w = __ldg(reinterpret_cast<const uint4*>(p.lists.masks) + int64_t(mask) * T::kBlockM + r);
        CUTE_UNROLL
        for (int n = 0; n < size<1>(S); ++n) {
          const int c = get<1>(cS(m, n));
          const uint32_t word = c < 64 ? (c < 32 ? w.x : w.y) : (c < 96 ? w.z : w.w);
          if (!((word >> (c & 31)) & 1u)) S(m, n) = -INFINITY;
        }
      }
    }
    // Online softmax (jacobi/online_softmax.h): units = raw scores, to_log2 = scale * log2 e.
    CUTE_UNROLL
    for (int m = 0; m < kRows; ++m) {
      float tile_max = -INFINITY;
      CUTE_UNROLL
      for (int n = 0; n < size<1>(S); ++n) tile_max = fmaxf(tile_max, S(m, n));
      const float corr = jacobi::attn::softmax_rescale(row[m], detail::quad_max(tile_max), p.to_log2);
      const float base = jacobi::attn::softmax_exp_base(row[m]) * p.to_log2;
      float sum = 0.f;
      CUTE_UNROLL
      for (int n = 0; n < size<1>(S); ++n) {
        S(m, n) = exp2f(S(m, n) * p.to_log2 - base);
        sum += S(m, n);
      }
      jacobi::attn::softmax_add(row[m], corr, sum);  // per-thread partial sum, same max
      CUTE_UNROLL
      for (int n = 0; n < size<1>(O); ++n) O(m, n) *= corr;
    }
    Tensor rP = make_tensor_like<Element>(tSrS);
    CUTE_UNROLL
    for (int i = 0; i < size(tSrS); ++i) rP(i) = Element(tSrS(i));
    Tensor tOrP = make_tensor(rP.data(), acc_as_operand_a(tSrS.layout()));
    pipe_v.consumer_wait(st);
    wg_gemm<false, true>(mma_pv, tOrP, tOrV(_, _, _, st.index()), tOrO);
    warpgroup_wait<0>();
    pipe_v.consumer_release(st);
    ++st;
  }

  // ---- epilogue: normalise, scatter rows back to token order -----------------------------------
  const int64_t bh = int64_t(b) * p.heads_q + h;
  Element* out = static_cast<Element*>(p.out) + int64_t(b) * p.o_stride.batch + int64_t(h) * p.o_stride.head;
  CUTE_UNROLL
  for (int m = 0; m < kRows; ++m) {
    row[m].sum = detail::quad_sum(row[m].sum);
    const float inv = jacobi::attn::softmax_inv_sum(row[m]);
    const int pos = m_block * T::kBlockM + get<0>(cO(m, 0));
    if (pos >= p.seq_len) continue;
    const int64_t tok = p.perm[pos];
    Element* orow = out + tok * p.o_stride.row;
    CUTE_UNROLL
    for (int n = 0; n < size<1>(O); n += 2) {  // (2 adjacent columns) per step
      const int c = get<1>(cO(m, n));
      orow[c] = Element(O(m, n) * inv);
      orow[c + 1] = Element(O(m, n + 1) * inv);
    }
    if (get<1>(cO(m, 0)) == 0) p.lse[bh * p.seq_len + tok] = jacobi::attn::softmax_lse(row[m], p.scale);
  }
}

// Host side: TMA descriptors for the stream-ordered q/k/v and the launch.
template <typename Element, int kHeadDim>
cudaError_t run_fwd_sm90(const FwdParams& fp, cudaStream_t stream) {
  using namespace cute;
  using T = FwdTraits<Element, kHeadDim>;
  const Sm90FwdInputs& in = fp.sm90;
  const int32_t S = fp.seq_len;
  auto gmem = [&](const void* ptr, int32_t heads) {
    return make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)),
                       make_layout(make_shape(S, int32_t(kHeadDim), heads, fp.batch),
                                   make_stride(int64_t(kHeadDim), _1{}, int64_t(S) * kHeadDim,
                                               int64_t(heads) * S * kHeadDim)));
  };
  typename T::Params p{
      make_tma_copy(SM90_TMA_LOAD{}, gmem(in.q, fp.heads_q), typename T::SmemQ{},
                    Shape<Int<T::kBlockM>, Int<kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, gmem(in.k, fp.heads_kv), take<0, 2>(typename T::SmemKV{}),
                    Shape<Int<T::kBlockN>, Int<kHeadDim>>{}, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, gmem(in.v, fp.heads_kv), take<0, 2>(typename T::SmemKV{}),
                    Shape<Int<T::kBlockN>, Int<kHeadDim>>{}, _1{}),
      fp.out, fp.lse, fp.o_stride, in.perm, in.lists, fp.batch, fp.heads_q, fp.heads_kv, S,
      fp.scale, fp.scale * jacobi::attn::kLog2e};
  const int smem = int(sizeof(typename T::SharedStorage));
  auto kernel = fwd_sm90_kernel<T>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const dim3 grid(unsigned(in.lists.num_q_tiles), unsigned(fp.batch * fp.heads_q));
  kernel<<<grid, T::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jacobi::cuda::attn::sm90

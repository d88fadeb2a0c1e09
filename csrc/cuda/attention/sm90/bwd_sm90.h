// The sm_90a block-causal attention backward: TMA loads, wgmma, warp
// specialisation and an mbarrier pipeline, driven by the host-built backward tile lists. Like the
// sm_80 backward (bwd_kernel.h), with P = exp(scale * S - lse) recomputed from the forward's lse and
// delta = rowsum(dO * O): dV = P^T dO, dP = dO V^T, dS = P * (dP - delta), dK = scale * dS^T Q,
// dQ = scale * dS K.
//
// One CTA = one 128-key tile of one (batch, kv head), 3 warpgroups (384 threads):
//   warpgroup 0 (setmaxnreg 24), two warps at work:
//     the producer, one thread of warp 0, issues the loads: K and V once (one transaction
//     mbarrier), then, for each query head of the GQA group and each listed query tile of this
//     key tile (jacobi/tile_list.h bwd list, ascending), in 64-row halves: the Q half with its
//     lse row and the dO half with its delta row, on one 2-stage ring (cutlass::PipelineTmaAsync).
//     Q and dO by TMA from the stream-ordered copies the op gathers; lse and delta by 1-D bulk
//     copies from the preprocessing kernel's stream-ordered buffers (attention_sm90.cu);
//     the dQ writer, warp 1, walks the same halves: once the consumers have put a half's dQ in
//     shared memory (named barrier DqFull), it adds each row to the fp32 stream-ordered dq_accum
//     with one cp.reduce.async.bulk .add.f32 per row, and hands the tile back once the bulk
//     reads are done (DqEmpty). The consumers never wait on global memory for dQ.
//   warpgroups 1-2, the consumers (setmaxnreg 240): 64 keys each. Per 64-row query half:
//     S^T = K Q^T and dP^T = V dO^T (wgmma, operands in shared memory); the pair's bit mask only
//     when the list says partial; P^T = exp2(S^T * scale * log2 e - lse * log2 e) (lse -inf, and
//     padding rows, enter as +inf: P = 0, so they contribute nothing); dS^T = P^T (dP^T - delta);
//     dV += P^T dO and dK += dS^T Q (wgmma with P^T / dS^T from registers, acc_as_operand_a, and
//     dO / Q read transposed from their tiles; dV's GEMM is issued as soon as P^T is in
//     registers, so the tensor cores run it while the warpgroup computes dS^T); dS^T goes to
//     shared memory (double-buffered) and
//     dQ = dS K (wgmma, each consumer warpgroup takes half of the head dim) goes to shared memory
//     (fp32, rows padded: BwdLayouts::SmemdQ) for the dQ writer.
//   dQ order: the bulk reductions of different key tiles into one query half land in any order
//   (fp32 sums: not bitwise reproducible), unless the op passes dq_semaphore (deterministic=True):
//   then the writer adds a half only on its turn, the key tiles in ascending order
//   (tile_list.h dq_turn), waiting on one counter per (batch, head, half) that each key tile
//   bumps once its reduction has completed. Turns only wait on lower key tiles of the same
//   (batch, kv head), which the grid launches first, so the chain always moves.
//   dK (times the softmax scale) and dV stay in registers over all G heads and listed tiles and
//   are written once, each row scattered to its token through perm. Key tiles that no query sees
//   write zeros.
// Why 64-row query halves of the 128-row listed tiles: with 128 x 128 S^T and dP^T next to dK and
// dV a consumer thread would need 256 fp32 accumulator registers; at 64 it needs 192. The lists
// stay the forward's (128 x 128): one tile-list shape for both passes.
//
// Head dims 64 and 128 (bf16, fp16). Not yet here (docs/sm90_attention.md): a ping-pong of the
// two consumer warpgroups (one's elementwise work under the other's GEMMs): both work on the same
// query half and meet at the dS^T barrier, so it needs another split of the work.
#pragma once

#include <cuda_runtime_api.h>

// clang-format off: cute/tensor.hpp first (the atom headers rely on it)
#include <cute/tensor.hpp>
#include <cute/atom/copy_atom.hpp>
#include <cute/atom/mma_atom.hpp>
// clang-format on
#include <cutlass/arch/barrier.h>
#include <cutlass/barrier.h>
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
struct BwdTraits : BwdLayouts<Element_, kHeadDim_, kBwdBlockM, kTileN, 2> {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  using L = BwdLayouts<Element_, kHeadDim_, kBwdBlockM, kTileN, 2>;
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kBlockM = kBwdBlockM, kBlockN = kTileN, kStages = 2;
  static constexpr int kHalves = kTileM / kBlockM;  // query halves per listed tile
  static constexpr int kConsumerWarpgroups = 2;
  static constexpr int kMmaThreads = 128 * kConsumerWarpgroups;
  static constexpr int kThreads = 128 + kMmaThreads;
  static constexpr int kProducerRegs = 24, kConsumerRegs = 240;  // 24*128 + 240*256 = 168*384
  // (what the launch holds: setmaxnreg only moves registers between warpgroups)
  // Named barriers (cutlass::arch::NamedBarrier ids, after CUTLASS' reserved ones): dS^T written
  // (the 256 consumer threads); dQ tile full / empty (the consumers and the dQ writer warp).
  static constexpr uint32_t kBarDs = 0, kBarDqFull = 1, kBarDqEmpty = 2;
  static constexpr int kDqThreads = kMmaThreads + 32;
  static_assert(kHeadDim == 64 || kHeadDim == 128, "sm_90a backward: head dims 64 and 128");
  static_assert(kBlockN == 128 && kTileM % kBlockM == 0, "mask rows: 4 words (128 keys) each");

  using GmemLayout = cute::Layout<cute::Shape<int32_t, int32_t, int32_t, int32_t>,
                                  cute::Stride<int64_t, cute::_1, int64_t, int64_t>>;
  using GmemTensor = decltype(cute::make_tensor(
      cute::make_gmem_ptr(static_cast<const Element*>(nullptr)), GmemLayout{}));
  using TmaQ = decltype(cute::make_tma_copy(
      cute::SM90_TMA_LOAD{}, GmemTensor{}, cute::take<0, 2>(typename L::SmemQ{}),
      cute::Shape<cute::Int<kBlockM>, cute::Int<kHeadDim>>{}, cute::_1{}));
  using TmaK = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, typename L::SmemK{},
                                            cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{},
                                            cute::_1{}));
  using TmaV = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{}, typename L::SmemV{},
                                            cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>>{},
                                            cute::_1{}));
  static constexpr uint32_t kRowBytes = 2 * kBlockM * sizeof(float);  // lse and delta rows
  static constexpr uint32_t kTmaBytesQ = 2 * kBlockM * kHeadDim * sizeof(Element) + kRowBytes;
  static constexpr uint32_t kTmaBytesKV = 2 * kBlockN * kHeadDim * sizeof(Element);

  using Pipeline = cutlass::PipelineTmaAsync<kStages>;
  using PipelineState = cutlass::PipelineState<kStages>;

  struct SharedStorage {
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename L::SmemK>> k;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename L::SmemV>> v;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename L::SmemQ>> q;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename L::SmemQ>> dout;
    alignas(1024) cute::array_aligned<Element, cute::cosize_v<typename L::SmemdSt>> ds;
    alignas(128) cute::array_aligned<float, cute::cosize_v<typename L::SmemdQ>> dq;
    alignas(128) float lse_delta[kStages][2 * kBlockM];  // lse (log2, +inf: P = 0), then delta
    typename Pipeline::SharedStorage pipe;
    uint64_t barrier_kv;
  };
  static_assert(sizeof(SharedStorage) <= 227 * 1024, "sm_90a: at most 227 KB of shared memory");

  struct Params {
    TmaQ tma_q, tma_do;
    TmaK tma_k;
    TmaV tma_v;
    // [B, Hq, Spad / 64, 2, 64], stream order: per 64-row query tile its lse * log2 e (+inf:
    // the row contributes nothing) and its delta = rowsum(dO * O).
    const float* lse_delta;
    float* dq_accum;        // [B, Hq, S, D] stream order, fp32
    int32_t* dq_semaphore;  // [B, Hq, Spad / 64] zeros: deterministic dQ order; null: any order
    void* dk;               // [B, Hkv, S, D] token order, dk_stride
    void* dv;
    Strides dk_stride, dv_stride;
    const int32_t* perm;  // [S] stream position -> token
    jacobi::attn::TileLists lists;
    int32_t batch, heads_q, heads_kv, seq_len, seq_pad;
    float scale, scale_log2;  // softmax scale; scale * log2(e)
  };
};

namespace bwd_detail {

struct Work {
  int n_block, b, h_kv, group, e_begin, e_end;
};

// This CTA's key tile, batch, kv head, GQA group size and backward list range, from a blockIdx
// the compiler cannot see through (so that it computes them after the register split).
template <class Params>
__device__ __forceinline__ Work work(const Params& p) {
  uint32_t x = blockIdx.x, y = blockIdx.y;
  asm volatile("" : "+r"(x), "+r"(y));
  const int n_block = int(x);
  return {n_block, int(y) / p.heads_kv, int(y) % p.heads_kv, p.heads_q / p.heads_kv,
          p.lists.bwd_ptr[n_block], p.lists.bwd_ptr[n_block + 1]};
}

// Scatters this thread's rows of a (keys x head dim) accumulator to token order, times `mul`.
template <class Element, class Acc, class Coord>
__device__ __forceinline__ void store_rows(Acc const& acc, Coord const& coord, Element* base,
                                           int64_t row_stride, const int32_t* perm, int row0,
                                           int seq_len, float mul) {
  using namespace cute;
  CUTE_UNROLL
  for (int m = 0; m < size<0>(acc); ++m) {
    const int pos = row0 + get<0>(coord(m, 0));
    if (pos >= seq_len) continue;
    Element* row = base + int64_t(perm[pos]) * row_stride;
    CUTE_UNROLL
    for (int n = 0; n < size<1>(acc); ++n) row[get<1>(coord(m, n))] = Element(acc(m, n) * mul);
  }
}

// One row of fp32 shared memory (a shared-window address) added into global memory by the
// bulk-copy engine (cp.reduce.async.bulk, one bulk group per commit; bytes: a multiple of 16, both
// ends 16-byte aligned).
__device__ __forceinline__ void bulk_reduce_add(float* gmem, uint32_t smem, uint32_t bytes) {
  asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;"
               :
               : "l"(gmem), "r"(smem), "r"(bytes)
               : "memory");
}

// Waits until this thread's committed bulk groups have completed, their writes included (the
// .read form only waits until shared memory may be reused).
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" : : : "memory");
}

// Orders this thread's generic-proxy global accesses (the turn counter) with its async-proxy ones
// (the bulk reductions), both ways: the deterministic dQ hands turns over through the counter.
__device__ __forceinline__ void fence_proxy_async_global() {
  asm volatile("fence.proxy.async.global;" : : : "memory");
}

// The dQ writer (warp 1 of warpgroup 0): for each query half the consumers walk (the same walk,
// the same skips), waits for their dQ tile in shared memory, adds its rows that are inside S to
// dq_accum (two rows per lane), and returns the tile once read. With dq_semaphore, each half is
// added on this key tile's turn (dq_turn) and the counter is bumped once the writes are done.
// It runs in the producer warpgroup's 24 registers: few live values, loops not unrolled (a first
// version that kept the row pointers and the GQA group across the walk spilled 28 bytes).
template <class T>
__device__ __forceinline__ void write_dq(const typename T::Params& p, uint32_t sdq) {
  using Sem = cutlass::GenericBarrier<cutlass::detail::SyncwarpSync>;
  using L = typename T::L;
  // Only the loop counters live across the walk; the rest is re-read per step (blockIdx through
  // an empty asm, the lists and sizes from memory).
  auto blk = [] {
    uint32_t x = blockIdx.x, y = blockIdx.y;
    asm volatile("" : "+r"(x), "+r"(y));
    return make_int2(int(x), int(y));
  };
  bool first = true;
  const int group = p.heads_q / p.heads_kv;
#pragma unroll 1
  for (int g = 0; g < group; ++g) {
#pragma unroll 1
    for (int e = p.lists.bwd_ptr[blk().x]; e < p.lists.bwd_ptr[blk().x + 1]; ++e) {
#pragma unroll 1
      for (int half = 0; half < T::kHalves; ++half) {
        const int m_sub = p.lists.bwd_tile[e] * T::kHalves + half;  // 64-row query half
        if (m_sub * T::kBlockM >= p.seq_len) continue;  // past S: the consumers skip it too
        if (!first) {
          cute::tma_store_wait<0>();  // the previous tile's rows are read out of shared memory
          cutlass::arch::NamedBarrier::arrive(T::kDqThreads, T::kBarDqEmpty);
        }
        first = false;
        cutlass::arch::NamedBarrier::sync(T::kDqThreads, T::kBarDqFull);
        const int2 c = blk();
        const int b = c.y / p.heads_kv, h = (c.y % p.heads_kv) * group + g;
        const int bh = b * p.heads_q + h;
        const int lane = threadIdx.x % 32;
        if (p.dq_semaphore != nullptr) {
          Sem::wait_eq(p.dq_semaphore, lane, bh * (p.seq_pad / T::kBlockM) + m_sub,
                       jacobi::attn::dq_turn(p.lists, m_sub / T::kHalves, c.x));
          fence_proxy_async_global();  // our reductions after the previous turn's
        }
        CUTE_UNROLL
        for (int r = lane; r < T::kBlockM; r += 32) {
          const int pos = m_sub * T::kBlockM + r;
          if (pos < p.seq_len) {
            bulk_reduce_add(p.dq_accum + (int64_t(bh) * p.seq_len + pos) * T::kHeadDim,
                            sdq + uint32_t(r * L::kDqRowStride * sizeof(float)),
                            T::kHeadDim * sizeof(float));
          }
        }
        cute::tma_store_arrive();  // commit this lane's rows as one bulk group
        if (p.dq_semaphore != nullptr) {
          bulk_wait_all();  // the sums are in global memory before the next key tile's turn
          fence_proxy_async_global();
          Sem::arrive_inc(p.dq_semaphore, lane, bh * (p.seq_pad / T::kBlockM) + m_sub);
        }
      }
    }
  }
  bulk_wait_all();  // nothing in flight when the CTA ends
}

}  // namespace bwd_detail

template <class T>
__global__ void __launch_bounds__(T::kThreads, 1) bwd_sm90_kernel(const __grid_constant__ typename T::Params p) {
  using namespace cute;
  using Element = typename T::Element;
  using L = typename T::L;
  using Pipeline = typename T::Pipeline;
  using Barrier = cutlass::arch::ClusterTransactionBarrier;
  extern __shared__ __align__(1024) char smem_raw[];
  auto& ss = *reinterpret_cast<typename T::SharedStorage*>(smem_raw);

  const int warpgroup = threadIdx.x / 128;
  Tensor sK = make_tensor(make_smem_ptr(ss.k.data()), typename L::SmemK{});
  Tensor sV = make_tensor(make_smem_ptr(ss.v.data()), typename L::SmemV{});
  Tensor sQ = make_tensor(make_smem_ptr(ss.q.data()), typename L::SmemQ{});
  Tensor sdO = make_tensor(make_smem_ptr(ss.dout.data()), typename L::SmemQ{});
  Tensor sdSt = make_tensor(make_smem_ptr(ss.ds.data()), typename L::SmemdSt{});

  // Pipeline parameters of one role (the barriers' arrival counts and transaction bytes).
  auto pipe_params = [](bool producer, bool leader) {
    typename Pipeline::Params pp;
    pp.transaction_bytes = T::kTmaBytesQ;
    pp.role = producer ? Pipeline::ThreadCategory::Producer : Pipeline::ThreadCategory::Consumer;
    pp.is_leader = leader;
    pp.num_consumers = T::kMmaThreads;
    return pp;
  };
  if (threadIdx.x == 0) Barrier::init(&ss.barrier_kv, 1);
  // The pipelines' barriers (warp 0 initialises them); each role makes its own view below.
  Pipeline::init_barriers(ss.pipe, pipe_params(true, true), Shape<_1, _1, _1>{});
  __syncthreads();  // barrier initialisation visible to every warp
  // Each role derives its work and pipeline views after the register split (bwd_detail::work):
  // values computed before it would have to survive the producer's 24 registers (ptxas spilled).

  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
    if (threadIdx.x / 32 == 1) {
      bwd_detail::write_dq<T>(p, cute::cast_smem_ptr_to_uint(ss.dq.data()));  // the dQ writer
      return;
    }
    // ---- producer: one thread issues every load ------------------------------------------------
    if (threadIdx.x != 0) return;
    const auto [n_block, b, h_kv, group, e_begin, e_end] = bwd_detail::work(p);
    if (e_end == e_begin) return;
    Pipeline pipe(ss.pipe, pipe_params(true, true), Shape<_1, _1, _1>{}, cute::false_type{});
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.seq_len, int32_t(T::kHeadDim), p.heads_kv, p.batch));
    Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.seq_len, int32_t(T::kHeadDim), p.heads_kv, p.batch));
    Tensor gK = local_tile(mK(_, _, h_kv, b), Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{}, make_coord(n_block, 0));
    Tensor gV = local_tile(mV(_, _, h_kv, b), Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{}, make_coord(n_block, 0));
    auto [tKg, tKs] = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto [tVg, tVs] = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    Barrier::arrive_and_expect_tx(&ss.barrier_kv, T::kTmaBytesKV);
    copy(p.tma_k.with(ss.barrier_kv), tKg, tKs);
    copy(p.tma_v.with(ss.barrier_kv), tVg, tVs);
    // Q and dO of one (head, 64-row query tile) share their TMA coordinates.
    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.seq_len, int32_t(T::kHeadDim), p.heads_q, p.batch));
    auto [tQg, tQs] = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ),
                                    group_modes<0, 2>(local_tile(mQ, Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{}, make_coord(_, 0))));
    Tensor tdOs = get<1>(tma_partition(p.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO),
                                       group_modes<0, 2>(local_tile(mQ, Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{}, make_coord(_, 0)))));
    const int num_sub = p.seq_pad / T::kBlockM;
    auto st = cutlass::make_producer_start_state<Pipeline>();
    for (int g = 0; g < group; ++g) {
      const int h = h_kv * group + g;
      for (int e = e_begin; e < e_end; ++e) {
        for (int half = 0; half < T::kHalves; ++half) {
          const int m_sub = p.lists.bwd_tile[e] * T::kHalves + half;  // 64-row query tile
          if (m_sub * T::kBlockM >= p.seq_len) continue;                // past S
          pipe.producer_acquire(st);
          uint64_t* bar = pipe.producer_get_barrier(st);
          copy(p.tma_q.with(*bar), tQg(_, m_sub, h, b), tQs(_, st.index()));
          copy(p.tma_do.with(*bar), tQg(_, m_sub, h, b), tdOs(_, st.index()));
          SM90_BULK_COPY_G2S::copy(
              p.lse_delta + (int64_t(b * p.heads_q + h) * num_sub + m_sub) * (2 * T::kBlockM), bar,
              ss.lse_delta[st.index()], T::kRowBytes);
          ++st;
        }
      }
    }
    pipe.producer_tail(st);  // do not leave while loads are in flight
    return;
  }

  // ---- consumers -------------------------------------------------------------------------------
  cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
  const int tidx = threadIdx.x - 128;
  const auto [n_block, b, h_kv, group, e_begin, e_end] = bwd_detail::work(p);
  Pipeline pipe(ss.pipe, pipe_params(false, false), Shape<_1, _1, _1>{}, cute::false_type{});
  typename L::MmaSdP mma_sdp;
  typename L::MmaKV mma_kv;
  typename L::MmaDq mma_dq;
  auto thr_kv = mma_kv.get_thread_slice(tidx);
  // dS^T registers -> shared memory with stmatrix (the accumulator's rows = keys, columns =
  // queries, queries contiguous in sdSt: the non-transposed STSM).
  auto r2s_ds = make_tiled_copy_C(Copy_Atom<SM90_U32x4_STSM_N, Element>{}, mma_sdp);
  // Accumulators that live across the whole walk.
  Tensor tdKrdK = partition_fragment_C(mma_kv, Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{});
  Tensor tdVrdV = partition_fragment_C(mma_kv, Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{});
  clear(tdKrdK);
  clear(tdVrdV);
  // Tile coordinates: S^T (key, query), dK/dV (key, d), dQ (query, d).
  Tensor tKVc = thr_kv.partition_C(make_identity_tensor(Shape<Int<T::kBlockN>, Int<T::kHeadDim>>{}));
  Tensor cKV = make_tensor(tKVc.data(), rowcol(tKVc.layout()));
  constexpr int kKeyRows = 2;  // a thread holds keys r and r + 8 of the S^T accumulator

  if (e_end > e_begin) Barrier::wait(&ss.barrier_kv, 0);
  typename T::PipelineState st;  // consumer start: stage 0, phase 0
  int buf = 0;                   // dS double buffer
  bool first_dq = true;          // the dQ tile is free before the first half
  for (int g = 0; g < group; ++g) {
    const int h = h_kv * group + g;
    for (int e = e_begin; e < e_end; ++e) {
      const int mask = p.lists.bwd_mask[e];
      const int m_tile = p.lists.bwd_tile[e];
      for (int half = 0; half < T::kHalves; ++half) {
        if (m_tile * kTileM + half * T::kBlockM >= p.seq_len) continue;  // past S (write_dq too)
        // Thread-dependent coordinates and addresses, also rebuilt per step from a thread index
        // the compiler cannot see through: hoisted out of the loop, they were spilled.
        int tid_step = threadIdx.x;
        asm volatile("" : "+r"(tid_step));
        tid_step -= 128;
        auto thr_sdp = mma_sdp.get_thread_slice(tid_step);
        auto thr_dq = mma_dq.get_thread_slice(tid_step);
        Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<T::kBlockN>, Int<T::kBlockM>>{}));
        Tensor cS = make_tensor(tScS.data(), rowcol(tScS.layout()));
        static_assert(decltype(size<0>(cS))::value == kKeyRows);
        // Operands: shared-memory descriptors, rebuilt here from a base the compiler cannot see
        // through, so that it does not hoist 8 64-bit descriptors per operand out of the loop
        // (it did, and spilled them).
        char* base = smem_raw;
        asm volatile("" : "+l"(base));
        auto& sl = *reinterpret_cast<typename T::SharedStorage*>(base);
        Tensor tSrK = thr_sdp.partition_fragment_A(make_tensor(make_smem_ptr(sl.k.data()), typename L::SmemK{}));
        Tensor tSrQ = thr_sdp.partition_fragment_B(make_tensor(make_smem_ptr(sl.q.data()), typename L::SmemQ{}));
        Tensor tdPrV = thr_sdp.partition_fragment_A(make_tensor(make_smem_ptr(sl.v.data()), typename L::SmemV{}));
        Tensor tdPrdO = thr_sdp.partition_fragment_B(make_tensor(make_smem_ptr(sl.dout.data()), typename L::SmemQ{}));
        Tensor tdVrdOt = thr_kv.partition_fragment_B(make_tensor(make_smem_ptr(sl.dout.data()), typename L::SmemQt{}));
        Tensor tdKrQt = thr_kv.partition_fragment_B(make_tensor(make_smem_ptr(sl.q.data()), typename L::SmemQt{}));
        Tensor tdQrdS = thr_dq.partition_fragment_A(make_tensor(make_smem_ptr(sl.ds.data()), typename L::SmemdS{}));
        Tensor tdQrKt = thr_dq.partition_fragment_B(make_tensor(make_smem_ptr(sl.k.data()), typename L::SmemKt{}));
        Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<T::kBlockN>, Int<T::kBlockM>>{});
        Tensor tdPrdP = partition_fragment_C(mma_sdp, Shape<Int<T::kBlockN>, Int<T::kBlockM>>{});
        pipe.consumer_wait(st);
        wg_gemm<true, false>(mma_sdp, tSrK, tSrQ(_, _, _, st.index()), tSrS);
        wg_gemm<true, false>(mma_sdp, tdPrV, tdPrdO(_, _, _, st.index()), tdPrdP);
        Tensor S = make_tensor(tSrS.data(), rowcol(tSrS.layout()));
        Tensor dP = make_tensor(tdPrdP.data(), rowcol(tdPrdP.layout()));
        const float* lse = ss.lse_delta[st.index()];
        const float* delta = lse + T::kBlockM;
        warpgroup_wait<1>();  // S^T done
        warpgroup_fence_operand(tSrS);  // no read of it moves above the wait
        if (mask >= 0) {
          // Partial pair: bit (key % 32) of word key / 32 of the query's mask row.
          const uint32_t* words = p.lists.masks +
                                  (int64_t(mask) * kTileM + half * T::kBlockM) * 4 +
                                  get<0>(cS(0, 0)) / 32;  // keys r, r + 8: one 32-key word
          CUTE_UNROLL
          for (int n = 0; n < size<1>(S); ++n) {
            const uint32_t w = __ldg(words + get<1>(cS(0, n)) * 4);
            CUTE_UNROLL
            for (int m = 0; m < kKeyRows; ++m) {
              if (!((w >> (get<0>(cS(m, n)) & 31)) & 1u)) S(m, n) = -INFINITY;
            }
          }
        }
        CUTE_UNROLL
        for (int n = 0; n < size<1>(S); ++n) {
          const float l = lse[get<1>(cS(0, n))];
          CUTE_UNROLL
          for (int m = 0; m < kKeyRows; ++m) S(m, n) = exp2f(S(m, n) * p.scale_log2 - l);
        }
        // dV += P^T dO (P^T from registers), issued before dS^T is computed: the tensor cores
        // run it while this warpgroup does dS^T's elementwise work (rP is not touched until the
        // wait below the dK GEMM: a wgmma's register operand may not be accessed while it runs).
        Tensor rP = make_tensor_like<Element>(tSrS);
        CUTE_UNROLL
        for (int i = 0; i < size(tSrS); ++i) rP(i) = Element(tSrS(i));
        Tensor tdVrP = make_tensor(rP.data(), acc_as_operand_a(tSrS.layout()));
        wg_gemm<false, true>(mma_kv, tdVrP, tdVrdOt(_, _, _, st.index()), tdVrdV);
        warpgroup_wait<1>();  // dP^T done (the dV GEMM may still run)
        warpgroup_fence_operand(tdPrdP);
        CUTE_UNROLL
        for (int n = 0; n < size<1>(S); ++n) {
          const float d = delta[get<1>(cS(0, n))];
          CUTE_UNROLL
          for (int m = 0; m < kKeyRows; ++m) dP(m, n) = S(m, n) * (dP(m, n) - d);
        }
        // dS^T to shared memory for dQ, then dK += dS^T Q (dS^T from registers: stored first,
        // since the registers may not be read while the GEMM that takes them runs).
        Tensor rdS = make_tensor_like<Element>(tdPrdP);
        CUTE_UNROLL
        for (int i = 0; i < size(tdPrdP); ++i) rdS(i) = Element(tdPrdP(i));
        auto thr_r2s_ds = r2s_ds.get_thread_slice(tid_step);
        copy(r2s_ds, thr_r2s_ds.retile_S(rdS), thr_r2s_ds.partition_D(sdSt)(_, _, _, buf));
        Tensor tdKrdS = make_tensor(rdS.data(), acc_as_operand_a(tdPrdP.layout()));
        wg_gemm<false, true>(mma_kv, tdKrdS, tdKrQt(_, _, _, st.index()), tdKrdK);
        // dV and dK done before dQ's accumulator is live: their A operands (rP, rdS: 32
        // registers) are pinned until then, and with dQ's 32 on top ptxas spilled.
        warpgroup_wait<0>();
        warpgroup_fence_operand(tdVrP);  // live until here: no reuse of their registers while
        warpgroup_fence_operand(tdKrdS);  // the GEMMs that read them may still run
        // Both warpgroups' dS^T rows written (and visible to the async proxy) before dQ reads them.
        cutlass::arch::fence_view_async_shared();
        cutlass::arch::NamedBarrier::sync(T::kMmaThreads, T::kBarDs);
        Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<Int<T::kBlockM>, Int<T::kHeadDim>>{});
        Tensor tdQrdS_buf = tdQrdS(_, _, _, buf);
        wg_gemm<true, false>(mma_dq, tdQrdS_buf, tdQrKt, tdQrdQ);
        warpgroup_wait<0>();  // dQ done: Q, dO, lse and delta of this stage are free
        warpgroup_fence_operand(tdQrdQ);
        pipe.consumer_release(st);
        ++st;
        buf ^= 1;
        // dQ partial of this key tile to shared memory, for the dQ writer (scaled later); the
        // previous half's tile must have been read out first.
        if (!first_dq) cutlass::arch::NamedBarrier::sync(T::kDqThreads, T::kBarDqEmpty);
        first_dq = false;
        Tensor sdQ = make_tensor(make_smem_ptr(ss.dq.data()), typename L::SmemdQ{});  // ss: STS, not ST
        copy(tdQrdQ, thr_dq.partition_C(sdQ));
        cutlass::arch::fence_view_async_shared();  // visible to the bulk copies (async proxy)
        cutlass::arch::NamedBarrier::arrive(T::kDqThreads, T::kBarDqFull);
      }
    }
  }

  // ---- epilogue: dK (scaled) and dV, rows scattered to token order -----------------------------
  Tensor dK = make_tensor(tdKrdK.data(), rowcol(tdKrdK.layout()));
  Tensor dV = make_tensor(tdVrdV.data(), rowcol(tdVrdV.layout()));
  const int key_row0 = n_block * T::kBlockN;
  Element* dk = static_cast<Element*>(p.dk) + int64_t(b) * p.dk_stride.batch + int64_t(h_kv) * p.dk_stride.head;
  Element* dv = static_cast<Element*>(p.dv) + int64_t(b) * p.dv_stride.batch + int64_t(h_kv) * p.dv_stride.head;
  bwd_detail::store_rows(dK, cKV, dk, p.dk_stride.row, p.perm, key_row0, p.seq_len, p.scale);
  bwd_detail::store_rows(dV, cKV, dv, p.dv_stride.row, p.perm, key_row0, p.seq_len, 1.f);
}

// Host side: TMA descriptors for the stream-ordered q/k/v/dout and the launch.
template <typename Element, int kHeadDim>
cudaError_t run_bwd_sm90(const BwdParams& bp, cudaStream_t stream) {
  using namespace cute;
  using T = BwdTraits<Element, kHeadDim>;
  using L = typename T::L;
  const Sm90BwdInputs& in = bp.sm90;
  const int32_t S = bp.seq_len;
  auto gmem = [&](const void* ptr, int32_t heads) {
    return make_tensor(make_gmem_ptr(static_cast<const Element*>(ptr)),
                       make_layout(make_shape(S, int32_t(kHeadDim), heads, bp.batch),
                                   make_stride(int64_t(kHeadDim), _1{}, int64_t(S) * kHeadDim,
                                               int64_t(heads) * S * kHeadDim)));
  };
  auto box_q = Shape<Int<T::kBlockM>, Int<kHeadDim>>{};
  auto box_kv = Shape<Int<T::kBlockN>, Int<kHeadDim>>{};
  typename T::Params p{
      make_tma_copy(SM90_TMA_LOAD{}, gmem(in.q, bp.heads_q), take<0, 2>(typename L::SmemQ{}), box_q, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, gmem(in.dout, bp.heads_q), take<0, 2>(typename L::SmemQ{}), box_q, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, gmem(in.k, bp.heads_kv), typename L::SmemK{}, box_kv, _1{}),
      make_tma_copy(SM90_TMA_LOAD{}, gmem(in.v, bp.heads_kv), typename L::SmemV{}, box_kv, _1{}),
      in.lse_delta, in.dq_accum, in.dq_semaphore, bp.dk, bp.dv, bp.dk_stride, bp.dv_stride, in.perm,
      in.lists, bp.batch, bp.heads_q, bp.heads_kv, S, in.lists.num_q_tiles * kTileM,
      bp.scale, bp.scale * jacobi::attn::kLog2e};
  const int smem = int(sizeof(typename T::SharedStorage));
  auto kernel = bwd_sm90_kernel<T>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  if (err != cudaSuccess) return err;
  const dim3 grid(unsigned(in.lists.num_k_tiles), unsigned(bp.batch * bp.heads_kv));
  kernel<<<grid, T::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace jacobi::cuda::attn::sm90

// Device helpers shared by the attention kernels: register-fragment GEMMs, fragment layout views,
// and the row-gathering copies that implement the token permutation.
#pragma once

#include <cute/tensor.hpp>

#include <cstdint>

namespace jacobi::cuda::attn {

using namespace cute;

// Shared-memory rows are stored as "pages" of this many columns (swizzled in 16-byte chunks):
// 64 (128 bytes) when the head dim is a multiple of 64, else 32 (head dim 96). kernel_traits.h
// builds the smem layouts from it and the row copies below walk the same pages.
constexpr int smem_page_cols(int head_dim) { return head_dim % 64 == 0 ? 64 : 32; }

// ---- GEMMs on register fragments ---------------------------------------------------------------
// acc += A B^T, both operands streamed from shared memory one k-slice ahead of the MMA
// (ldmatrix for slice i+1 is issued before the MMAs of slice i).
template <class TiledMma, class TA, class TB, class TC, class SA, class SB, class CopyA,
          class CopyB, class ThrCopyA, class ThrCopyB>
__device__ __forceinline__ void gemm_ss(TC& acc, TA& tCrA, TB& tCrB, SA const& tCsA,
                                        SB const& tCsB, TiledMma const& tiled_mma,
                                        CopyA const& copy_a, CopyB const& copy_b,
                                        ThrCopyA const& thr_copy_a, ThrCopyB const& thr_copy_b) {
  Tensor tCrA_view = thr_copy_a.retile_D(tCrA);
  Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
  CUTE_STATIC_ASSERT_V(size<1>(tCsA) == size<1>(tCrA_view));
  CUTE_STATIC_ASSERT_V(size<1>(tCsB) == size<1>(tCrB_view));
  cute::copy(copy_a, tCsA(_, _, _0{}), tCrA_view(_, _, _0{}));
  cute::copy(copy_b, tCsB(_, _, _0{}), tCrB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int i = 0; i < size<2>(tCrA); ++i) {
    if (i < size<2>(tCrA) - 1) {
      cute::copy(copy_a, tCsA(_, _, i + 1), tCrA_view(_, _, i + 1));
      cute::copy(copy_b, tCsB(_, _, i + 1), tCrB_view(_, _, i + 1));
    }
    cute::gemm(tiled_mma, tCrA(_, _, i), tCrB(_, _, i), acc);
  }
}

// acc += A B^T with A already in registers (P or dS of the previous GEMM).
template <class TiledMma, class TA, class TB, class TC, class SB, class CopyB, class ThrCopyB>
__device__ __forceinline__ void gemm_rs(TC& acc, TA const& tCrA, TB& tCrB, SB const& tCsB,
                                        TiledMma const& tiled_mma, CopyB const& copy_b,
                                        ThrCopyB const& thr_copy_b) {
  Tensor tCrB_view = thr_copy_b.retile_D(tCrB);
  CUTE_STATIC_ASSERT_V(size<1>(tCsB) == size<1>(tCrB_view));
  cute::copy(copy_b, tCsB(_, _, _0{}), tCrB_view(_, _, _0{}));
  CUTE_UNROLL
  for (int i = 0; i < size<2>(tCrA); ++i) {
    if (i < size<2>(tCrA) - 1) cute::copy(copy_b, tCsB(_, _, i + 1), tCrB_view(_, _, i + 1));
    cute::gemm(tiled_mma, tCrA(_, _, i), tCrB(_, _, i), acc);
  }
}

// ---- fragment layout views ---------------------------------------------------------------------
// Accumulator of SM80 16x8 MMAs, ((2, 2), MMA_M, MMA_N), viewed as (rows, cols) of this thread:
// ((2, MMA_M), (2, MMA_N)). Row r of the view is one row of the tile for every column index.
template <class Layout>
__device__ __forceinline__ auto acc_rowcol(Layout acc_layout) {
  static_assert(decltype(size<0>(acc_layout))::value == 4);
  static_assert(decltype(rank(acc_layout))::value == 3);
  auto l = logical_divide(acc_layout, Shape<_2>{});  // ((2, 2), MMA_M, MMA_N)
  return make_layout(make_layout(get<0, 1>(l), get<1>(l)),
                     make_layout(get<0, 0>(l), get<2>(l)));
}

// The same accumulator as the A operand of a 16x8x16 MMA: two adjacent 8-column accumulator
// tiles form one 16-deep k-slice, ((2, 2, 2), MMA_M, MMA_N / 2).
template <class Layout>
__device__ __forceinline__ auto acc_as_a_operand(Layout acc_layout) {
  static_assert(decltype(size<0>(acc_layout))::value == 4);
  static_assert(decltype(rank(acc_layout))::value == 3);
  auto l = logical_divide(acc_layout, Shape<Underscore, Underscore, _2>{});
  return make_layout(make_layout(get<0>(l), get<2, 0>(l)), get<1>(l), get<2, 1>(l));
}

template <typename To, class Engine, class Layout>
__device__ __forceinline__ auto convert_fragment(Tensor<Engine, Layout> const& src) {
  Tensor dst = make_tensor<To>(src.layout());
  CUTE_UNROLL
  for (int i = 0; i < size(src); ++i) dst(i) = To(src(i));
  return dst;
}

// ---- reductions across the 4 lanes that share an accumulator row --------------------------------
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 2);
  return x + __shfl_xor_sync(0xffffffffu, x, 1);
}

// ---- gathered row copies (the token permutation) ------------------------------------------------
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem, bool valid) {
  const uint32_t s = cast_smem_ptr_to_uint(smem);
  const int src_size = valid ? 16 : 0;  // 0: zero-fill, nothing is read
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem),
               "r"(src_size));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Rows p0 .. p0 + kRows - 1 of the permuted order, i.e. gmem rows perm[p], into a swizzled smem
// tile. kPage / 8 threads per page of a row (16 bytes each): a warp writes whole 128- or 64-byte
// page rows, conflict-free under the swizzle. Rows at or past seq_len are zero-filled.
template <int kRows, int kHeadDim, int kNThreads, class SmemLayout, typename Element>
__device__ __forceinline__ void gather_rows_async(Element* smem, const Element* gmem,
                                                  int64_t row_stride, const int32_t* perm,
                                                  int p0, int seq_len, int tid) {
  constexpr int kPage = smem_page_cols(kHeadDim);
  constexpr int kThreadsPerRow = kPage / 8;
  constexpr int kRowsPerPass = kNThreads / kThreadsPerRow;
  static_assert(kHeadDim % kPage == 0 && kRows % kRowsPerPass == 0);
  const int chunk = (tid % kThreadsPerRow) * 8;
  CUTE_UNROLL
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const int r = tid / kThreadsPerRow + pass * kRowsPerPass;
    const int p = p0 + r;
    const bool valid = p < seq_len;
    const Element* src = gmem + (valid ? int64_t(__ldg(perm + p)) * row_stride : 0) + chunk;
    CUTE_UNROLL
    for (int page = 0; page < kHeadDim / kPage; ++page) {
      cp_async_16(smem + SmemLayout{}(r, page * kPage + chunk), src + page * kPage, valid);
    }
  }
}

// The inverse: smem tile rows to gmem rows perm[p] (rows at or past seq_len are not stored).
template <int kRows, int kHeadDim, int kNThreads, class SmemLayout, typename Element>
__device__ __forceinline__ void scatter_rows(Element* gmem, int64_t row_stride,
                                             const Element* smem, const int32_t* perm, int p0,
                                             int seq_len, int tid) {
  constexpr int kPage = smem_page_cols(kHeadDim);
  constexpr int kThreadsPerRow = kPage / 8;
  constexpr int kRowsPerPass = kNThreads / kThreadsPerRow;
  static_assert(kHeadDim % kPage == 0 && kRows % kRowsPerPass == 0);
  const int chunk = (tid % kThreadsPerRow) * 8;
  CUTE_UNROLL
  for (int pass = 0; pass < kRows / kRowsPerPass; ++pass) {
    const int r = tid / kThreadsPerRow + pass * kRowsPerPass;
    const int p = p0 + r;
    if (p < seq_len) {
      Element* dst = gmem + int64_t(__ldg(perm + p)) * row_stride + chunk;
      CUTE_UNROLL
      for (int page = 0; page < kHeadDim / kPage; ++page) {
        *reinterpret_cast<uint4*>(dst + page * kPage) =
            *reinterpret_cast<const uint4*>(smem + SmemLayout{}(r, page * kPage + chunk));
      }
    }
  }
}

}  // namespace jacobi::cuda::attn

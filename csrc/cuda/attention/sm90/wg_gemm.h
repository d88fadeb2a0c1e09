// The one warpgroup-GEMM step of the sm_90a attention kernels (fwd_sm90.h, bwd_sm90.h): a wgmma
// over all K blocks of the operands, committed as one batch and not waited for, so that a kernel
// can issue several GEMMs and wait with warpgroup_wait<N>() where their results are needed.
#pragma once

#include <cute/tensor.hpp>
#include <cute/atom/mma_atom.hpp>

namespace jacobi::cuda::attn::sm90 {

// kZeroInit: the first K block overwrites the accumulator (c = a b), else c += a b. kRegA: the A
// operand is in registers (its fences keep the compiler from moving it across the wgmma).
template <bool kZeroInit, bool kRegA, class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void wg_gemm(Mma& mma, TA& a, TB const& b, TC& c) {
  using namespace cute;
  if constexpr (kRegA) warpgroup_fence_operand(a);
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  if constexpr (kZeroInit) mma.accumulate_ = GMMA::ScaleOut::Zero;
  CUTE_UNROLL
  for (int kb = 0; kb < size<2>(a); ++kb) {
    gemm(mma, a(_, _, kb), b(_, _, kb), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
  if constexpr (kRegA) warpgroup_fence_operand(a);
}

}  // namespace jacobi::cuda::attn::sm90

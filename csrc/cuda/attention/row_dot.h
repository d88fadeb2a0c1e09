// delta = rowsum(dO * O) of one query row over the head dim, by a group of 16 lanes: coalesced
// along the row, reduced with shuffles inside the group. Both backwards' preprocessing kernels
// (bwd_dsum_kernel in attention_cuda.cu, bwd_sm90_prep_kernel in sm90/attention_sm90.cu) use
// it. Every lane of the warp must call it (the shuffles); `valid` false gives 0.
#pragma once

#include <cstdint>

#include "cuda/attention/attention_cuda.h"

namespace jacobi::cuda::attn {

template <typename Element>
__device__ __forceinline__ float row_dot16(const BwdParams& p, bool valid, int64_t b, int64_t h,
                                           int64_t token, int lane) {
  float acc = 0.f;
  if (valid) {
    const Element* o = static_cast<const Element*>(p.out) + b * p.o_stride.batch +
                       h * p.o_stride.head + token * p.o_stride.row;
    const Element* d = static_cast<const Element*>(p.dout) + b * p.do_stride.batch +
                       h * p.do_stride.head + token * p.do_stride.row;
    for (int c = lane; c < p.head_dim; c += 16) acc += float(o[c]) * float(d[c]);
  }
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
  return acc;
}

}  // namespace jacobi::cuda::attn

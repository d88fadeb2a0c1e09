// The per-row pieces both backwards share (the sm_80 one in attention_cuda.cu, the sm_90a one in
// sm90/attention_sm90.cu): delta = rowsum(dO * O) before the main kernel, and the fp32 dQ
// accumulator scaled, cast and stored after it.
#pragma once

#include <cstdint>

#include "cuda/attention/attention_cuda.h"

namespace jacobi::cuda::attn {

// delta of one query row over the head dim, by a group of 16 lanes: coalesced along the row,
// reduced with shuffles inside the group. Every lane of the warp must call it (the shuffles);
// `valid` false gives 0.
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

// Element i of the fp32 dQ accumulator ([B, Hq, S, D], row s = position s) times the softmax
// scale, cast, into dq (strided, token order): row s is token perm[s], or s without a perm.
template <typename Element>
__device__ __forceinline__ void store_dq(const BwdParams& p, const float* accum,
                                         const int32_t* perm, int64_t i) {
  const int64_t c = i % p.head_dim;
  const int64_t s = (i / p.head_dim) % p.seq_len;
  const int64_t h = (i / (int64_t(p.head_dim) * p.seq_len)) % p.heads_q;
  const int64_t b = i / (int64_t(p.head_dim) * p.seq_len * p.heads_q);
  const int64_t tok = perm != nullptr ? perm[s] : s;
  static_cast<Element*>(p.dq)[b * p.dq_stride.batch + h * p.dq_stride.head +
                              tok * p.dq_stride.row + c] = Element(accum[i] * p.scale);
}

}  // namespace jacobi::cuda::attn

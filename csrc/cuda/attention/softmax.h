// Online softmax over key tiles (FlashAttention-2 style), on the (rows, cols) view of the score
// accumulator. Scores arrive unscaled; scale_log2 = scale * log2(e) folds the softmax scale into
// exp2. Rows that have seen only masked keys keep max = -inf and contribute nothing.
#pragma once

#include <cute/tensor.hpp>

#include <cmath>

#include "cuda/attention/utils.h"

namespace jacobi::cuda::attn {

using namespace cute;

template <int kRows>
struct OnlineSoftmax {
  float row_max[kRows];
  float row_sum[kRows];  // partial per thread until finalize() reduces over the quad

  __device__ __forceinline__ OnlineSoftmax() {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      row_max[r] = -INFINITY;
      row_sum[r] = 0.f;
    }
  }

  // scores (rows, cols) -> probabilities relative to the running max; acc_o (rows, cols of the
  // output) and row_sum are rescaled to the new max.
  template <class TensorS, class TensorO>
  __device__ __forceinline__ void update(TensorS& scores, TensorO& acc_o, float scale_log2) {
    static_assert(decltype(size<0>(scores))::value == kRows);
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      float m = row_max[r];
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) m = fmaxf(m, scores(r, c));
      m = quad_max(m);
      // A row with no visible key so far keeps -inf; use 0 as its reference so exp2 gives 0
      // instead of NaN, and the (zero) accumulator is scaled by exp2(-inf) = 0.
      const float m_ref = m == -INFINITY ? 0.f : m;
      const float factor = exp2f((row_max[r] - m_ref) * scale_log2);
      row_max[r] = m;
      row_sum[r] *= factor;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(acc_o); ++c) acc_o(r, c) *= factor;
      const float m_scaled = m_ref * scale_log2;
      float s = 0.f;
      CUTE_UNROLL
      for (int c = 0; c < size<1>(scores); ++c) {
        scores(r, c) = exp2f(scores(r, c) * scale_log2 - m_scaled);
        s += scores(r, c);
      }
      row_sum[r] += s;
    }
  }

  // Normalises acc_o and returns the natural-log LSE of each row in lse[] (-inf for a row that
  // saw nothing; its output is 0).
  template <class TensorO>
  __device__ __forceinline__ void finalize(TensorO& acc_o, float scale, float (&lse)[kRows]) {
    CUTE_UNROLL
    for (int r = 0; r < kRows; ++r) {
      const float sum = quad_sum(row_sum[r]);
      const bool empty = sum == 0.f || sum != sum;
      const float inv = empty ? 0.f : 1.f / sum;
      lse[r] = empty ? -INFINITY : row_max[r] * scale + logf(sum);
      CUTE_UNROLL
      for (int c = 0; c < size<1>(acc_o); ++c) acc_o(r, c) *= inv;
    }
  }
};

}  // namespace jacobi::cuda::attn

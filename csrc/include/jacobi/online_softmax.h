// The online-softmax bookkeeping of one query row, shared by the CPU kernel (attention_cpu.cpp)
// and the sm_90a kernel (csrc/cuda/attention/sm90/fwd_sm90.h), so that the -inf rules, the
// rescaling and the log-sum-exp are one code. Torch-free, header-only, __host__ __device__.
//
// A row sees its key tiles one at a time. Logits x are in "units" (raw scores on the GPU, scores
// already multiplied by the softmax scale on the CPU); `to_log2` turns units into log2 (GPU:
// scale * log2(e), CPU: log2(e)), so that p = exp2((x - max) * to_log2) = exp(scale * (x - max)).
//   per tile:  corr = softmax_rescale(row, tile_max, to_log2);   (row.max updated)
//              base = softmax_exp_base(row) * to_log2;            p = exp2(x * to_log2 - base)
//              scale the row's output accumulator by corr;  softmax_add(row, corr, sum of p)
//   at the end: out *= softmax_inv_sum(row);  lse = softmax_lse(row, units_to_nat)
// `sum` may be a per-thread partial sum (the GPU's quad of threads splits a row) as long as the
// partials share `max`: corr is the same for all of them, and they are added before the end.
//
// A row that has seen nothing visible (max = -inf) has corr 0, base 0 (so exp2(-inf - 0) = 0, no
// NaN from -inf - -inf), sum 0, output 0 and lse -inf.
#pragma once

#include <math.h>

#if defined(__CUDACC__)
#define JACOBI_SOFTMAX_HD __host__ __device__ __forceinline__
#else
#define JACOBI_SOFTMAX_HD inline
#endif

namespace jacobi::attn {

constexpr float kLog2e = 1.4426950408889634f;

struct SoftmaxRow {
  float max;  // running max of the visible logits (units), -inf before any
  float sum;  // running sum of exp((x - max) ...), relative to `max`
};

JACOBI_SOFTMAX_HD SoftmaxRow softmax_init() { return {-INFINITY, 0.f}; }

// Folds a tile's row max in; returns the factor that rescales everything accumulated so far
// (the output row and `sum`): exp(old max - new max), 1 if the max did not move, 0 if the row had
// seen nothing before.
JACOBI_SOFTMAX_HD float softmax_rescale(SoftmaxRow& row, float tile_max, float to_log2) {
  const float m_new = fmaxf(row.max, tile_max);
  const float corr = row.max == -INFINITY ? 0.f : exp2f((row.max - m_new) * to_log2);
  row.max = m_new;
  return corr;
}

// What the exponents subtract (units): the max, or 0 while the row has seen nothing.
JACOBI_SOFTMAX_HD float softmax_exp_base(const SoftmaxRow& row) {
  return row.max == -INFINITY ? 0.f : row.max;
}

JACOBI_SOFTMAX_HD void softmax_add(SoftmaxRow& row, float corr, float tile_sum) {
  row.sum = row.sum * corr + tile_sum;
}

// The final normalisation of the output row (0 for a row that saw nothing: output 0).
JACOBI_SOFTMAX_HD float softmax_inv_sum(const SoftmaxRow& row) {
  return row.sum > 0.f ? 1.f / row.sum : 0.f;
}

// Natural-log log-sum-exp of the row, in the scale of the true scores: units_to_nat = the
// softmax scale on the GPU (raw scores), 1 on the CPU (pre-scaled scores). -inf if nothing seen.
JACOBI_SOFTMAX_HD float softmax_lse(const SoftmaxRow& row, float units_to_nat) {
  return row.sum > 0.f ? row.max * units_to_nat + logf(row.sum) : -INFINITY;
}

}  // namespace jacobi::attn

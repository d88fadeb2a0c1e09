// The per-element math of a decoding step's small fused ops, once, for the CPU kernels
// (csrc/cpu/decode_cpu.cpp, csrc/torch/decode_ops.cpp) and their CUDA twins
// (csrc/cuda/decode_cuda.cu): the RMSNorm of a row, the rotary embedding of one feature, SiLU
// times up, the step plan's visibility rule (which cache slots a query sees), the order of the
// keys the CUDA attention walks, the K/V commit's copy order and the merge of split-K partials.
// Torch-free, header-only, __host__ __device__ (hd.h).
//
// Rounding: `round` is the caller's "round to the tensor's dtype and back" (identity for fp32,
// fp32 -> bf16 -> fp32 for bf16), applied exactly where transformers' eager ops round, so that
// both devices compute what the model's own modules compute, product by product. The fp32
// products and sums go through *_rn: IEEE round-to-nearest whatever the compiler's flags (nvcc
// contracts a * b + c into an FMA by default; torch's elementwise kernels round each product).
// The CUDA twins build without --use_fast_math (CMakeLists.txt): under it __fmul_rn and
// __fadd_rn flush denormal inputs and results to zero, and comparisons (greedy_better) see a
// denormal as +-0, where torch and the CPU kernels keep them.
#pragma once

#include <math.h>
#include <stdint.h>

#include "jacobi/hd.h"

namespace jacobi::decode {

// ---- exactly rounded fp32 arithmetic --------------------------------------------------------
JACOBI_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
JACOBI_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
JACOBI_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
JACOBI_HD float sqrt_rn(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return sqrtf(a);
#endif
}

// ---- RMSNorm (transformers' LlamaRMSNorm) -----------------------------------------------------
// h = residual + x, rounded to the dtype (the residual add before the norm).
template <typename Round>
JACOBI_HD float residual_add(float residual, float x, Round round) {
  return round(add_rn(residual, x));
}
// 1 / sqrt(mean(h^2) + eps) from the row's sum of squares (each square exact in double, the sum
// in double: the order of the sum then moves the result by far less than fp32's rounding).
JACOBI_HD float rms_inverse(double sum_of_squares, int64_t n, float eps) {
  const float var = static_cast<float>(sum_of_squares / static_cast<double>(n));
  return div_rn(1.f, sqrt_rn(add_rn(var, eps)));
}
// One output: weight * (h * inv rounded to the dtype), rounded to the dtype.
template <typename Round>
JACOBI_HD float rms_output(float h, float inv, float weight, Round round) {
  return round(mul_rn(weight, round(mul_rn(h, inv))));
}

// ---- rotary embedding (transformers' apply_rotary_pos_emb) ----------------------------------
// Feature d of x * cos + rotate_half(x) * sin: rotate_half takes -x[d + D/2] in the first half
// and x[d - D/2] in the second (rope_partner), each product and the sum rounded to the dtype.
JACOBI_HD int64_t rope_partner(int64_t d, int64_t D) { return d < D / 2 ? d + D / 2 : d - D / 2; }
template <typename Round>
JACOBI_HD float rope_element(float x, float partner, bool first_half, float cos_d, float sin_d,
                             Round round) {
  const float rotated = first_half ? round(-partner) : partner;
  const float a = round(mul_rn(x, cos_d));
  const float b = round(mul_rn(rotated, sin_d));
  return round(add_rn(a, b));
}

// ---- SiLU times up (transformers' act_fn(gate) * up) ------------------------------------------
// silu(g) = g / (1 + exp(-g)) in fp32. (The CPU kernel computes the same expression with a
// vectorised exp; the CUDA one with the device's exp.)
JACOBI_HD float silu(float g) { return g / (1.f + expf(-g)); }
// The output from silu(gate) (fp32) and up: silu rounded to the dtype, times up, rounded.
template <typename Round>
JACOBI_HD float silu_times_up(float act, float up, Round round) {
  return round(mul_rn(round(act), up));
}

// ---- the step plan's visibility (jacobi_ext.decoding.masks.step_mask) ------------------------
// A step feeds Q tokens per sequence; token i writes scratch slot i; seg[i] is its row (-1:
// padding), off[i] its offset in the row. The sequence's committed tokens are the slots
// [lo, hi). A real query sees every committed slot, and the scratch slots of its own row at
// offsets up to its own; a padding query sees its own slot only (no softmax row is empty).
JACOBI_HD bool step_sees_committed(int64_t seg_q, int64_t slot, int64_t lo, int64_t hi) {
  return seg_q >= 0 && slot >= lo && slot < hi;
}
JACOBI_HD bool step_sees_scratch(int64_t seg_q, int64_t off_q, int64_t seg_k, int64_t off_k,
                                 bool same_slot) {
  return seg_q >= 0 ? (seg_k >= 0 && seg_k == seg_q && off_k <= off_q) : same_slot;
}

// The order the CUDA decode attention walks a sequence's keys in: key t < hi - lo is the
// committed slot lo + t, then the step's scratch slots 0, 1, ... So key t of the main row (row
// 0, fed from scratch slot 0) is the token at position t: its sums meet the same keys in the
// same places in an AR step and in a Jacobi step, whatever else the step feeds.
JACOBI_HD int64_t step_key_slot(int64_t t, int64_t lo, int64_t hi) {
  return t < hi - lo ? lo + t : t - (hi - lo);
}
JACOBI_HD int64_t step_keys(int64_t lo, int64_t hi, int64_t Q) { return hi - lo + Q; }

// A sequence's committed range [lo, hi) as the CUDA attention reads it: Q <= lo <= hi <=
// capacity. Every plan the runtime makes is so already (lo = scratch + padding >= Q, and the
// host raises when a commit would pass the capacity); a plan that is not (a commit the kernel
// skipped because it did not fit, while hi still moved) then reads only this sequence's own
// cache rows, never another head's or past the allocation, and never the scratch slots [0, Q)
// that the same launch writes.
struct StepRange {
  int64_t lo, hi;
};
JACOBI_HD StepRange step_committed(int64_t lo, int64_t hi, int64_t Q, int64_t capacity) {
  lo = lo < Q ? Q : lo;
  lo = lo > capacity ? capacity : lo;
  hi = hi > capacity ? capacity : hi;
  hi = hi < lo ? lo : hi;
  return {lo, hi};
}
// The splits of `split_keys` keys that hold any of a sequence's `nkeys` keys: the later ones
// see nothing, so the attention writes no partials for them and the merge stops before them.
JACOBI_HD int64_t step_live_splits(int64_t nkeys, int64_t split_keys) {
  return (nkeys + split_keys - 1) / split_keys;
}

// ---- the K/V commit ---------------------------------------------------------------------------
// Slots [src, src + count) move to [dst, dst + count). Whether anything moves, and the n-th slot
// (0 <= n < count, relative to the ranges' starts) to copy: forward when moving down, backward
// when moving up, as memmove does, so that overlapping ranges read each slot before it is
// overwritten.
JACOBI_HD bool commit_moves(int64_t src, int64_t dst, int64_t count) {
  return count > 0 && src != dst;
}
JACOBI_HD int64_t commit_nth(int64_t n, int64_t src, int64_t dst, int64_t count) {
  return dst < src ? n : count - 1 - n;
}
JACOBI_HD bool commit_overlaps(int64_t src, int64_t dst, int64_t count) {
  return src < dst + count && dst < src + count;
}
JACOBI_HD bool commit_fits(int64_t src, int64_t dst, int64_t count, int64_t capacity) {
  return count >= 0 && src >= 0 && dst >= 0 && src + count <= capacity &&
         dst + count <= capacity;
}

// ---- the greedy pick (torch's max(-1).indices) --------------------------------------------------
// Whether value x at index i beats the best so far: a NaN beats every number (the first NaN
// wins), otherwise the larger value wins and a tie goes to the lower index. Any order of
// comparisons then picks the same index (the CUDA block reduction, the CPU's chunks).
template <typename T>
JACOBI_HD bool greedy_better(T x, int64_t i, T best, int64_t best_i) {
  const bool x_nan = x != x, best_nan = best != best;
  if (x_nan || best_nan) return x_nan && (!best_nan || i < best_i);
  return x > best || (x == best && i < best_i);
}

// ---- split-K attention: merging the partials of one row ----------------------------------------
// A split that saw keys of the row left (max, sum, unnormalised output acc) in the units of
// jacobi/online_softmax.h. Its weight against the row's overall max: exp(max - all_max), 0 for
// a split that saw nothing. out = sum_s w_s acc_s / sum_s w_s sum_s (0 if no split saw a key).
JACOBI_HD float split_weight(float split_max, float all_max, float to_log2) {
  return split_max == -INFINITY ? 0.f : exp2f((split_max - all_max) * to_log2);
}

}  // namespace jacobi::decode

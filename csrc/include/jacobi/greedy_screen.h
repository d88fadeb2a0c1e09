// The greedy LM head of the exact mode, screened on 8-bit activations: the argmax of x W^T
// (the exact fp32 product with the exactly dequantized Q8_0 / Q4_1 codes), found without that
// product over the whole vocabulary. Torch-free: the bound and the rule, for the CPU op
// (csrc/torch/linear_gguf_ops.cpp: cpu_linear_gguf_greedy) and its tests.
//
// Why: the exact mode's LM head is arithmetic-bound, not memory-bound. Every weight is widened,
// dequantized and multiplied in fp32 (3 vector operations per 16 weights and row): on a 2-core
// EPYC, SmolLM2's Q8_0 head (49152 x 576) took 1.2 ms for one row and 6.0 ms for 16, where the
// 8-bit tile reads the same codes in 0.7 ms for two rows and 3.6 ms for 32. Greedy decoding
// needs only each row's argmax, which is decided by a few columns.
//
// The method, per row x (K features; w_kj the exact fp32 weights of column j):
//  1. The 8-bit kernel (linear_gguf_int8) runs on two rows: x, and its residual
//     r = x - dx q (dx, q: that kernel's own quantization of x, per group of 32), so that
//     a_j = y(x)_j + y(r)_j approximates sum_k w_kj x_k to about 1/127 of the first level's
//     quantization error.
//  2. Each column gets a rigorous bound E_j = W1_j * e + t on |a_j - exact_j| (below), with
//     W1_j >= sum_k |w_kj| precomputed once per weight (abs_sums).
//  3. The candidates are the columns with a_j + E_j >= lo, lo = max_k (a_k - E_k): every other
//     column's exact value is below some column's, so the exact argmax (the first of its
//     maxima) is a candidate, and so is every column tied with it.
//  4. The candidates' exact values come from the exact kernel on their panels alone (a column's
//     fp32 chain does not depend on the other columns of the call), and the first of their
//     maxima is the answer: bitwise the argmax of the full exact product (argmax's pick).
// A row with a non-finite value anywhere (x, a, a bound), or more than the cap of candidates,
// is computed in full instead: the same answer, at the exact head's price.
//
// The bound. u = 2^-24 (fp32's unit roundoff), A = max_k |x_k|, R = max_k |r_k|,
// G = K / 32 groups, n = K + 4 G + 32 (more than the roundings any one output sees).
// W1_j = sum_k (|d_gj c_kj| + |m_gj|) over the groups g and codes c (m = 0 for Q8_0): at least
// sum_k |w_kj| and at least what the 8-bit kernel's terms add up to in magnitude.
//  - exact_j, the exact kernel's chain of K products and sums (any order, fused or not):
//    |exact_j - sum_k w_kj x_k| <= n u sum_k |w_kj||x_k| <= n u A W1_j.
//  - Q4_1's exact weight is (d c) + m rounded once: within u (|d c| + |m|) of the integer
//    form the 8-bit kernel multiplies, a further u A W1_j.
//  - The two quantized rows represent x up to e_k = x_k - dx q_k - dx' q'_k:
//    |e_k| <= |(x_k - dx q_k) - r_k| + |r_k - dx' q'_k| <= u A + (dx'/2 + 4 u R)
//    (r_k rounded once; q' = nearbyint(r * fl(127 / R_g)) is within 1/2 + 2 * 127 u of r / dx',
//    dx' = fl(R_g / 127) <= R (1 + u) / 127), so sum_k |w_kj||e_k| <= W1_j (R (1/254 + 6 u) + u A).
//  - Each 8-bit output is G (Q4_1: 2 G) fused multiply-adds of exact integer sums times
//    fl(d dx), each term at most (|d c| + |m|) |dx q| <= W1-part * A (1 + 2u): within
//    n u A W1_j (1 + 2u) of its real value, and both rows together twice that; their sum a_j
//    adds u |a_j| <= u A W1_j (1 + n u).
//  - Computing E_j = fl(W1_j * e), fl(a_j - E_j), fl(a_j + E_j) and comparing them rounds each by
//    at most u of |a| + E, which is at most 2 u A W1_j + 2 u E.
//  So |a_j - exact_j| <= W1_j * (R / 127 * 0.501 + 4 n u A) + t, with t = n * 2^-149 * 2 for the
//  subnormal results' absolute roundings; e below is that factor, rounded up, times (1 + 2^-20).
//  The bound assumes no overflow: a row whose A * max W1 could reach fp32's range is computed in
//  full.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>

#include "hd.h"

namespace jacobi::greedy_screen {

// The roundings one output sees, counted generously (see above).
JACOBI_HD double rounding_count(int64_t K) { return static_cast<double>(K + 4 * (K / 32) + 32); }

// e for a row (E_j = W1_j * e + absolute()): amax_x = A, amax_r = R. Non-finite inputs give a
// non-finite e (the caller computes that row in full).
JACOBI_HD float error_per_w1(int64_t K, float amax_x, float amax_r) {
  const double u = std::ldexp(1.0, -24);
  const double n = rounding_count(K);
  const double e = static_cast<double>(amax_r) / 127.0 * 0.501 + 4.0 * n * u * amax_x;
  const double up = e * (1.0 + std::ldexp(1.0, -20));
  const float f = static_cast<float>(up);
  return static_cast<double>(f) < up ? std::nextafter(f, std::numeric_limits<float>::infinity())
                                     : f;
}

// t: the subnormal results' absolute roundings (2^-150 each, at most rounding_count of them a
// chain), doubled; a normal float, so that E_j is never below it.
JACOBI_HD float absolute(int64_t K) {
  return static_cast<float>(rounding_count(K) * std::ldexp(1.0, -148));
}

// Whether a row's sums stay clear of fp32's overflow: A * max_j W1_j well inside the range (each
// partial sum of either product is at most about that).
JACOBI_HD bool in_range(float amax_x, float max_w1) {
  const double reach = static_cast<double>(amax_x) * static_cast<double>(max_w1);
  return std::isfinite(reach) && reach < 0.25 * static_cast<double>(std::numeric_limits<float>::max());
}

// Where a row's candidates are too many, it is computed in full: columns kept at most.
constexpr int64_t kMaxCandidates = 256;

}  // namespace jacobi::greedy_screen

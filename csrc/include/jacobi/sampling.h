// Exact sampling as a deterministic function of the prefix: the filtered, perturbed argmax.
//
// Torch-free and header-only: the CPU op (csrc/cpu/sampling_cpu.cpp) and the CUDA kernel
// (csrc/cuda/sampling_cuda.cu) both call what is here, so they cannot disagree about the noise or
// the filters. The Python reference (jacobi_ext/sampling.py) restates the same rules in torch.
//
// The token predicted at absolute output position `pos` of the sequence with stream key
// (seed, stream) is
//     argmax over kept v of  x_v + G(seed, stream, pos, v),       x_v = logit_v / temperature,
// where G is standard Gumbel noise from a counter-based generator (Philox4x32-10) and the kept set
// applies transformers' filters in transformers' order (temperature, top-k, top-p on the
// top-k-filtered law, min-p):
//   top-k (k > 0):  x_v >= the k-th largest x (ties at the k-th value all kept, as transformers);
//   top-p (p < 1):  over the top-k set, with e_v = exp(x_v - max x) and Z = sum e, keep v iff the
//                   mass strictly above it, sum_{x_u > x_v} e_u, is < p * Z. Equivalently
//                   x_v >= t_p = max{t : sum_{x_u >= t} e_u >= p * Z}: the smallest head of the
//                   descending law that reaches p. A tie group at the cut is kept whole
//                   (transformers' order inside a tie is that of an unstable sort: undefined);
//   min-p (> 0):    e_v >= min_p (p_v >= min_p * p_max on the filtered law; the max always stays).
// The argmax of x + Gumbel over a set is an exact draw from softmax(x) restricted to it (the
// Gumbel-max trick), so one position's token is an exact sample of transformers' law; and since the
// noise depends only on (seed, stream, pos, v), never on the step that evaluates it, the token is
// a deterministic function of the prefix, like greedy's argmax: a Jacobi fixed point under this
// rule is exactly the autoregressive sample with the same noise.
//
// The noise is evaluated only for kept tokens and never stored: nothing of size [positions,
// vocab] is materialised.
#pragma once

#include <cmath>
#include <cstdint>

#include "jacobi/hd.h"

namespace jacobi {

// Filters of one call (a batch shares them). top_k 0 = off, top_p 1 = off, min_p 0 = off.
struct SamplingParams {
  double temperature;  // > 0
  int64_t top_k;       // >= 0
  double top_p;        // (0, 1]
  double min_p;        // [0, 1]
};

// Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): a
// bijective counter -> 4 x 32-bit block function under a 64-bit key. Same constants as
// Random123 / cuRAND / torch's philox.
struct Philox4 {
  uint32_t v[4];
};

JACOBI_HD void philox_mulhilo(uint32_t a, uint32_t b, uint32_t& hi, uint32_t& lo) {
  const uint64_t p = static_cast<uint64_t>(a) * static_cast<uint64_t>(b);
  hi = static_cast<uint32_t>(p >> 32);
  lo = static_cast<uint32_t>(p);
}

JACOBI_HD Philox4 philox4x32_10(Philox4 c, uint32_t k0, uint32_t k1) {
  constexpr uint32_t M0 = 0xD2511F53u, M1 = 0xCD9E8D57u, W0 = 0x9E3779B9u, W1 = 0xBB67AE85u;
#if defined(__CUDACC__)
#pragma unroll 5  // fully unrolled, ptxas spilled 24 bytes on sm_90a; 5 keeps both archs spill-free
#endif
  for (int r = 0; r < 10; ++r) {
    uint32_t hi0, lo0, hi1, lo1;
    philox_mulhilo(M0, c.v[0], hi0, lo0);
    philox_mulhilo(M1, c.v[2], hi1, lo1);
    c = Philox4{{hi1 ^ c.v[1] ^ k0, lo1, hi0 ^ c.v[3] ^ k1, lo0}};
    k0 += W0;
    k1 += W1;
  }
  return c;
}

// The 53 random bits of (seed, stream, pos, v): counter (v, pos, stream lo, stream hi), key seed.
// Positions and vocabulary indices below 2^32 (both are checked by the op).
JACOBI_HD uint64_t noise_bits(uint64_t seed, uint64_t stream, int64_t pos, int64_t v) {
  const Philox4 c{{static_cast<uint32_t>(v), static_cast<uint32_t>(pos),
                   static_cast<uint32_t>(stream), static_cast<uint32_t>(stream >> 32)}};
  const Philox4 o = philox4x32_10(c, static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32));
  return ((static_cast<uint64_t>(o.v[0]) << 32) | o.v[1]) >> 11;
}

// Uniform in the open interval (0, 1): the 53 bits as a double, offset by half a step.
JACOBI_HD double noise_uniform(uint64_t bits53) {
  return (static_cast<double>(bits53) + 0.5) * 0x1.0p-53;
}

// Standard Gumbel noise -log(-log u) (double precision; libm's log on the host, CUDA's on the
// device: both within 1 ulp, so the two may differ in the last bit and nowhere else).
JACOBI_HD double gumbel_noise(uint64_t seed, uint64_t stream, int64_t pos, int64_t v) {
  return -log(-log(noise_uniform(noise_bits(seed, stream, pos, v))));
}

// The temperature-scaled logit, in double; +0.0 for -0.0 so that the value order and the key
// order below agree.
JACOBI_HD double scaled_logit(double logit, double temperature) {
  return logit / temperature + 0.0;
}

// A monotone map from double to uint64 (x < y <=> key(x) < key(y) for non-NaN x, y): radix
// selection on the device works on these keys.
JACOBI_HD uint64_t order_key(double x) {
  union {
    double d;
    uint64_t u;
  } b;  // type punning through a union: defined in GCC, Clang and nvcc
  b.d = x;
  return (b.u >> 63) ? ~b.u : (b.u | (uint64_t(1) << 63));
}

JACOBI_HD double key_value(uint64_t k) {
  const uint64_t u = (k >> 63) ? (k & ~(uint64_t(1) << 63)) : ~k;
  union {
    uint64_t u;
    double d;
  } b;
  b.u = u;
  return b.d;
}

// Whether token v with scaled logit x survives the filters, given the row's maximum x_max and the
// thresholds of top-k (t_k) and top-p (t_p) (-inf where off).
JACOBI_HD bool sampling_keep(double x, double x_max, double t_k, double t_p, double min_p) {
  if (!(x >= t_k) || !(x >= t_p)) return false;
  return min_p <= 0.0 || exp(x - x_max) >= min_p;
}

// The argmax's order: a higher score wins, a tie goes to the lower vocabulary index.
JACOBI_HD bool sampling_better(double s, int64_t v, double best_s, int64_t best_v) {
  return s > best_s || (s == best_s && v < best_v);
}

}  // namespace jacobi

// The filtered perturbed argmax on the GPU: one thread block per row (one step position).
//
// The thresholds of jacobi/sampling.h by radix selection over the order keys of the scaled
// logits, 8 bits at a time (8 passes over the row, each a 256-bin histogram in shared memory):
//   top-k: counts per digit; the k-th largest key, exactly;
//   top-p: masses e = exp(x - max) per digit among the top-k set; the largest key at which the
//          descending cumulative mass reaches top_p * Z.
// Then min-p, the noise for kept tokens only, and a block argmax (ties: lower index). The row is
// read from global memory (L2) on every pass; nothing of size [rows, vocab] is written.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/sampling_cuda.h"

namespace jacobi::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ __forceinline__ double load(const float* p) { return static_cast<double>(*p); }
__device__ __forceinline__ double load(const double* p) { return *p; }
__device__ __forceinline__ double load(const __half* p) {
  return static_cast<double>(__half2float(*p));
}
__device__ __forceinline__ double load(const __nv_bfloat16* p) {
  return static_cast<double>(__bfloat162float(*p));
}

// Block-wide max / sum of one double per thread; every thread gets the result.
template <bool kMax>
__device__ double block_reduce(double v, double* sh) {
  for (int o = 16; o > 0; o >>= 1) {
    const double w = __shfl_xor_sync(0xffffffffu, v, o);
    v = kMax ? fmax(v, w) : v + w;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // sh may still be read by a previous reduction
  if (lane == 0) sh[warp] = v;
  __syncthreads();
  v = sh[0];
  for (int i = 1; i < kWarps; ++i) v = kMax ? fmax(v, sh[i]) : v + sh[i];
  return v;
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    gumbel_argmax_kernel(const T* __restrict__ logits, int64_t V, int64_t row_per_key,
                         const int64_t* __restrict__ keys, const int64_t* __restrict__ positions,
                         SamplingParams p, int64_t* __restrict__ out) {
  const int64_t r = blockIdx.x;
  const T* row = logits + r * V;
  const int tid = threadIdx.x;
  __shared__ double red[kWarps];
  __shared__ unsigned int hist_n[256];
  __shared__ double hist_m[256];
  __shared__ uint64_t sel_prefix;
  __shared__ int64_t sel_k;
  __shared__ double sel_above;
  __shared__ double best_s_sh[kWarps];
  __shared__ int64_t best_v_sh[kWarps];
  const double inf = __longlong_as_double(0x7ff0000000000000LL);

  double m = -inf;
  for (int64_t v = tid; v < V; v += kThreads) m = fmax(m, scaled_logit(load(row + v), p.temperature));
  const double x_max = block_reduce<true>(m, red);

  // top-k: the k-th largest key, counted with multiplicity.
  double t_k = -inf;
  if (p.top_k > 0 && p.top_k < V) {
    uint64_t prefix = 0, mask = 0;
    int64_t k = p.top_k;
    for (int shift = 56; shift >= 0; shift -= 8) {
      for (int i = tid; i < 256; i += kThreads) hist_n[i] = 0;
      __syncthreads();
      for (int64_t v = tid; v < V; v += kThreads) {
        const uint64_t key = order_key(scaled_logit(load(row + v), p.temperature));
        if ((key & mask) == prefix) atomicAdd(&hist_n[(key >> shift) & 255], 1u);
      }
      __syncthreads();
      if (tid == 0) {
        int64_t above = 0;
        int d = 255;
        for (; d > 0; --d) {
          if (above + hist_n[d] >= k) break;
          above += hist_n[d];
        }
        sel_k = k - above;
        sel_prefix = prefix | (static_cast<uint64_t>(d) << shift);
      }
      __syncthreads();
      k = sel_k;
      prefix = sel_prefix;
      mask |= static_cast<uint64_t>(255) << shift;
    }
    t_k = key_value(prefix);
  }

  // top-p: the largest key whose descending cumulative mass (over the top-k set) reaches p * Z.
  double t_p = -inf;
  if (p.top_p < 1.0) {
    double z = 0.0;
    for (int64_t v = tid; v < V; v += kThreads) {
      const double x = scaled_logit(load(row + v), p.temperature);
      if (x >= t_k) z += exp(x - x_max);
    }
    const double target = p.top_p * block_reduce<false>(z, red);
    uint64_t prefix = 0, mask = 0;
    double above = 0.0;
    for (int shift = 56; shift >= 0; shift -= 8) {
      for (int i = tid; i < 256; i += kThreads) {
        hist_n[i] = 0;
        hist_m[i] = 0.0;
      }
      __syncthreads();
      for (int64_t v = tid; v < V; v += kThreads) {
        const double x = scaled_logit(load(row + v), p.temperature);
        const uint64_t key = order_key(x);
        if (x >= t_k && (key & mask) == prefix) {
          const int d = static_cast<int>((key >> shift) & 255);
          atomicAdd(&hist_n[d], 1u);
          atomicAdd(&hist_m[d], exp(x - x_max));
        }
      }
      __syncthreads();
      if (tid == 0) {
        double acc = above;
        int d = 255, last = -1;
        for (; d >= 0; --d) {
          if (hist_n[d] == 0) continue;
          last = d;
          if (acc + hist_m[d] >= target) break;
          acc += hist_m[d];
        }
        if (d < 0) {  // rounding left the sums just short of the target: the lowest key stays
          d = last;
          acc -= hist_m[last];
        }
        sel_above = acc;
        sel_prefix = prefix | (static_cast<uint64_t>(d) << shift);
      }
      __syncthreads();
      above = sel_above;
      prefix = sel_prefix;
      mask |= static_cast<uint64_t>(255) << shift;
    }
    t_p = key_value(prefix);
  }

  // The perturbed argmax over the kept tokens.
  const int64_t* key = keys + 2 * (r / row_per_key);
  const uint64_t seed = static_cast<uint64_t>(key[0]), stream = static_cast<uint64_t>(key[1]);
  const int64_t pos = positions[r];
  double best_s = -inf;
  int64_t best_v = INT64_MAX;
  for (int64_t v = tid; v < V; v += kThreads) {
    const double x = scaled_logit(load(row + v), p.temperature);
    if (!sampling_keep(x, x_max, t_k, t_p, p.min_p)) continue;
    const double s = x + gumbel_noise(seed, stream, pos, v);
    if (sampling_better(s, v, best_s, best_v)) {
      best_s = s;
      best_v = v;
    }
  }
  for (int o = 16; o > 0; o >>= 1) {
    const double s = __shfl_xor_sync(0xffffffffu, best_s, o);
    const int64_t v = __shfl_xor_sync(0xffffffffu, best_v, o);
    if (sampling_better(s, v, best_s, best_v)) {
      best_s = s;
      best_v = v;
    }
  }
  if ((tid & 31) == 0) {
    best_s_sh[tid >> 5] = best_s;
    best_v_sh[tid >> 5] = best_v;
  }
  __syncthreads();
  if (tid == 0) {
    for (int i = 1; i < kWarps; ++i) {
      if (sampling_better(best_s_sh[i], best_v_sh[i], best_s, best_v)) {
        best_s = best_s_sh[i];
        best_v = best_v_sh[i];
      }
    }
    out[r] = best_v == INT64_MAX ? 0 : best_v;  // nothing kept only for a row of NaN
  }
}

__global__ void debug_noise_kernel(int64_t total, int64_t V, int64_t row_per_key,
                                   const int64_t* __restrict__ keys,
                                   const int64_t* __restrict__ positions, bool uniform,
                                   double* __restrict__ out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / V, v = i % V;
    const int64_t* key = keys + 2 * (r / row_per_key);
    const uint64_t seed = static_cast<uint64_t>(key[0]), stream = static_cast<uint64_t>(key[1]);
    out[i] = uniform ? noise_uniform(noise_bits(seed, stream, positions[r], v))
                     : gumbel_noise(seed, stream, positions[r], v);
  }
}

template <typename T>
cudaError_t launch(const void* logits, int64_t rows, int64_t V, int64_t row_per_key,
                   const int64_t* keys, const int64_t* positions, const SamplingParams& p,
                   int64_t* out, cudaStream_t stream) {
  gumbel_argmax_kernel<T><<<static_cast<unsigned int>(rows), kThreads, 0, stream>>>(
      static_cast<const T*>(logits), V, row_per_key, keys, positions, p, out);
  return cudaGetLastError();
}

}  // namespace

cudaError_t debug_noise(int64_t rows, int64_t vocab, int64_t row_per_key, const int64_t* keys,
                        const int64_t* positions, bool uniform, double* out, cudaStream_t stream) {
  const int64_t total = rows * vocab;
  if (total <= 0) return cudaSuccess;
  const int64_t blocks = (total + kThreads - 1) / kThreads;
  debug_noise_kernel<<<static_cast<unsigned int>(blocks < 65535 ? blocks : 65535), kThreads, 0,
                       stream>>>(total, vocab, row_per_key, keys, positions, uniform, out);
  return cudaGetLastError();
}

cudaError_t gumbel_argmax(const void* logits, LogitType type, int64_t rows, int64_t vocab,
                          int64_t row_per_key, const int64_t* keys, const int64_t* positions,
                          const SamplingParams& p, int64_t* out, cudaStream_t stream) {
  if (rows <= 0) return cudaSuccess;
  switch (type) {
    case LogitType::kFloat32:
      return launch<float>(logits, rows, vocab, row_per_key, keys, positions, p, out, stream);
    case LogitType::kFloat64:
      return launch<double>(logits, rows, vocab, row_per_key, keys, positions, p, out, stream);
    case LogitType::kFloat16:
      return launch<__half>(logits, rows, vocab, row_per_key, keys, positions, p, out, stream);
    case LogitType::kBFloat16:
      return launch<__nv_bfloat16>(logits, rows, vocab, row_per_key, keys, positions, p, out,
                                   stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace jacobi::cuda

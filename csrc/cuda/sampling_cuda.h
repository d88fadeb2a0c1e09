// CUDA entry of the filtered perturbed argmax (torch-free; semantics in jacobi/sampling.h).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "jacobi/sampling.h"

namespace jacobi::cuda {

enum class LogitType { kFloat32, kFloat64, kFloat16, kBFloat16 };

// One thread block per row of logits [rows, vocab]; keys [rows / row_per_key, 2], positions
// [rows], out [rows]. One launch, no host synchronisation: capturable in a CUDA graph.
cudaError_t gumbel_argmax(const void* logits, LogitType type, int64_t rows, int64_t vocab,
                          int64_t row_per_key, const int64_t* keys, const int64_t* positions,
                          const SamplingParams& p, int64_t* out, cudaStream_t stream);

// The noise of every (row, v), [rows, vocab] float64: uniforms or Gumbel noise (tests only).
cudaError_t debug_noise(int64_t rows, int64_t vocab, int64_t row_per_key, const int64_t* keys,
                        const int64_t* positions, bool uniform, double* out, cudaStream_t stream);

}  // namespace jacobi::cuda

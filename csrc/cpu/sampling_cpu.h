// CPU entry of the filtered perturbed argmax (torch-free; semantics in jacobi/sampling.h).
#pragma once

#include <cstdint>

#include "jacobi/sampling.h"

namespace jacobi::cpu {

// rows [N, V] logits (float or double), keys [N / Q, 2] (seed, stream), positions [N] (the
// absolute position of the token each row predicts), out [N]. Rows in parallel (at::parallel_for).
template <typename T>
void gumbel_argmax(const T* logits, int64_t rows, int64_t vocab, int64_t row_per_key,
                   const int64_t* keys, const int64_t* positions, const SamplingParams& p,
                   int64_t* out);

}  // namespace jacobi::cpu

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

// out[r] = the greedy pick of row r of x [rows, vocab] (double; float rows go to the vectorised
// argmax_f32, decode_cpu.h): the index of its first NaN if it holds one, else of its first
// maximum (torch.max(-1).indices' choice). A row is split into chunks read in parallel; the
// chunks' picks combine in order.
template <typename T>
void argmax_rows(const T* x, int64_t rows, int64_t vocab, int64_t* out);

// The noise of every (row, v), [rows, vocab] float64: uniforms or Gumbel noise (tests only).
void debug_noise(int64_t rows, int64_t vocab, int64_t row_per_key, const int64_t* keys,
                 const int64_t* positions, bool uniform, double* out);

}  // namespace jacobi::cpu

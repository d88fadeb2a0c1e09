// Shared glue of the verify_step op: argument checks, output allocation, raw-pointer view.
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>

#include "jacobi/verify.h"

namespace jacobi::ops {

using VerifyResult = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                                at::Tensor, at::Tensor>;

struct VerifyLaunch {
  int batch;  // sequences (1 for the single-sequence form)
  VerifyShape shape;
  VerifyArgs<int64_t> args;
  VerifyResult outputs;
};

// Checks every argument (dtype, rank, shape, device, contiguity) and allocates the outputs on
// the inputs' device. Tensors of one sequence ([rows, width] tokens, ...) or of a batch (the
// same with a leading [batch]; the outputs then have it too): see jacobi/verify.h.
VerifyLaunch prepare_verify(const at::Tensor& tokens, const at::Tensor& greedy,
                            const at::Tensor& row_len, const at::Tensor& block_ends,
                            const at::Tensor& init_tokens, const at::Tensor& pool,
                            const at::Tensor& pool_len, const at::Tensor& pool_head,
                            int64_t spawn_threshold, int64_t eos_token_id);

}  // namespace jacobi::ops

// Shared glue of the gumbel_argmax op: argument checks and the parameters, for CPU and CUDA.
#pragma once

#include <ATen/core/Tensor.h>

#include "jacobi/sampling.h"

namespace jacobi::ops {

// Checks logits [B, Q, V] (floating), keys [B, 2] int64, positions [B, Q] int64 on one device
// and the filter values; returns the parameters. Raises ValueError naming what is wrong.
SamplingParams check_gumbel_argmax(const at::Tensor& logits, const at::Tensor& keys,
                                   const at::Tensor& positions, double temperature,
                                   int64_t top_k, double top_p, double min_p);

}  // namespace jacobi::ops

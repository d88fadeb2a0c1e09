// CUDA entry of the verify-accept-recycle step (torch-free; semantics in jacobi/verify.h).
#pragma once

#include <cuda_runtime_api.h>

#include "jacobi/verify.h"

namespace jacobi::cuda {

// One launch for `batch` sequences (layout: verify_args_at), no host synchronisation:
// capturable in a CUDA graph. Returns the launch status.
cudaError_t verify_step(const VerifyShape& shape, const VerifyArgs<int64_t>& args, int batch,
                        cudaStream_t stream);

}  // namespace jacobi::cuda

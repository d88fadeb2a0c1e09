// CUDA entry of the verify-accept-recycle step (torch-free; semantics in jacobi/verify.h).
#pragma once

#include <cuda_runtime_api.h>

#include "jacobi/step_row.h"
#include "jacobi/verify.h"
#include "jacobi/verify_rows.h"

namespace jacobi::cuda {

// One launch for `batch` sequences (layout: verify_args_at), no host synchronisation:
// capturable in a CUDA graph. Returns the launch status.
cudaError_t verify_step(const VerifyShape& shape, const VerifyArgs<int64_t>& args, int batch,
                        cudaStream_t stream);

// The AR rows of a step (jacobi/step_row.h: ar_step_row), one thread per sequence: toks, tgt
// [batch, Q], fed [batch], eos [num_eos] (nullptr: none); rows [batch, row_size], count [batch].
cudaError_t ar_accept(const int64_t* toks, const int64_t* tgt, const int64_t* fed,
                      const int64_t* eos, int64_t num_eos, int64_t batch, int64_t Q,
                      int64_t width, int64_t row_size, int64_t* rows, int64_t* count,
                      cudaStream_t stream);

// The parallel sequences' side of a step (jacobi/verify_rows.h), one thread block a sequence:
// the cut, verify_step (its shape and args: the batch's, bound to the cut rows), the next state
// and the step rows, in one launch.
cudaError_t verify_rows(const VerifyRowsShape& shape, const VerifyRowsArgs& args,
                        const VerifyShape& vshape, cudaStream_t stream);

}  // namespace jacobi::cuda

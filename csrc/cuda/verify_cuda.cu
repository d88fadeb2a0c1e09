// One thread block per sequence of the batch, one launch for all of them: the rows' acceptance
// lengths in parallel, then one thread finishes the step (winner, commit, next drafts, pool,
// candidates) - a few hundred integer operations, cheaper than any second launch or host round
// trip. A sequence that takes no part writes its neutral outputs (verify_inactive).
#include "cuda/verify_cuda.h"

namespace jacobi::cuda {
namespace {

__global__ void verify_step_kernel(VerifyShape shape, VerifyArgs<int64_t> args) {
  const VerifyArgs<int64_t> a = verify_args_at(shape, args, static_cast<int>(blockIdx.x));
  if (!verify_active(a)) {  // uniform over the block: no thread reaches the barrier below
    if (threadIdx.x == 0) verify_inactive(shape, a);
    return;
  }
  for (int r = threadIdx.x; r < shape.rows; r += blockDim.x) verify_accept_row(shape, a, r);
  __syncthreads();
  if (threadIdx.x == 0) verify_finish(shape, a);
}

}  // namespace

cudaError_t verify_step(const VerifyShape& shape, const VerifyArgs<int64_t>& args, int batch,
                        cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  verify_step_kernel<<<batch, 32, 0, stream>>>(shape, args);
  return cudaGetLastError();
}

}  // namespace jacobi::cuda

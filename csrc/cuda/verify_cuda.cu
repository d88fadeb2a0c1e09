// One thread block: the rows' acceptance lengths in parallel, then one thread finishes the step
// (winner, commit, next drafts, pool, candidates) - a few hundred integer operations, cheaper
// than any second launch or host round trip.
#include "cuda/verify_cuda.h"

namespace jacobi::cuda {
namespace {

__global__ void verify_step_kernel(VerifyShape shape, VerifyArgs<int64_t> args) {
  for (int r = threadIdx.x; r < shape.rows; r += blockDim.x) verify_accept_row(shape, args, r);
  __syncthreads();
  if (threadIdx.x == 0) verify_finish(shape, args);
}

}  // namespace

cudaError_t verify_step(const VerifyShape& shape, const VerifyArgs<int64_t>& args,
                        cudaStream_t stream) {
  verify_step_kernel<<<1, 32, 0, stream>>>(shape, args);
  return cudaGetLastError();
}

}  // namespace jacobi::cuda

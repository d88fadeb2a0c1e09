// verify_step: one thread block per sequence of the batch, one launch for all of them: the rows'
// acceptance lengths in parallel, then one thread finishes the step (winner, commit, next
// drafts, pool, candidates) - a few hundred integer operations, cheaper than any second launch or
// host round trip. A sequence that takes no part writes its neutral outputs (verify_inactive).
// verify_rows: the same with the rows cut before it (128 threads over R * wv tokens) and the next
// state and step row written after it (thread 0), in the same block: one launch.
// ar_accept: one thread a sequence (a step's AR rows: a prefix match and a row write).
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

__global__ void ar_accept_kernel(const int64_t* toks, const int64_t* tgt, const int64_t* fed,
                                 EosIds is_eos, int64_t batch, int64_t Q, int64_t width,
                                 int64_t row_size, int64_t* rows, int64_t* count) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  count[b] = ar_step_row(toks + b * Q, tgt + b * Q, fed[b], Q, is_eos, width, row_size,
                         rows + b * row_size);
}

__global__ void verify_rows_kernel(VerifyRowsShape s, VerifyRowsArgs a, VerifyShape vs) {
  const int64_t b = blockIdx.x;
  for (int64_t e = threadIdx.x; e < s.rows * s.wv; e += blockDim.x) verify_rows_cut(s, a, b, e);
  for (int64_t j = threadIdx.x; j < s.block_size; j += blockDim.x) verify_rows_init(s, a, b, j);
  __syncthreads();  // the cut rows, their lengths and the drafts, for every thread
  const VerifyArgs<int64_t> v = verify_args_at(vs, a.v, static_cast<int>(b));
  const bool active = verify_active(v);  // uniform over the block
  if (active) {
    for (int r = threadIdx.x; r < vs.rows; r += blockDim.x) verify_accept_row(vs, v, r);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    if (active) {
      verify_finish(vs, v);
    } else {
      verify_inactive(vs, v);
    }
    verify_rows_finish(s, a, b);
  }
}

}  // namespace

cudaError_t verify_rows(const VerifyRowsShape& shape, const VerifyRowsArgs& args,
                        const VerifyShape& vshape, cudaStream_t stream) {
  if (shape.batch <= 0) return cudaSuccess;
  verify_rows_kernel<<<static_cast<unsigned>(shape.batch), 128, 0, stream>>>(shape, args, vshape);
  return cudaGetLastError();
}

cudaError_t ar_accept(const int64_t* toks, const int64_t* tgt, const int64_t* fed,
                      const int64_t* eos, int64_t num_eos, int64_t batch, int64_t Q,
                      int64_t width, int64_t row_size, int64_t* rows, int64_t* count,
                      cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  const int threads = 32;
  const unsigned blocks = static_cast<unsigned>((batch + threads - 1) / threads);
  ar_accept_kernel<<<blocks, threads, 0, stream>>>(toks, tgt, fed, EosIds{eos, num_eos}, batch, Q,
                                                   width, row_size, rows, count);
  return cudaGetLastError();
}

cudaError_t verify_step(const VerifyShape& shape, const VerifyArgs<int64_t>& args, int batch,
                        cudaStream_t stream) {
  if (batch <= 0) return cudaSuccess;
  verify_step_kernel<<<batch, 32, 0, stream>>>(shape, args);
  return cudaGetLastError();
}

}  // namespace jacobi::cuda

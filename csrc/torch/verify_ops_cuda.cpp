// verify_step: the CUDA implementation (checks and allocation shared with the CPU op).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "cuda/verify_cuda.h"
#include "verify_ops.h"

namespace jacobi::ops {
namespace {

VerifyResult verify_step_cuda(const at::Tensor& tokens, const at::Tensor& greedy,
                              const at::Tensor& row_len, const at::Tensor& block_ends,
                              const at::Tensor& init_tokens, at::Tensor& pool,
                              at::Tensor& pool_len, at::Tensor& pool_head,
                              int64_t spawn_threshold, int64_t eos_token_id) {
  c10::cuda::CUDAGuard guard(tokens.device());
  VerifyLaunch l = prepare_verify(tokens, greedy, row_len, block_ends, init_tokens, pool, pool_len,
                                  pool_head, spawn_threshold, eos_token_id);
  const cudaError_t err =
      jacobi::cuda::verify_step(l.shape, l.args, l.batch,
                                c10::cuda::getCurrentCUDAStream().stream());
  TORCH_CHECK(err == cudaSuccess, "jacobi_ext::verify_step: CUDA launch failed: ",
              cudaGetErrorString(err));
  return l.outputs;
}

}  // namespace

TORCH_LIBRARY_IMPL(jacobi_ext, CUDA, m) { m.impl("verify_step", &verify_step_cuda); }

}  // namespace jacobi::ops

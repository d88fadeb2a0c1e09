// verify_step, verify_rows and ar_accept: the CUDA implementations (checks and allocation shared
// with the CPU ops, verify_ops.cpp).
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/verify_cuda.h"
#include "cuda_launch.h"
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
  check_launch("verify_step",
               jacobi::cuda::verify_step(l.shape, l.args, l.batch, current_stream()));
  return l.outputs;
}

std::tuple<at::Tensor, at::Tensor> ar_accept_cuda(const at::Tensor& toks, const at::Tensor& tgt,
                                                  const at::Tensor& fed,
                                                  const std::optional<at::Tensor>& eos,
                                                  int64_t width, int64_t tail) {
  c10::cuda::CUDAGuard guard(toks.device());
  ArAcceptLaunch l = prepare_ar_accept(toks, tgt, fed, eos, width, tail);
  check_launch("ar_accept",
               jacobi::cuda::ar_accept(l.toks, l.tgt, l.fed, l.eos, l.num_eos, l.batch, l.Q, width,
                                       l.row_size, l.rows, l.count, current_stream()));
  return l.outputs;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> verify_rows_cuda(
    const at::Tensor& toks, const at::Tensor& tgt, const at::Tensor& row_start,
    const at::Tensor& row_len, const at::Tensor& init_idx, at::Tensor& src,
    at::Tensor& block_ends, at::Tensor& pool, at::Tensor& pool_len, at::Tensor& pool_head,
    at::Tensor& ctx, at::Tensor& ctx_len, int64_t spawn_threshold, int64_t eos_token_id,
    int64_t width) {
  c10::cuda::CUDAGuard guard(toks.device());
  VerifyRowsLaunch l = prepare_verify_rows(toks, tgt, row_start, row_len, init_idx, src,
                                           block_ends, pool, ctx, ctx_len, width);
  bind_verify(l, block_ends, pool, pool_len, pool_head, spawn_threshold, eos_token_id);
  check_launch("verify_rows",
               jacobi::cuda::verify_rows(l.shape, l.args, l.verify.shape, current_stream()));
  return l.outputs;
}

}  // namespace

TORCH_LIBRARY_IMPL(jacobi_ext, CUDA, m) {
  m.impl("verify_rows", &verify_rows_cuda);
  m.impl("verify_step", &verify_step_cuda);
  m.impl("ar_accept", &ar_accept_cuda);
}

}  // namespace jacobi::ops

// gumbel_argmax: the CUDA implementation (checks shared with the CPU op).
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include "cuda/sampling_cuda.h"
#include "cuda_launch.h"
#include "sampling_ops.h"

namespace jacobi::ops {
namespace {

at::Tensor gumbel_argmax_cuda(const at::Tensor& logits, const at::Tensor& keys,
                              const at::Tensor& positions, double temperature, int64_t top_k,
                              double top_p, double min_p) {
  c10::cuda::CUDAGuard guard(logits.device());
  const SamplingParams p =
      check_gumbel_argmax(logits, keys, positions, temperature, top_k, top_p, min_p);
  const int64_t B = logits.size(0), Q = logits.size(1), V = logits.size(2);
  at::Tensor out = at::empty({B, Q}, positions.options());
  if (out.numel() == 0) return out;
  using jacobi::cuda::LogitType;
  LogitType type;
  switch (logits.scalar_type()) {
    case at::kFloat: type = LogitType::kFloat32; break;
    case at::kDouble: type = LogitType::kFloat64; break;
    case at::kHalf: type = LogitType::kFloat16; break;
    case at::kBFloat16: type = LogitType::kBFloat16; break;
    default:
      TORCH_CHECK_VALUE(false, "logits must be float32, float64, float16 or bfloat16, got ",
                        logits.scalar_type());
  }
  const at::Tensor x = logits.contiguous(), k = keys.contiguous(), pos = positions.contiguous();
  check_launch("gumbel_argmax",
               jacobi::cuda::gumbel_argmax(x.data_ptr(), type, B * Q, V, Q, k.data_ptr<int64_t>(),
                                           pos.data_ptr<int64_t>(), p, out.data_ptr<int64_t>(),
                                           current_stream()));
  return out;
}

at::Tensor debug_gumbel_noise_cuda(const at::Tensor& keys, const at::Tensor& positions,
                                   int64_t vocab, bool uniform) {
  c10::cuda::CUDAGuard guard(positions.device());
  at::Tensor out = at::empty({positions.size(0), positions.size(1), vocab},
                             positions.options().dtype(at::kDouble));
  check_gumbel_argmax(out, keys, positions, 1.0, 0, 1.0, 0.0);
  const at::Tensor k = keys.contiguous(), pos = positions.contiguous();
  check_launch("debug_gumbel_noise",
               jacobi::cuda::debug_noise(out.size(0) * out.size(1), vocab, out.size(1),
                                         k.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), uniform,
                                         out.data_ptr<double>(), current_stream()));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(jacobi_ext, CUDA, m) {
  m.impl("gumbel_argmax", &gumbel_argmax_cuda);
  m.impl("debug_gumbel_noise", &debug_gumbel_noise_cuda);
}

}  // namespace jacobi::ops

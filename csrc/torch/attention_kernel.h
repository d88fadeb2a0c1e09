// Which attention kernel family an op call runs: the `kernel` argument of block_attention_fwd/bwd
// (and of attention_kernel / attention_bwd_kernel, which name the family that would run).
//
// The policy that picks a family (the default, the JACOBI_ATTN_KERNEL environment variable, the
// measured table) lives in one place, jacobi_ext/attention.py, which passes the ops a concrete
// name. The ops run the kernel they are named and never read the environment.
//
// Names (shared with jacobi_ext/attention.py BACKENDS, which documents them):
//   cpu    the CPU kernel;
//   sm80   the sm_80 CUDA kernel (A100, and the fallback everywhere);
//   sm90   the sm_90a CUDA kernel on compute capability 9.x; elsewhere, or where no sm_90a
//          kernel exists for the dtype and head dim, the sm_80 one (with a warning, once);
//   auto (or None, or "")  the portable kernel of q's device: cpu on CPU, sm80 on CUDA (never
//          sm90: a raw op call that names no kernel runs the same kernel on every GPU).
// A CUDA name for CPU tensors, or cpu for CUDA ones, is an error; so are flex and streams
// (backends of the Python front end, torch's FlexAttention / SDPA, not kernels of the ops).
#pragma once

#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <string_view>

namespace jacobi::ops {

enum class AttnKernel { automatic, cpu, sm80, sm90 };

inline const char* kernel_name(AttnKernel k) {
  switch (k) {
    case AttnKernel::cpu:
      return "cpu";
    case AttnKernel::sm80:
      return "sm80";
    case AttnKernel::sm90:
      return "sm90";
    default:
      return "auto";
  }
}

inline AttnKernel parse_kernel(const std::optional<std::string_view>& arg, const char* op) {
  if (!arg.has_value() || arg->empty() || *arg == "auto") return AttnKernel::automatic;
  if (*arg == "cpu") return AttnKernel::cpu;
  if (*arg == "sm80") return AttnKernel::sm80;
  if (*arg == "sm90") return AttnKernel::sm90;
  TORCH_CHECK_VALUE(false, op, ": kernel must be None, 'auto', 'cpu', 'sm80' or 'sm90', got '",
                    std::string(*arg), "' ('flex' and 'streams' are backends of jacobi_attention, "
                    "not kernels of this op)");
  return AttnKernel::automatic;
}

}  // namespace jacobi::ops

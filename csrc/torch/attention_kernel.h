// Which attention kernel family an op call runs: the `kernel` argument of block_attention_fwd/bwd,
// or, when the caller passes none, the JACOBI_ATTN_KERNEL environment variable, read at call time
// so that a GPU run can compare kernels without code changes.
//
// Names (shared with jacobi_ext/attention.py BACKENDS, which documents them):
//   auto   the device's default: the CPU kernel on CPU; on CUDA the sm_80 kernel everywhere until
//          a GPU run has passed every attention test with the sm_90a kernel (issue 21 part 5);
//   cpu    the CPU kernel;
//   sm80   the sm_80 CUDA kernel (A100, and the fallback everywhere);
//   sm90   the sm_90a CUDA kernel on compute capability 9.x; elsewhere, or where no sm_90a
//          kernel exists for the dtype and head dim, the sm_80 one (with a warning, once).
//   flex, streams  backends of the Python front end (torch's FlexAttention / SDPA); from the
//          environment they leave a raw op call on `auto`, as an argument they are refused.
#pragma once

#include <c10/util/Exception.h>

#include <cstdlib>
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

constexpr const char* kAttnKernelEnv = "JACOBI_ATTN_KERNEL";

inline AttnKernel parse_kernel(const std::optional<std::string_view>& arg, const char* op) {
  const bool from_env = !arg.has_value();
  std::string name;
  if (from_env) {
    const char* env = std::getenv(kAttnKernelEnv);
    name = env != nullptr ? env : "";
  } else {
    name = std::string(*arg);
  }
  if (name.empty() || name == "auto") return AttnKernel::automatic;
  if (name == "cpu") return AttnKernel::cpu;
  if (name == "sm80") return AttnKernel::sm80;
  if (name == "sm90") return AttnKernel::sm90;
  if (from_env && (name == "flex" || name == "streams")) return AttnKernel::automatic;
  if (from_env) {
    TORCH_CHECK_VALUE(false, kAttnKernelEnv, "='", name,
                      "' is not an attention kernel; set it to one of sm80, sm90, flex, streams, "
                      "cpu or auto (or unset it)");
  }
  TORCH_CHECK_VALUE(false, op, ": kernel must be None, 'auto', 'cpu', 'sm80' or 'sm90', got '",
                    name, "' ('flex' and 'streams' are backends of jacobi_attention, not kernels "
                    "of this op)");
  return AttnKernel::automatic;
}

}  // namespace jacobi::ops

// What the CPU linear ops (linear_ops.cpp, linear_gguf_ops.cpp) share in handling their
// arguments: the bias check, x as M rows of K, and y's allocation, so that the fp32 / bf16 and the
// GGUF linear accept and return the same shapes and say the same things about a bad bias.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <c10/util/SmallVector.h>

#include <optional>

#include "checks.h"
#include "cpu/linear_cpu.h"

namespace jacobi::ops::linear_common {

// NR, the output features per panel of this CPU's kernels.
inline int64_t panel_width() { return JACOBI_CPU_DISPATCH(linear_panel_width); }

// The bias, checked ([N], on the CPU, float32 or x's dtype) and contiguous; undefined if none.
inline at::Tensor checked_bias(const std::optional<at::Tensor>& bias, int64_t N,
                               at::ScalarType x_dtype) {
  if (!bias.has_value() || !bias->defined()) return at::Tensor();
  jacobi::checks::rank(*bias, "bias", 1, "[out_features]");
  TORCH_CHECK_VALUE(bias->size(0) == N, "bias has ", bias->size(0), " entries, out_features is ",
                    N);
  TORCH_CHECK_VALUE(bias->device().is_cpu(), "bias is on ", bias->device(), ", x on the CPU");
  TORCH_CHECK_VALUE(bias->scalar_type() == at::kFloat || bias->scalar_type() == x_dtype,
                    "bias must be float32 or x's dtype (", x_dtype, "), got ",
                    bias->scalar_type());
  return bias->contiguous();
}

inline at::Tensor checked_bias(const std::optional<at::Tensor>& bias, int64_t N,
                               const at::Tensor& x) {
  return checked_bias(bias, N, x.scalar_type());
}

// x [..., K] as M rows with unit stride along k (a view where it can be).
struct Rows {
  int64_t M;
  at::Tensor x;  // [M, K]
  int64_t ldx;   // elements between rows
};

inline Rows rows_of(const at::Tensor& x) {
  const int64_t K = x.size(-1);
  // M from the leading dims, not reshape({-1, K}): that cannot infer M when K is 0.
  int64_t M = 1;
  for (int64_t i = 0; i + 1 < x.dim(); ++i) M *= x.size(i);
  // A contiguous x is its own rows (the same pointer and stride a reshape gives, without a view
  // made and freed per call: a step's ~120 linears made ~120 of them).
  if (x.is_contiguous()) return {M, x, K};
  const at::Tensor x2 = x.reshape({M, K});
  const at::Tensor xc = x2.stride(-1) == 1 ? x2 : x2.contiguous();
  return {M, xc, M > 1 ? xc.stride(0) : K};
}

// y [..., N] for x [..., K], x's dtype: the caller's *y_out (checked: contiguous, that many
// elements, any shape; the *_out forms), or a new tensor where y_out is nullptr.
inline at::Tensor output_into(at::Tensor* y_out, const at::Tensor& x, int64_t N) {
  c10::SmallVector<int64_t, 6> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  return checks::out_or_new(y_out, "y", shape, x.options());
}

}  // namespace jacobi::ops::linear_common

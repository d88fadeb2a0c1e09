// cpu_linear_pack / cpu_linear / cpu_linear_info: argument checks, output allocation and the
// hand-off to the decode-shaped linear kernels (csrc/cpu/linear_cpu.cpp; layout: linear_cpu.h).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "checks.h"
#include "cpu_step_ops.h"
#include "cpu/linear_cpu.h"
#include "linear_common.h"

namespace jacobi::ops {
namespace {

namespace ck = jacobi::checks;
using cpu::LinearDType;
using cpu::PackFormat;

LinearDType linear_dtype(at::ScalarType t, const char* name) {
  if (t == at::kFloat) return LinearDType::f32;
  if (t == at::kBFloat16) return LinearDType::bf16;
  TORCH_CHECK_VALUE(false, name, " must be float32 or bfloat16 (the CPU linear kernel's dtypes), "
                    "got ", t, "; other dtypes run through torch.nn.functional.linear");
}

using linear_common::panel_width;
PackFormat pack_format(LinearDType d) { return JACOBI_CPU_DISPATCH(linear_pack_format, d); }

const char* format_name(PackFormat f) {
  switch (f) {
    case PackFormat::f32_panels:
      return "f32_panels";
    case PackFormat::bf16_panels:
      return "bf16_panels";
    default:
      return "bf16_pairs";
  }
}

// The packed shape for N x K: [panels, k_rows, NR].
std::vector<int64_t> packed_shape(PackFormat f, int64_t N, int64_t K) {
  const int64_t nr = panel_width();
  const int64_t k_rows = f == PackFormat::bf16_pairs ? 2 * ((K + 1) / 2) : K;
  return {(N + nr - 1) / nr, k_rows, nr};
}

// Packs the concatenation along the output features of weights [N_i, K] (one weight: itself).
at::Tensor cpu_linear_pack_cat(at::TensorList weights) {
  TORCH_CHECK_VALUE(!weights.empty(), "cpu_linear_pack_cat needs at least one weight");
  const at::Tensor& first = weights[0];
  std::vector<at::Tensor> keep;  // contiguous copies of weights whose rows are not
  std::vector<const void*> rows;
  int64_t K = -1;
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    const std::string name = weights.size() == 1 ? "weight" : "weights[" + std::to_string(i) + "]";
    ck::rank(w, name.c_str(), 2, "[out_features, in_features]");
    TORCH_CHECK_VALUE(w.device().is_cpu(), name, " is on ", w.device(),
                      "; cpu_linear_pack packs CPU weights");
    linear_dtype(w.scalar_type(), name.c_str());
    TORCH_CHECK_VALUE(w.scalar_type() == first.scalar_type(), name, " has dtype ", w.scalar_type(),
                      ", weights[0] ", first.scalar_type());
    TORCH_CHECK_VALUE(K < 0 || w.size(1) == K, name, " has ", w.size(1),
                      " input features, weights[0] has ", K);
    K = w.size(1);
    const at::Tensor& c = w.stride(1) == 1 ? w : keep.emplace_back(w.contiguous());
    const char* base = static_cast<const char*>(c.data_ptr());
    for (int64_t n = 0; n < c.size(0); ++n) rows.push_back(base + n * c.stride(0) * c.element_size());
  }
  const LinearDType d = linear_dtype(first.scalar_type(), "weight");
  const int64_t N = static_cast<int64_t>(rows.size());
  at::Tensor packed = at::empty(packed_shape(pack_format(d), N, K), first.options());
  // (No transparent huge pages here: where they are in madvise mode, asking for them made packing
  // 2-30x slower on the dev machine, synchronous compaction, for no measurable gain in a step.)
  JACOBI_CPU_DISPATCH(linear_pack, d, rows.data(), N, K, packed.data_ptr());
  return packed;
}

at::Tensor cpu_linear_pack(const at::Tensor& weight) { return cpu_linear_pack_cat({weight}); }

// cpu_linear into y (nullptr: a new tensor, returned).
at::Tensor linear_impl(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                       const std::optional<at::Tensor>& bias, at::Tensor* y_out) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "x must be [..., in_features], got a 0-d tensor");
  TORCH_CHECK_VALUE(x.device().is_cpu() && packed.device().is_cpu(),
                    "cpu_linear runs on the CPU; x is on ", x.device(), ", packed on ",
                    packed.device());
  const LinearDType d = linear_dtype(x.scalar_type(), "x");
  TORCH_CHECK_VALUE(packed.scalar_type() == x.scalar_type(), "packed has dtype ",
                    packed.scalar_type(), " but x has ", x.scalar_type(),
                    "; pack the weight in x's dtype");
  ck::contiguous(packed, "packed");
  const int64_t K = x.size(-1), N = out_features;
  TORCH_CHECK_VALUE(N >= 0, "out_features must be >= 0, got ", N);
  const PackFormat f = pack_format(d);
  const auto want = packed_shape(f, N, K);
  TORCH_CHECK_VALUE(packed.sizes() == at::IntArrayRef(want), "packed has shape ", packed.sizes(),
                    " but a ", N, " x ", K, " weight packs to ", at::IntArrayRef(want),
                    " on this CPU (", format_name(f),
                    "): pack it with cpu_linear_pack(weight) in this process, for this x");
  const at::Tensor b = linear_common::checked_bias(bias, N, x);
  const linear_common::Rows rows = linear_common::rows_of(x);
  at::Tensor y = linear_common::output_into(y_out, x, N);
  cpu::LinearArgs a{d,
                    rows.M,
                    N,
                    K,
                    rows.x.data_ptr(),
                    rows.ldx,
                    packed.data_ptr(),
                    b.defined() ? b.data_ptr() : nullptr,
                    b.defined() && b.scalar_type() == at::kFloat,
                    y.data_ptr(),
                    N};
  JACOBI_CPU_DISPATCH(linear_packed, a);
  return y;
}

}  // namespace

at::Tensor cpu_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const std::optional<at::Tensor>& bias) {
  return linear_impl(x, packed, out_features, bias, nullptr);
}

void cpu_linear_out(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                    const std::optional<at::Tensor>& bias, at::Tensor& y) {
  linear_impl(x, packed, out_features, bias, &y);
}

namespace {

std::string cpu_linear_info(at::ScalarType dtype) {
  const LinearDType d = linear_dtype(dtype, "dtype");
  return std::string(cpu::isa_name(cpu::active_isa())) + " " + format_name(pack_format(d)) +
         " NR=" + std::to_string(panel_width());
}

// cpu_linear.out (module.cpp), over cpu_linear_out.
at::Tensor& linear_out_op(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                          const std::optional<at::Tensor>& bias, at::Tensor& out) {
  cpu_linear_out(x, packed, out_features, bias, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(jacobi_ext, CPU, m) {
  m.impl("cpu_linear.out", &linear_out_op);
  m.impl("cpu_linear_pack", &cpu_linear_pack);
  m.impl("cpu_linear_pack_cat", &cpu_linear_pack_cat);
  m.impl("cpu_linear", &cpu_linear);
}

TORCH_LIBRARY_IMPL(jacobi_ext, CompositeExplicitAutograd, m) {
  m.impl("cpu_linear_info", &cpu_linear_info);
}

}  // namespace jacobi::ops

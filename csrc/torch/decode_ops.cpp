// cpu_decode_attention / cpu_rms_norm: argument checks, output allocation and the hand-off to
// the fused small ops of a decoding step (csrc/cpu/decode_cpu.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "checks.h"
#include "cpu/decode_cpu.h"

namespace jacobi::ops {
namespace {

namespace ck = jacobi::checks;
using cpu::LinearDType;

LinearDType small_op_dtype(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kFloat) return LinearDType::f32;
  if (t.scalar_type() == at::kBFloat16) return LinearDType::bf16;
  TORCH_CHECK_VALUE(false, name, " must be float32 or bfloat16, got ", t.scalar_type());
}

at::Tensor cpu_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& mask, double scale) {
  ck::rank(q, "q", 4, "[B, Hq, Q, D]");
  ck::rank(k, "k", 4, "[B, Hkv, W, D]");
  ck::rank(v, "v", 4, "[B, Hkv, W, D]");
  const LinearDType d = small_op_dtype(q, "q");
  for (auto [t, name] : {std::pair{&k, "k"}, {&v, "v"}}) {
    TORCH_CHECK_VALUE(t->scalar_type() == q.scalar_type(), name, " has dtype ",
                      t->scalar_type(), ", q has ", q.scalar_type());
    TORCH_CHECK_VALUE(t->device().is_cpu(), name, " must be on the CPU, got ", t->device());
    TORCH_CHECK_VALUE(t->stride(3) == 1, name, "'s last dim must be contiguous");
  }
  TORCH_CHECK_VALUE(q.device().is_cpu(), "q must be on the CPU, got ", q.device());
  const int64_t B = q.size(0), Hq = q.size(1), Q = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), W = k.size(2);
  TORCH_CHECK_VALUE(k.size(0) == B && v.size(0) == B, "q, k, v must have the same batch size");
  TORCH_CHECK_VALUE(Hkv >= 1 && Hq % Hkv == 0, "q's ", Hq, " heads must be a multiple of k's ",
                    Hkv);
  TORCH_CHECK_VALUE(v.size(1) == Hkv && v.size(2) == W && k.size(3) == D && v.size(3) == D,
                    "k and v must both be [B, Hkv, W, D] = [", B, ", ", Hkv, ", ", W, ", ", D,
                    "], got ", k.sizes(), " and ", v.sizes());
  ck::dtype(mask, "mask", at::kBool);
  TORCH_CHECK_VALUE(mask.dim() == 4 && mask.size(0) == B && mask.size(1) == 1 &&
                        mask.size(2) == Q && mask.size(3) == W,
                    "mask must be [B, 1, Q, W] = [", B, ", 1, ", Q, ", ", W, "], got ",
                    mask.sizes());
  const at::Tensor qc = q.stride(3) == 1 ? q : q.contiguous();
  const at::Tensor mc = mask.contiguous();
  at::Tensor out = at::empty({B, Q, Hq, D}, q.options());
  if (out.numel() == 0) return out;
  const int64_t threads = at::get_num_threads();
  at::Tensor scratch = at::empty(
      {cpu::decode_attention_scratch_floats(B, Hkv, W, D, threads)}, q.options().dtype(at::kFloat));
  cpu::DecodeAttnArgs a{d, B, Hq, Hkv, Q, W, D,
                        qc.data_ptr(), qc.stride(0), qc.stride(1), qc.stride(2),
                        k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
                        v.data_ptr(), v.stride(0), v.stride(1), v.stride(2),
                        mc.data_ptr<bool>(), static_cast<float>(scale), out.data_ptr(),
                        scratch.data_ptr<float>()};
  JACOBI_CPU_DISPATCH(decode_attention, a);
  return out;
}

at::Tensor cpu_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const LinearDType d = small_op_dtype(x, "x");
  TORCH_CHECK_VALUE(x.device().is_cpu(), "x must be on the CPU, got ", x.device());
  ck::rank(weight, "weight", 1, "[features]");
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type(), "weight has dtype ",
                    weight.scalar_type(), ", x has ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1 && weight.size(0) == x.size(-1), "weight has ", weight.size(0),
                    " features, x's last dim ", x.dim() ? x.size(-1) : 0);
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(-1);
  cpu::RmsNormArgs a{d, n ? xc.numel() / n : 0, n, xc.data_ptr(), wc.data_ptr(),
                     static_cast<float>(eps), y.data_ptr()};
  if (a.rows > 0) JACOBI_CPU_DISPATCH(rms_norm, a);
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(jacobi_ext, CPU, m) {
  m.impl("cpu_decode_attention", &cpu_decode_attention);
  m.impl("cpu_rms_norm", &cpu_rms_norm);
}

}  // namespace jacobi::ops

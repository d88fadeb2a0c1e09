// gumbel_argmax: argument checks and the CPU implementation (semantics: jacobi/sampling.h).
#include "sampling_ops.h"

#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "checks.h"
#include "cpu/decode_cpu.h"
#include "cpu/sampling_cpu.h"

namespace jacobi::ops {

SamplingParams check_gumbel_argmax(const at::Tensor& logits, const at::Tensor& keys,
                                   const at::Tensor& positions, double temperature,
                                   int64_t top_k, double top_p, double min_p) {
  namespace ck = jacobi::checks;
  ck::rank(logits, "logits", 3, "[batch, positions, vocab]");
  ck::rank(keys, "keys", 2, "[batch, 2] (seed, stream)");
  ck::rank(positions, "positions", 2, "[batch, positions]");
  TORCH_CHECK_VALUE(at::isFloatingType(logits.scalar_type()),
                    "logits must be floating point, got ", logits.scalar_type());
  ck::dtype(keys, "keys", at::kLong);
  ck::dtype(positions, "positions", at::kLong);
  ck::same_device(keys, "keys", logits, "logits");
  ck::same_device(positions, "positions", logits, "logits");
  const int64_t B = logits.size(0), Q = logits.size(1), V = logits.size(2);
  TORCH_CHECK_VALUE(keys.size(0) == B && keys.size(1) == 2, "keys must be [batch=", B,
                    ", 2], got shape ", keys.sizes());
  TORCH_CHECK_VALUE(positions.size(0) == B && positions.size(1) == Q, "positions must be [", B,
                    ", ", Q, "] (one per logits row), got shape ", positions.sizes());
  TORCH_CHECK_VALUE(V >= 1 && V <= INT32_MAX, "the vocabulary must hold 1 .. 2^31 - 1 tokens, got ",
                    V);
  TORCH_CHECK_VALUE(std::isfinite(temperature) && temperature > 0.0,
                    "temperature must be a float > 0, got ", temperature);
  TORCH_CHECK_VALUE(top_k >= 0, "top_k must be an int >= 0 (0: off), got ", top_k);
  TORCH_CHECK_VALUE(top_p > 0.0 && top_p <= 1.0, "top_p must be in (0, 1] (1: off), got ", top_p);
  TORCH_CHECK_VALUE(min_p >= 0.0 && min_p <= 1.0, "min_p must be in [0, 1] (0: off), got ", min_p);
  if (positions.device().is_cpu() && positions.numel() > 0) {  // a device read would sync
    const at::Tensor c = positions.contiguous();
    const int64_t* p = c.data_ptr<int64_t>();
    for (int64_t i = 0; i < c.numel(); ++i)
      TORCH_CHECK_VALUE(p[i] >= 0 && p[i] <= UINT32_MAX, "positions must be in [0, 2^32), got ",
                        p[i]);
  }
  return SamplingParams{temperature, top_k, top_p, min_p};
}

namespace {

at::Tensor gumbel_argmax_cpu(const at::Tensor& logits, const at::Tensor& keys,
                             const at::Tensor& positions, double temperature, int64_t top_k,
                             double top_p, double min_p) {
  const SamplingParams p =
      check_gumbel_argmax(logits, keys, positions, temperature, top_k, top_p, min_p);
  const int64_t B = logits.size(0), Q = logits.size(1), V = logits.size(2);
  at::Tensor out = at::empty({B, Q}, positions.options());
  if (out.numel() == 0) return out;
  // bf16 / fp16 logits are widened once (the CPU kernel reads float or double).
  const bool wide = logits.scalar_type() == at::kDouble;
  const at::Tensor x = wide ? logits.contiguous() : logits.to(at::kFloat).contiguous();
  const at::Tensor k = keys.contiguous(), pos = positions.contiguous();
  if (wide) {
    jacobi::cpu::gumbel_argmax(x.data_ptr<double>(), B * Q, V, Q, k.data_ptr<int64_t>(),
                               pos.data_ptr<int64_t>(), p, out.data_ptr<int64_t>());
  } else {
    jacobi::cpu::gumbel_argmax(x.data_ptr<float>(), B * Q, V, Q, k.data_ptr<int64_t>(),
                               pos.data_ptr<int64_t>(), p, out.data_ptr<int64_t>());
  }
  return out;
}

at::Tensor debug_gumbel_noise_cpu(const at::Tensor& keys, const at::Tensor& positions,
                                  int64_t vocab, bool uniform) {
  const at::Tensor logits = at::empty({positions.size(0), positions.size(1), vocab},
                                      positions.options().dtype(at::kDouble));
  check_gumbel_argmax(logits, keys, positions, 1.0, 0, 1.0, 0.0);
  const at::Tensor k = keys.contiguous(), pos = positions.contiguous();
  jacobi::cpu::debug_noise(logits.size(0) * logits.size(1), vocab, logits.size(1),
                           k.data_ptr<int64_t>(), pos.data_ptr<int64_t>(), uniform,
                           logits.data_ptr<double>());
  return logits;
}

at::Tensor cpu_argmax(const at::Tensor& logits) {
  TORCH_CHECK_VALUE(logits.dim() >= 1 && logits.size(-1) >= 1,
                    "logits must be [..., vocab] with vocab >= 1, got shape ", logits.sizes());
  TORCH_CHECK_VALUE(at::isFloatingType(logits.scalar_type()),
                    "logits must be floating point, got ", logits.scalar_type());
  const int64_t V = logits.size(-1), rows = logits.numel() / V;
  std::vector<int64_t> shape(logits.sizes().begin(), logits.sizes().end() - 1);
  at::Tensor out = at::empty(shape, logits.options().dtype(at::kLong));
  if (rows == 0) return out;
  // bf16 / fp16 widen to fp32 exactly (the order of values and NaNs is kept).
  const bool wide = logits.scalar_type() == at::kDouble;
  const at::Tensor x = wide ? logits.contiguous() : logits.to(at::kFloat).contiguous();
  if (wide) {
    jacobi::cpu::argmax_rows(x.data_ptr<double>(), rows, V, out.data_ptr<int64_t>());
  } else {
    JACOBI_CPU_DISPATCH(argmax_f32, x.data_ptr<float>(), rows, V, out.data_ptr<int64_t>());
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(jacobi_ext, CPU, m) {
  m.impl("argmax", &cpu_argmax);
  m.impl("gumbel_argmax", &gumbel_argmax_cpu);
  m.impl("debug_gumbel_noise", &debug_gumbel_noise_cpu);
}

}  // namespace jacobi::ops

// The CPU ops of a decoding step, callable from C++ as they are from Python (the same argument
// checks and kernels): lean_ops.cpp runs a step's layers through them in one call. Each is
// documented at its schema (module.cpp) and defined in linear_ops.cpp, linear_gguf_ops.cpp or
// decode_ops.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "cpu/linear_gguf_cpu.h"

namespace jacobi::ops {

at::Tensor cpu_linear(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                      const std::optional<at::Tensor>& bias);
at::Tensor cpu_linear_gguf(const at::Tensor& x, const at::Tensor& packed, int64_t type,
                           int64_t out_features, const std::optional<at::Tensor>& bias,
                           const std::optional<at::Tensor>& lora_a,
                           const std::optional<at::Tensor>& lora_b,
                           const std::optional<at::Tensor>& lora_panel_r0,
                           bool int8_activations);
at::Tensor cpu_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);
// Qwen3's q_norm / k_norm: the RMSNorm of each q and k head of qkv [..., (heads + 2 kv_heads) D]
// with q_weight / k_weight [D], in place (the v heads untouched).
void qk_rms_norm_(at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& q_weight,
                  const at::Tensor& k_weight, double eps);
at::Tensor cpu_gguf_q8_0_rows(const at::Tensor& raw, const at::Tensor& ids);
std::tuple<at::Tensor, at::Tensor> cpu_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps);
at::Tensor cpu_silu_mul(const at::Tensor& gu);
at::Tensor cpu_rope_attention(const at::Tensor& qkv, int64_t heads, int64_t kv_heads,
                              const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                              at::Tensor& v_cache, const at::Tensor& slots, int64_t attend,
                              const at::Tensor& mask, double scale,
                              const std::optional<at::Tensor>& kt_cache,
                              int64_t context_start);

// cpu_linear_gguf's weight side checked once (packed, type, bias, LoRA: everything but x), and
// its launch on an x of in_features (checked: float32 on the CPU) into y (nullptr: a new tensor,
// returned; else as the *_out forms below) with the LoRA's x A^T in *t_ws (made or grown; nullptr:
// a new tensor). lean_ops.cpp plans each linear once: a call's checks were ~0.5 us, 120 calls a
// one-token step with the second thread idle through them.
struct GgufLinearPlan {
  int64_t type = 0, N = 0, K = 0;
  bool int8 = false;
  at::Tensor packed, bias, lora_a, lora_b, lora_panel_r0;  // held: the pointers below stay valid
  cpu::GgufLora lora;  // t unset (the launch's)
};
GgufLinearPlan plan_linear_gguf(const at::Tensor& packed, int64_t type, int64_t out_features,
                                int64_t in_features, const std::optional<at::Tensor>& bias,
                                const std::optional<at::Tensor>& lora_a,
                                const std::optional<at::Tensor>& lora_b,
                                const std::optional<at::Tensor>& lora_panel_r0,
                                bool int8_activations);
at::Tensor run_linear_gguf(const GgufLinearPlan& plan, const at::Tensor& x, at::Tensor* y_out,
                           at::Tensor* t_ws);

// The same ops writing into outputs the caller keeps (lean_ops.cpp: a step's buffers made once,
// where each call made its own, ~15 tensors a layer). Each output must be a contiguous CPU tensor
// with as many elements of the dtype as the op's result (checked), any shape; lora_t is the
// LoRA's x A^T, made or grown in place as needed. The same kernels on the same values: the same
// bits as the ops above.
void cpu_linear_out(const at::Tensor& x, const at::Tensor& packed, int64_t out_features,
                    const std::optional<at::Tensor>& bias, at::Tensor& y);
void cpu_linear_gguf_out(const at::Tensor& x, const at::Tensor& packed, int64_t type,
                         int64_t out_features, const std::optional<at::Tensor>& bias,
                         const std::optional<at::Tensor>& lora_a,
                         const std::optional<at::Tensor>& lora_b,
                         const std::optional<at::Tensor>& lora_panel_r0, bool int8_activations,
                         at::Tensor& y, at::Tensor& lora_t);
void cpu_add_rms_norm_out(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                          double eps, at::Tensor& h, at::Tensor& y);
void cpu_silu_mul_out(const at::Tensor& gu, at::Tensor& out);
void cpu_rope_attention_out(const at::Tensor& qkv, int64_t heads, int64_t kv_heads,
                            const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                            at::Tensor& v_cache, const at::Tensor& slots, int64_t attend,
                            const at::Tensor& mask, double scale,
                            const std::optional<at::Tensor>& kt_cache, int64_t context_start,
                            at::Tensor& out);

}  // namespace jacobi::ops

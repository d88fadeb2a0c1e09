// torch.classes.jacobi_ext.LeanLayers: the decoder layers of the lean CPU forward
// (jacobi_ext/decoding/lean.py) run in one call from Python.
//
// Why: the Python loop called 8 ops a layer (q/k/v, rotary + cache write + attention, o, add +
// norm, gate/up, silu * up, down, add + norm), 240 a step on a 30-layer model, and each call from
// Python cost 2-4 us in argument conversion and dispatch before any kernel ran: ~0.7 ms of a
// ~11 ms one-token step, with the OpenMP worker waiting through it. Here the same ops (the same
// functions, argument checks and kernels; cpu_step_ops.h) are called from C++ in the same order on
// the same tensors, so the result is bitwise the Python loop's.
#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <optional>
#include <tuple>
#include <vector>

#include "cpu_step_ops.h"

namespace jacobi::ops {
namespace {

// One linear's fixed arguments: cpu_linear (fp32 / bf16 panels) where type < 0, else
// cpu_linear_gguf of that ggml type (with its LoRA, if any).
struct LeanLinear {
  at::Tensor packed;
  int64_t type = -1;
  int64_t n = 0;
  std::optional<at::Tensor> bias, lora_a, lora_b, lora_panel_r0;
  bool int8_activations = false;

  at::Tensor operator()(const at::Tensor& x) const {
    if (type < 0) return cpu_linear(x, packed, n, bias);
    return cpu_linear_gguf(x, packed, type, n, bias, lora_a, lora_b, lora_panel_r0,
                           int8_activations);
  }
};

struct LeanLayer {
  LeanLinear qkv, o, gate_up, down;
  int64_t heads = 0, kv_heads = 0;
  double scale = 1.0;
  at::Tensor ln2_weight, next_weight;  // the post-attention norm; the next layer's input norm
  double ln2_eps = 0.0, next_eps = 0.0;  // (after the last layer: the model's final norm)
};

struct LeanLayers : torch::CustomClassHolder {
  std::vector<LeanLayer> layers;
  // add_linear's, taken by the next add_layer: q/k/v, o, gate/up, down
  std::vector<LeanLinear> pending;

  void add_linear(at::Tensor packed, int64_t type, int64_t out_features,
                  std::optional<at::Tensor> bias, std::optional<at::Tensor> lora_a,
                  std::optional<at::Tensor> lora_b, std::optional<at::Tensor> lora_panel_r0,
                  bool int8_activations) {
    pending.push_back(LeanLinear{std::move(packed), type, out_features, std::move(bias),
                                 std::move(lora_a), std::move(lora_b), std::move(lora_panel_r0),
                                 int8_activations});
  }

  void add_layer(int64_t heads, int64_t kv_heads, double scale, at::Tensor ln2_weight,
                 double ln2_eps, at::Tensor next_weight, double next_eps) {
    TORCH_CHECK_VALUE(pending.size() == 4, "add_layer takes the 4 linears added before it ",
                      "(q/k/v, o, gate/up, down), got ", pending.size());
    layers.push_back(LeanLayer{pending[0], pending[1], pending[2], pending[3], heads, kv_heads,
                               scale, std::move(ln2_weight), std::move(next_weight), ln2_eps,
                               next_eps});
    pending.clear();
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }

  // x: the first layer's normed input [B, Q, hidden], h: the residual stream [B, Q, hidden];
  // per layer its cache's keys, values and blocked transposed keys; slots, attend, mask and
  // context_start as cpu_rope_attention takes them. Returns the final norm of the last layer's
  // output.
  at::Tensor run(at::Tensor x, at::Tensor h, at::Tensor cos, at::Tensor sin,
                 std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                 std::vector<at::Tensor> keys_t, at::Tensor slots, int64_t attend,
                 at::Tensor mask, int64_t context_start) {
    const size_t L = layers.size();
    TORCH_CHECK_VALUE(keys.size() == L && values.size() == L && keys_t.size() == L,
                      "run takes one keys, values and keys_t tensor per layer (", L, "), got ",
                      keys.size(), ", ", values.size(), ", ", keys_t.size());
    TORCH_CHECK_VALUE(x.dim() == 3, "x must be [B, Q, hidden], got ", x.sizes());
    const int64_t B = x.size(0), Q = x.size(1);
    for (size_t i = 0; i < L; ++i) {
      const LeanLayer& l = layers[i];
      const at::Tensor out =
          cpu_rope_attention(l.qkv(x), l.heads, l.kv_heads, cos, sin, keys[i], values[i], slots,
                             attend, mask, l.scale, keys_t[i], context_start);
      std::tie(h, x) = cpu_add_rms_norm(l.o(out.view({B, Q, -1})), h, l.ln2_weight, l.ln2_eps);
      const at::Tensor m = cpu_silu_mul(l.gate_up(x));
      std::tie(h, x) = cpu_add_rms_norm(l.down(m), h, l.next_weight, l.next_eps);
    }
    return x;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(jacobi_ext, m) {
  m.class_<LeanLayers>("LeanLayers")
      .def(torch::init<>())
      .def("add_linear", &LeanLayers::add_linear)
      .def("add_layer", &LeanLayers::add_layer)
      .def("size", &LeanLayers::size)
      .def("run", &LeanLayers::run);
}

}  // namespace jacobi::ops

// torch.classes.jacobi_ext.LeanLayers: the decoder layers of the lean CPU forward
// (jacobi_ext/decoding/lean.py) run in one call from Python.
//
// Why: the Python loop called 8 ops a layer (q/k/v, [Qwen3's q/k norms,] rotary + cache write +
// attention, o, add + norm, gate/up, silu * up, down, add + norm), 240 a step on a 30-layer model, and each call from
// Python cost 2-4 us in argument conversion and dispatch before any kernel ran: ~0.7 ms of a
// ~11 ms one-token step, with the OpenMP worker waiting through it. Here the same ops (the same
// functions, argument checks and kernels; cpu_step_ops.h) are called from C++ in the same order on
// the same tensors, so the result is bitwise the Python loop's.
//
// The ops write into buffers the object keeps (the *_out forms): each call made its own outputs,
// ~15 tensors a layer (made, checked, freed) while the other thread waited; keeping them took
// 0.2-0.3 ms off a ~4 ms 8-bit one-token step on a 2-core EPYC (2026-12-05). Only the returned
// normed hidden states are new.
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <mutex>
#include <optional>
#include <vector>

#include "cpu/team.h"
#include "cpu_step_ops.h"

namespace jacobi::ops {
namespace {

// One linear's fixed arguments: cpu_linear (fp32 / bf16 panels) where type < 0, else
// cpu_linear_gguf of that ggml type (with its LoRA, if any), planned once (its weight side
// checked at add_linear; a call checks x and y).
struct LeanLinear {
  at::Tensor packed;
  int64_t type = -1;
  int64_t n = 0;
  std::optional<at::Tensor> bias;
  GgufLinearPlan plan;

  // The linear of x into y (x's rows by n), a LoRA's x A^T into lora_t.
  void into(const at::Tensor& x, at::Tensor& y, at::Tensor& lora_t) const {
    if (type < 0) return cpu_linear_out(x, packed, n, bias, y);
    run_linear_gguf(plan, x, &y, &lora_t);
  }
};

// A step's buffers, kept from call to call (remade when a shape changes).
struct Workspace {
  at::Tensor qkv, attn, o, h[2], x, gu, m, down, lora_t;

  // t as [B, Q, n] of x's dtype: kept if it is already that.
  static at::Tensor& ensure(at::Tensor& t, int64_t B, int64_t Q, int64_t n,
                            const at::Tensor& like) {
    if (!t.defined() || t.dim() != 3 || t.size(0) != B || t.size(1) != Q || t.size(2) != n ||
        t.scalar_type() != like.scalar_type()) {
      t = at::empty({B, Q, n}, like.options());
    }
    return t;
  }
};

struct LeanLayer {
  LeanLinear qkv, o, gate_up, down;
  int64_t heads = 0, kv_heads = 0;
  double scale = 1.0;
  at::Tensor ln2_weight, next_weight;  // the post-attention norm; the next layer's input norm
  double ln2_eps = 0.0, next_eps = 0.0;  // (after the last layer: the model's final norm)
  at::Tensor q_norm, k_norm;  // Qwen3's per-head norms of q and k (undefined: none)
  double qk_eps = 0.0;
};

struct LeanLayers : torch::CustomClassHolder {
  std::vector<LeanLayer> layers;
  // add_linear's, taken by the next add_layer: q/k/v, o, gate/up, down
  std::vector<LeanLinear> pending;
  Workspace ws;
  std::mutex ws_lock;  // callers at the same time take turns (they share ws)

  void add_linear(at::Tensor packed, int64_t type, int64_t out_features,
                  std::optional<at::Tensor> bias, std::optional<at::Tensor> lora_a,
                  std::optional<at::Tensor> lora_b, std::optional<at::Tensor> lora_panel_r0,
                  bool int8_activations) {
    LeanLinear l{packed, type, out_features, bias, {}};
    if (type >= 0) {  // in_features: the packed groups' k (packed [panels, K / G, group bytes])
      cpu::GgufFormat f;
      TORCH_CHECK_VALUE(packed.dim() == 3 && cpu::gguf_format(static_cast<int32_t>(type), &f),
                        "add_linear: packed must be cpu_linear_gguf_pack's [panels, groups, "
                        "bytes] of a type the kernels read, got ", packed.sizes(), ", type ", type);
      l.plan = plan_linear_gguf(packed, type, out_features, packed.size(1) * f.group_k, bias,
                                lora_a, lora_b, lora_panel_r0, int8_activations);
    }
    pending.push_back(std::move(l));
  }

  void add_layer(int64_t heads, int64_t kv_heads, double scale, at::Tensor ln2_weight,
                 double ln2_eps, at::Tensor next_weight, double next_eps) {
    TORCH_CHECK_VALUE(pending.size() == 4, "add_layer takes the 4 linears added before it ",
                      "(q/k/v, o, gate/up, down), got ", pending.size());
    layers.push_back(LeanLayer{pending[0], pending[1], pending[2], pending[3], heads, kv_heads,
                               scale, std::move(ln2_weight), std::move(next_weight), ln2_eps,
                               next_eps, {}, {}, 0.0});  // (q/k norms: set_qk_norm)
    pending.clear();
  }

  // The last added layer normalises each head of q and of k before the rotary (Qwen3).
  void set_qk_norm(at::Tensor q_weight, at::Tensor k_weight, double eps) {
    TORCH_CHECK_VALUE(!layers.empty(), "set_qk_norm follows the add_layer it belongs to");
    LeanLayer& l = layers.back();
    l.q_norm = std::move(q_weight), l.k_norm = std::move(k_weight), l.qk_eps = eps;
  }

  int64_t size() const { return static_cast<int64_t>(layers.size()); }

  // ar_step's input side: the token embedding (dense rows [V, hidden] of the model's dtype, or
  // with q8_0 a Q8_0 table as the file stores it, [V, blocks * 34]) and the first layer's norm.
  at::Tensor embed, in_norm;
  bool embed_q8_0 = false;
  double in_eps = 0.0;

  void set_input(at::Tensor embedding, bool q8_0, at::Tensor norm_weight, double eps) {
    embed = std::move(embedding), embed_q8_0 = q8_0, in_norm = std::move(norm_weight);
    in_eps = eps;
  }

  // One sequence's AR step in the runtime's in-place layout (jacobi_ext/decoding/runtime.py,
  // StaticRuntime.ar_forward): tokens ids [q] written at slots [hi, hi + q), at positions
  // hi - lo + i, token i seeing slots [lo, hi + i] (the committed context from lo, then itself
  // and the tokens before it). The embedding rows, rotary rows cos_tab / sin_tab [positions, D]
  // (the tables the Python forward indexes), the first norm, then run(): the inputs Python made
  // from ~10 tensor ops a step (the same values, so the same bits). Returns run()'s result.
  at::Tensor ar_step(at::Tensor ids, int64_t lo, int64_t hi, at::Tensor cos_tab,
                     at::Tensor sin_tab, std::vector<at::Tensor> keys,
                     std::vector<at::Tensor> values, std::vector<at::Tensor> keys_t,
                     int64_t context_start) {
    TORCH_CHECK_VALUE(embed.defined(), "ar_step needs set_input first");
    TORCH_CHECK_VALUE(ids.dim() == 1 && ids.size(0) >= 1 && ids.scalar_type() == at::kLong,
                      "ids must be int64 [q >= 1], got ", ids.scalar_type(), " ", ids.sizes());
    TORCH_CHECK_VALUE(!keys.empty() && keys[0].dim() == 4, "keys: one [B, kv_heads, slots, D] "
                      "tensor per layer");
    const int64_t q = ids.size(0), slots_n = keys[0].size(2);
    TORCH_CHECK_VALUE(context_start <= lo && lo <= hi && hi + q <= slots_n,
                      "ar_step: need context_start <= lo <= hi and hi + q <= ", slots_n,
                      " slots, got context_start ", context_start, ", lo ", lo, ", hi ", hi,
                      ", q ", q);
    TORCH_CHECK_VALUE(cos_tab.dim() == 2 && sin_tab.sizes() == cos_tab.sizes() &&
                          hi - lo + q <= cos_tab.size(0),
                      "cos_tab and sin_tab must be [positions > ", hi - lo + q - 1,
                      ", D], got ", cos_tab.sizes(), " and ", sin_tab.sizes());
    at::Tensor h = embed_q8_0 ? cpu_gguf_q8_0_rows(embed, ids) : embed.index_select(0, ids);
    h = h.unsqueeze(0);  // [1, q, hidden]
    const at::Tensor cos = cos_tab.narrow(0, hi - lo, q).unsqueeze(0);
    const at::Tensor sin = sin_tab.narrow(0, hi - lo, q).unsqueeze(0);
    at::Tensor x = cpu_rms_norm(h, in_norm, in_eps);
    const int64_t attend = hi + q;
    at::Tensor mask = at::empty({1, 1, q, attend}, ids.options().dtype(at::kBool));
    bool* m = mask.data_ptr<bool>();
    for (int64_t i = 0; i < q; ++i) {
      for (int64_t j = 0; j < attend; ++j) m[i * attend + j] = j >= lo && j <= hi + i;
    }
    at::Tensor slots = at::arange(hi, hi + q, ids.options());
    return run(x, h, cos, sin, std::move(keys), std::move(values), std::move(keys_t), slots,
               attend, mask, context_start);
  }

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
    const std::lock_guard<std::mutex> hold(ws_lock);
    const int64_t B = x.size(0), Q = x.size(1), hidden = x.size(2);
    // The residual stream after a layer's attention goes to ws.h[0], after its MLP to ws.h[1]
    // (the caller's h is read, never written); x, the normed input of each projection, is
    // overwritten by the next norm, which reads neither it nor the buffer it writes. The last
    // norm's output is new: it is returned.
    at::Tensor& h_attn = Workspace::ensure(ws.h[0], B, Q, hidden, x);
    at::Tensor& h_mlp = Workspace::ensure(ws.h[1], B, Q, hidden, x);
    at::Tensor& xn = Workspace::ensure(ws.x, B, Q, hidden, x);
    at::Tensor out = x;  // (no layers)
    // The layers in one parallel region: this thread runs the loop, the others wait in it for
    // each kernel's chunks (csrc/cpu/team.h).
    cpu::team_run([&] {
      for (size_t i = 0; i < L; ++i) {
        const LeanLayer& l = layers[i];
        const int64_t D = keys[i].size(-1);
        at::Tensor& qkv = Workspace::ensure(ws.qkv, B, Q, l.qkv.n, x);
        l.qkv.into(x, qkv, ws.lora_t);
        if (l.q_norm.defined())
          qk_rms_norm_(qkv, l.heads, l.kv_heads, l.q_norm, l.k_norm, l.qk_eps);
        at::Tensor& attn = Workspace::ensure(ws.attn, B, Q, l.heads * D, x);
        cpu_rope_attention_out(qkv, l.heads, l.kv_heads, cos, sin, keys[i], values[i], slots,
                               attend, mask, l.scale, keys_t[i], context_start, attn);
        at::Tensor& o = Workspace::ensure(ws.o, B, Q, l.o.n, x);
        l.o.into(attn, o, ws.lora_t);
        cpu_add_rms_norm_out(o, i == 0 ? h : h_mlp, l.ln2_weight, l.ln2_eps, h_attn, xn);
        at::Tensor& gu = Workspace::ensure(ws.gu, B, Q, l.gate_up.n, x);
        l.gate_up.into(xn, gu, ws.lora_t);
        at::Tensor& m = Workspace::ensure(ws.m, B, Q, l.gate_up.n / 2, x);
        cpu_silu_mul_out(gu, m);
        at::Tensor& down = Workspace::ensure(ws.down, B, Q, l.down.n, x);
        l.down.into(m, down, ws.lora_t);
        if (i + 1 == L) {
          out = at::empty({B, Q, hidden}, x.options());
          cpu_add_rms_norm_out(down, h_attn, l.next_weight, l.next_eps, h_mlp, out);
        } else {
          cpu_add_rms_norm_out(down, h_attn, l.next_weight, l.next_eps, h_mlp, xn);
          x = xn;
        }
      }
    });
    return out;
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(jacobi_ext, m) {
  m.class_<LeanLayers>("LeanLayers")
      .def(torch::init<>())
      .def("add_linear", &LeanLayers::add_linear)
      .def("add_layer", &LeanLayers::add_layer)
      .def("set_qk_norm", &LeanLayers::set_qk_norm)
      .def("size", &LeanLayers::size)
      .def("set_input", &LeanLayers::set_input)
      .def("ar_step", &LeanLayers::ar_step)
      .def("run", &LeanLayers::run);
}

}  // namespace jacobi::ops

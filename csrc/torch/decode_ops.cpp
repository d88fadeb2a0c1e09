// The CPU implementations of cpu_decode_attention, cpu_rope_attention, rms_norm,
// fused_add_rms_norm, silu_and_mul, qk_rms_norm_, kv_commit, cpu_step_mask and rope_attention:
// argument checks, output allocation and the hand-off to
// the fused small ops of a decoding step (csrc/cpu/decode_cpu.h).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <c10/util/SmallVector.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <tuple>
#include <vector>

#include "checks.h"
#include "cpu_step_ops.h"
#include "cpu/decode_cpu.h"
#include "jacobi/decode_step.h"

namespace jacobi::ops {
namespace {

// The attention's working memory (transposed keys, scores): kept per calling thread and grown as
// needed, not allocated per call: at a few hundred keys it is ~0.5 MB, and a fresh allocation of
// that size per layer and step (page faults on first touch) cost more than the attention itself.
float* attention_scratch(int64_t floats) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < floats) buf.resize(static_cast<size_t>(floats));
  return buf.data();
}

namespace ck = jacobi::checks;
using cpu::LinearDType;

LinearDType small_op_dtype(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kFloat) return LinearDType::f32;
  if (t.scalar_type() == at::kBFloat16) return LinearDType::bf16;
  TORCH_CHECK_VALUE(false, name, " must be float32 or bfloat16, got ", t.scalar_type());
}

// Whether keys and values k, v are a half (fp16) cache for fp32 queries q; otherwise they must
// have q's dtype. (A half cache halves the attention's reads of the cache; its values are the
// keys and values rounded to fp16, widened exactly where the kernel reads them.)
bool half_kv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const char* qn,
             const char* kn, const char* vn) {
  const bool half = k.scalar_type() == at::kHalf;
  TORCH_CHECK_VALUE(k.scalar_type() == v.scalar_type(), kn, " and ", vn,
                    " must have one dtype, got ", k.scalar_type(), " and ", v.scalar_type());
  TORCH_CHECK_VALUE(k.scalar_type() == q.scalar_type() || (half && q.scalar_type() == at::kFloat),
                    kn, " and ", vn, " must have ", qn, "'s dtype (", q.scalar_type(),
                    "), or float16 (a half K/V cache) with float32 ", qn, "; got ",
                    k.scalar_type());
  return half;
}

at::Tensor cpu_decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& mask, double scale) {
  ck::rank(q, "q", 4, "[B, Hq, Q, D]");
  ck::rank(k, "k", 4, "[B, Hkv, W, D]");
  ck::rank(v, "v", 4, "[B, Hkv, W, D]");
  const LinearDType d = small_op_dtype(q, "q");
  const bool kv_half = half_kv(q, k, v, "q", "k", "v");
  for (auto [t, name] : {std::pair{&k, "k"}, {&v, "v"}}) {
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
  float* scratch =
      attention_scratch(cpu::decode_attention_scratch_floats(B, Hkv, Hq, Q, W, D, threads));
  cpu::DecodeAttnArgs a{d, B, Hq, Hkv, Q, W, D,
                        qc.data_ptr(), qc.stride(0), qc.stride(1), qc.stride(2),
                        k.data_ptr(), k.stride(0), k.stride(1), k.stride(2),
                        v.data_ptr(), v.stride(0), v.stride(1), v.stride(2),
                        mc.data_ptr<bool>(), static_cast<float>(scale), out.data_ptr(),
                        scratch};
  a.kv_half = kv_half;
  JACOBI_CPU_DISPATCH(decode_attention, a);
  return out;
}

// The norm of x (+ residual, the sum into *h_out), into *y_out where given (else new tensors;
// given ones are checked: contiguous, x's dtype and element count).
at::Tensor rms_norm_into(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                         double eps, at::Tensor* h_out, at::Tensor* y_out = nullptr) {
  const LinearDType d = small_op_dtype(x, "x");
  TORCH_CHECK_VALUE(x.device().is_cpu(), "x must be on the CPU, got ", x.device());
  ck::rank(weight, "weight", 1, "[features]");
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type(), "weight has dtype ",
                    weight.scalar_type(), ", x has ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1 && weight.size(0) == x.size(-1), "weight has ", weight.size(0),
                    " features, x's last dim ", x.dim() ? x.size(-1) : 0);
  at::Tensor rc;
  if (residual != nullptr) {
    TORCH_CHECK_VALUE(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                      "residual must have x's shape ", x.sizes(), " and dtype ", x.scalar_type(),
                      ", got ", residual->sizes(), " ", residual->scalar_type());
    rc = residual->contiguous();
  }
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  // Given buffers come together: y_out given, h_out is the caller's too (checked); else both new.
  const at::Tensor y = ck::out_or_new(y_out, "y", x.sizes(), x.options());
  if (h_out != nullptr)
    *h_out = ck::out_or_new(y_out != nullptr ? h_out : nullptr, "h", x.sizes(), x.options());
  const int64_t n = x.size(-1);
  cpu::RmsNormArgs a{d, n ? xc.numel() / n : 0, n, xc.data_ptr(),
                     residual ? rc.data_ptr() : nullptr, wc.data_ptr(), static_cast<float>(eps),
                     h_out ? h_out->data_ptr() : nullptr, y.data_ptr()};
  if (a.rows > 0) JACOBI_CPU_DISPATCH(rms_norm, a);
  return y;
}

}  // namespace

at::Tensor cpu_rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_into(x, nullptr, weight, eps, nullptr);
}

std::tuple<at::Tensor, at::Tensor> cpu_add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                    const at::Tensor& weight, double eps) {
  at::Tensor h;
  at::Tensor y = rms_norm_into(x, &residual, weight, eps, &h);
  return {h, y};
}

void cpu_add_rms_norm_out(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                          double eps, at::Tensor& h, at::Tensor& y) {
  rms_norm_into(x, &residual, weight, eps, &h, &y);
}

namespace {

// silu_and_mul into *out_ws where given (checked), else a new tensor.
at::Tensor silu_mul_impl(const at::Tensor& gu, at::Tensor* out_ws) {
  const LinearDType d = small_op_dtype(gu, "gu");
  TORCH_CHECK_VALUE(gu.device().is_cpu(), "gu must be on the CPU, got ", gu.device());
  TORCH_CHECK_VALUE(gu.dim() >= 1 && gu.size(-1) % 2 == 0,
                    "gu must be [..., 2 n] (gate then up), got ", gu.sizes());
  const at::Tensor c = gu.contiguous();
  c10::SmallVector<int64_t, 6> shape(gu.sizes().begin(), gu.sizes().end());
  const int64_t n = shape.back() /= 2;
  const at::Tensor out = ck::out_or_new(out_ws, "out", shape, gu.options());
  cpu::SiluMulArgs a{d, n ? out.numel() / n : 0, n, c.data_ptr(), out.data_ptr()};
  if (a.rows > 0) JACOBI_CPU_DISPATCH(silu_mul, a);
  return out;
}

}  // namespace

at::Tensor cpu_silu_mul(const at::Tensor& gu) { return silu_mul_impl(gu, nullptr); }

void qk_rms_norm_(at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& q_weight,
                  const at::Tensor& k_weight, double eps) {
  const LinearDType d = small_op_dtype(qkv, "qkv");
  TORCH_CHECK_VALUE(qkv.device().is_cpu(), "qkv must be on the CPU, got ", qkv.device());
  const int64_t D = ck::qk_norm_args(qkv, heads, kv_heads, q_weight, k_weight);
  const int64_t row = qkv.size(-1);
  const at::Tensor wq = q_weight.contiguous(), wk = k_weight.contiguous();
  cpu::QkRmsNormArgs a{d, row ? qkv.numel() / row : 0, row, heads, kv_heads, D,
                       qkv.data_ptr(), wq.data_ptr(), wk.data_ptr(), static_cast<float>(eps)};
  if (a.tokens > 0) JACOBI_CPU_DISPATCH(qk_rms_norm, a);
}

void cpu_silu_mul_out(const at::Tensor& gu, at::Tensor& out) { silu_mul_impl(gu, &out); }

namespace {

// cpu_rope_attention into *out_ws where given (checked: B Q heads D elements), else a new
// [B, Q, heads, D] tensor.
at::Tensor rope_attention_impl(const at::Tensor& qkv, int64_t heads, int64_t kv_heads,
                               const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                               at::Tensor& v_cache, const at::Tensor& slots, int64_t attend,
                               const at::Tensor& mask, double scale,
                               const std::optional<at::Tensor>& kt_cache, int64_t context_start,
                               at::Tensor* out_ws) {
  const LinearDType d = small_op_dtype(qkv, "qkv");
  ck::rank(qkv, "qkv", 3, "[B, Q, (heads + 2 kv_heads) * D]");
  ck::rank(k_cache, "k_cache", 4, "[B, kv_heads, capacity, D]");
  TORCH_CHECK_VALUE(heads >= 1 && kv_heads >= 1 && heads % kv_heads == 0, "heads (", heads,
                    ") must be a positive multiple of kv_heads (", kv_heads, ")");
  const int64_t B = qkv.size(0), Q = qkv.size(1), D = k_cache.size(3), cap = k_cache.size(2);
  TORCH_CHECK_VALUE(qkv.size(2) == (heads + 2 * kv_heads) * D, "qkv's last dim is ",
                    qkv.size(2), ", expected (heads + 2 kv_heads) * D = ",
                    (heads + 2 * kv_heads) * D);
  TORCH_CHECK_VALUE(D % 2 == 0 && D <= 512, "head dim must be even and <= 512, got ", D);
  const bool kv_half = half_kv(qkv, k_cache, v_cache, "qkv", "k_cache", "v_cache");
  for (auto [t, name] : {std::pair{&k_cache, "k_cache"}, {&v_cache, "v_cache"}}) {
    TORCH_CHECK_VALUE(t->sizes() == at::IntArrayRef({B, kv_heads, cap, D}), name, " must be [",
                      B, ", ", kv_heads, ", ", cap, ", ", D, "], got ", t->sizes());
    TORCH_CHECK_VALUE(t->is_contiguous() && t->device().is_cpu(), name,
                      " must be a contiguous CPU tensor");
  }
  for (auto [t, name] : {std::pair{&cos, "cos"}, {&sin, "sin"}}) {
    TORCH_CHECK_VALUE(t->numel() == B * Q * D && t->size(-1) == D, name, " must be [B, Q, D] = [",
                      B, ", ", Q, ", ", D, "], got ", t->sizes());
    TORCH_CHECK_VALUE(t->scalar_type() == qkv.scalar_type(), name, " must have qkv's dtype");
  }
  ck::dtype(slots, "slots", at::kLong);
  TORCH_CHECK_VALUE(slots.dim() == 1 && slots.size(0) >= Q, "slots must be [>= Q] int64");
  TORCH_CHECK_VALUE(attend >= 1 && attend <= cap, "attend must be in [1, capacity = ", cap,
                    "], got ", attend);
  TORCH_CHECK_VALUE(context_start >= 0 && context_start <= attend,
                    "context_start must be in [0, attend = ", attend, "], got ", context_start);
  ck::dtype(mask, "mask", at::kBool);
  TORCH_CHECK_VALUE(mask.dim() == 4 && mask.size(0) == B && mask.size(1) == 1 &&
                        mask.size(2) == Q && mask.size(3) == attend,
                    "mask must be [B, 1, Q, attend] = [", B, ", 1, ", Q, ", ", attend, "], got ",
                    mask.sizes());
  const at::Tensor sl = slots.contiguous();
  const int64_t* sp = sl.data_ptr<int64_t>();
  for (int64_t i = 0; i < Q; ++i)
    TORCH_CHECK_VALUE(sp[i] >= 0 && sp[i] < cap, "slots[", i, "] = ", sp[i],
                      " is outside the cache [0, ", cap, ")");
  void* kt = nullptr;
  int64_t kt_ld = 0;
  if (kt_cache.has_value()) {
    const at::Tensor& t = *kt_cache;
    const auto want = kv_half ? at::kHalf : at::kFloat;  // a half cache's keys stay half
    TORCH_CHECK_VALUE(t.scalar_type() == want && t.is_contiguous() && t.device().is_cpu() &&
                          t.dim() == 5 && t.size(0) == B && t.size(1) == kv_heads &&
                          t.size(2) * cpu::kKeyPad >= cap && t.size(3) == D &&
                          t.size(4) == cpu::kKeyPad,
                      "kt_cache must be a contiguous ", want, " CPU tensor [B, kv_heads, L / ",
                      cpu::kKeyPad, ", D, ", cpu::kKeyPad, "] = [", B, ", ", kv_heads, ", L / ",
                      cpu::kKeyPad, ", ", D, ", ", cpu::kKeyPad, "] with L >= capacity (", cap,
                      ") (jacobi_ext.decoding.lean.keys_transposed makes one), got ",
                      t.scalar_type(), " ", t.sizes());
    kt = t.data_ptr();
    kt_ld = t.size(2) * cpu::kKeyPad;
  }
  const at::Tensor qc = qkv.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  const at::Tensor mc = mask.contiguous();
  const at::Tensor out = ck::out_or_new(out_ws, "out", {B, Q, heads, D}, qkv.options());
  if (out.numel() == 0) return out;
  const int64_t threads = at::get_num_threads();
  float* scratch = attention_scratch(
      cpu::decode_attention_scratch_floats(B, kv_heads, heads, Q, attend, D, threads));
  cpu::RopeAttnArgs a{d, B, heads, kv_heads, Q, D, qc.data_ptr(), cc.data_ptr(), sc.data_ptr(),
                      k_cache.data_ptr(), v_cache.data_ptr(), cap, sp, attend,
                      mc.data_ptr<bool>(), static_cast<float>(scale), out.data_ptr(),
                      scratch, kt, kt_ld, context_start, kv_half};
  JACOBI_CPU_DISPATCH(rope_attention, a);
  return out;
}

}  // namespace

at::Tensor cpu_rope_attention(const at::Tensor& qkv, int64_t heads, int64_t kv_heads,
                              const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                              at::Tensor& v_cache, const at::Tensor& slots, int64_t attend,
                              const at::Tensor& mask, double scale,
                              const std::optional<at::Tensor>& kt_cache,
                              int64_t context_start) {
  return rope_attention_impl(qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slots, attend,
                             mask, scale, kt_cache, context_start, nullptr);
}

void cpu_rope_attention_out(const at::Tensor& qkv, int64_t heads, int64_t kv_heads,
                            const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                            at::Tensor& v_cache, const at::Tensor& slots, int64_t attend,
                            const at::Tensor& mask, double scale,
                            const std::optional<at::Tensor>& kt_cache, int64_t context_start,
                            at::Tensor& out) {
  rope_attention_impl(qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slots, attend, mask,
                      scale, kt_cache, context_start, &out);
}

namespace {

// Slots [s[b], s[b] + c[b]) -> [d[b], ...) of transposed keys t [B, H, L / 16, D, 16] (elements E
// at base: cpu_rope_attention's kt_cache): slot x is element x % 16 of row f of block x / 16.
// The ranges may overlap: copied in the direction a memmove would (forward when moving down,
// backward when moving up), so each slot is read before it is overwritten.
template <typename E>
void move_transposed(E* base, const at::Tensor& t, int64_t B, const int64_t* s, const int64_t* d,
                     const int64_t* c) {
  const int64_t H = t.size(1), L = t.size(2) * cpu::kKeyPad, D = t.size(3);
  for (int64_t b = 0; b < B; ++b) {
    if (!decode::commit_moves(s[b], d[b], c[b])) continue;
    for (int64_t h = 0; h < H; ++h) {
      E* head = base + (b * H + h) * L * D;
      auto at = [&](int64_t slot, int64_t f) {
        return head + cpu::kt_slot(slot, D) + f * cpu::kKeyPad;
      };
      for (int64_t n = 0; n < c[b]; ++n) {
        const int64_t x = decode::commit_nth(n, s[b], d[b], c[b]);
        for (int64_t f = 0; f < D; ++f) *at(d[b] + x, f) = *at(s[b] + x, f);
      }
    }
  }
}

void cpu_kv_commit(at::TensorList caches, const at::Tensor& src, const at::Tensor& dst,
                   const at::Tensor& count, at::TensorList transposed) {
  for (auto [t, name] : {std::pair{&src, "src"}, {&dst, "dst"}, {&count, "count"}}) {
    ck::dtype(*t, name, at::kLong);
    TORCH_CHECK_VALUE(t->dim() == 1, name, " must be [B] int64, got ", t->sizes());
  }
  const int64_t B = src.size(0);
  TORCH_CHECK_VALUE(dst.size(0) == B && count.size(0) == B, "src, dst and count must be [B], got ",
                    src.sizes(), ", ", dst.sizes(), ", ", count.sizes());
  const at::Tensor sc = src.contiguous(), dc = dst.contiguous(), cc = count.contiguous();
  const int64_t *s = sc.data_ptr<int64_t>(), *d = dc.data_ptr<int64_t>(), *c = cc.data_ptr<int64_t>();
  for (const at::Tensor& t : caches) {
    TORCH_CHECK_VALUE(t.dim() == 4 && t.size(0) == B && t.is_contiguous() && t.device().is_cpu(),
                      "each cache must be a contiguous CPU tensor [B = ", B,
                      ", H, capacity, D], got ", t.sizes());
    const int64_t cap = t.size(2);
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK_VALUE(decode::commit_fits(s[b], d[b], c[b], cap),
                        "sequence ", b, ": slots [", s[b], ", ", s[b] + c[b], ") -> [", d[b], ", ",
                        d[b] + c[b], ") are outside the cache [0, ", cap, ")");
    }
  }
  for (const at::Tensor& t : transposed) {
    TORCH_CHECK_VALUE(t.dim() == 5 && t.size(0) == B && t.size(4) == cpu::kKeyPad &&
                          (t.scalar_type() == at::kFloat || t.scalar_type() == at::kHalf) &&
                          t.is_contiguous() && t.device().is_cpu(),
                      "each transposed cache must be a contiguous float32 (or float16: a half "
                      "K/V cache) CPU tensor [B = ", B,
                      ", H, slots / ", cpu::kKeyPad, ", D, ", cpu::kKeyPad, "], got ",
                      t.scalar_type(), " ", t.sizes());
    const int64_t L = t.size(2) * cpu::kKeyPad;
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK_VALUE(s[b] + c[b] <= L && d[b] + c[b] <= L, "sequence ", b, ": slots [", s[b],
                        ", ", s[b] + c[b], ") -> [", d[b], ", ", d[b] + c[b],
                        ") are outside the transposed cache [0, ", L, ")");
    }
  }
  // Checked above; the copies of the tensors (one layer's keys, values, transposed keys each)
  // are independent: threads take whole tensors (a step's slots are few: the time is the cache
  // misses of ~60 small scattered copies, ~0.25 ms a step on one thread).
  const int64_t nc = static_cast<int64_t>(caches.size());
  at::parallel_for(0, nc + static_cast<int64_t>(transposed.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      if (i < nc) {
        const at::Tensor& t = caches[i];
        const int64_t H = t.size(1), cap = t.size(2), row = t.size(3) * t.element_size();
        auto* base = static_cast<char*>(t.data_ptr());
        for (int64_t b = 0; b < B; ++b) {
          if (!decode::commit_moves(s[b], d[b], c[b])) continue;
          for (int64_t h = 0; h < H; ++h) {
            char* head = base + (b * H + h) * cap * row;
            std::memmove(head + d[b] * row, head + s[b] * row, static_cast<size_t>(c[b] * row));
          }
        }
        continue;
      }
      // Transposed copies (cpu_rope_attention's kt_cache), fp32 or fp16 (copied as bits).
      const at::Tensor& t = transposed[i - nc];
      if (t.scalar_type() == at::kHalf) {
        move_transposed(static_cast<uint16_t*>(t.data_ptr()), t, B, s, d, c);
      } else {
        move_transposed(t.data_ptr<float>(), t, B, s, d, c);
      }
    }
  });
}

// The step plan's mask [B, Q, width] (bool, contiguous) by jacobi/decode_step.h's rule.
void fill_step_mask(const int64_t* sg, const int64_t* of, const int64_t* l, const int64_t* h,
                    int64_t B, int64_t Q, int64_t width, bool* m) {
  for (int64_t b = 0; b < B; ++b) {
    const int64_t* sb = sg + b * Q;
    const int64_t* ob = of + b * Q;
    for (int64_t i = 0; i < Q; ++i) {
      bool* row = m + (b * Q + i) * width;
      for (int64_t j = 0; j < width; ++j)
        row[j] = decode::step_sees_committed(sb[i], j, l[b], h[b]);
      for (int64_t j = 0; j < Q; ++j)
        row[j] = row[j] || decode::step_sees_scratch(sb[i], ob[i], sb[j], ob[j], j == i);
    }
  }
}

// masks.step_mask's rule, element by element: query i (row seg[b, i], offset off[b, i]; seg < 0:
// padding) sees committed slot j (lo[b] <= j < hi[b]) if it is real; among the scratch slots
// j < Q it also sees the tokens of its own row at offsets <= its own (both real), and a padding
// query sees its own slot only.
at::Tensor cpu_step_mask(const at::Tensor& seg, const at::Tensor& off, const at::Tensor& lo,
                         const at::Tensor& hi, int64_t width) {
  for (auto [t, name] : {std::pair{&seg, "seg"}, {&off, "off"}, {&lo, "lo"}, {&hi, "hi"}}) {
    ck::dtype(*t, name, at::kLong);
  }
  ck::rank(seg, "seg", 2, "[B, Q]");
  const int64_t B = seg.size(0), Q = seg.size(1);
  TORCH_CHECK_VALUE(off.sizes() == seg.sizes(), "off must be [B, Q] like seg ", seg.sizes(),
                    ", got ", off.sizes());
  TORCH_CHECK_VALUE(lo.dim() == 1 && lo.size(0) == B && hi.dim() == 1 && hi.size(0) == B,
                    "lo and hi must be [B = ", B, "], got ", lo.sizes(), ", ", hi.sizes());
  TORCH_CHECK_VALUE(width >= Q, "width (", width, ") must cover the step's ", Q,
                    " scratch slots");
  const at::Tensor sc = seg.contiguous(), oc = off.contiguous(), lc = lo.contiguous(),
                   hc = hi.contiguous();
  const int64_t *sg = sc.data_ptr<int64_t>(), *of = oc.data_ptr<int64_t>(),
                *l = lc.data_ptr<int64_t>(), *h = hc.data_ptr<int64_t>();
  at::Tensor mask = at::empty({B, 1, Q, width}, seg.options().dtype(at::kBool));
  fill_step_mask(sg, of, l, h, B, Q, width, mask.data_ptr<bool>());
  return mask;
}

// rope_attention on a CPU: the step plan's mask made here (fill_step_mask, over the
// slots up to the longest sequence's end), query i's K/V written to scratch slot i, then
// cpu_rope_attention: the CUDA kernel's twin (which reads the plan itself, no mask built).
at::Tensor decode_rope_attention_cpu(const at::Tensor& qkv, int64_t heads, int64_t kv_heads,
                                     const at::Tensor& cos, const at::Tensor& sin,
                                     at::Tensor& k_cache, at::Tensor& v_cache,
                                     const at::Tensor& seg, const at::Tensor& off,
                                     const at::Tensor& lo, const at::Tensor& hi, double scale) {
  ck::rank(qkv, "qkv", 3, "[B, Q, (heads + 2 kv_heads) * D]");
  ck::rank(k_cache, "k_cache", 4, "[B, kv_heads, capacity, D]");
  const int64_t B = qkv.size(0), Q = qkv.size(1), cap = k_cache.size(2);
  for (auto [t, name] : {std::pair{&seg, "seg"}, {&off, "off"}, {&lo, "lo"}, {&hi, "hi"}}) {
    ck::dtype(*t, name, at::kLong);
    TORCH_CHECK_VALUE(t->device().is_cpu(), name, " must be on the CPU, got ", t->device());
  }
  TORCH_CHECK_VALUE(seg.dim() == 2 && seg.size(0) == B && seg.size(1) == Q &&
                        off.sizes() == seg.sizes(),
                    "seg and off must be [B, Q] = [", B, ", ", Q, "], got ", seg.sizes(), " and ",
                    off.sizes());
  TORCH_CHECK_VALUE(lo.dim() == 1 && lo.size(0) == B && hi.dim() == 1 && hi.size(0) == B,
                    "lo and hi must be [B = ", B, "], got ", lo.sizes(), ", ", hi.sizes());
  TORCH_CHECK_VALUE(Q <= cap, "the step's ", Q, " tokens do not fit the cache's ", cap,
                    " slots");
  const at::Tensor sc = seg.contiguous(), oc = off.contiguous(), lc = lo.contiguous(),
                   hc = hi.contiguous();
  const int64_t *sg = sc.data_ptr<int64_t>(), *of = oc.data_ptr<int64_t>(),
                *l = lc.data_ptr<int64_t>(), *h = hc.data_ptr<int64_t>();
  int64_t width = std::max<int64_t>(Q, 1);
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK_VALUE(l[b] >= Q && l[b] <= h[b] && h[b] <= cap, "sequence ", b,
                      ": committed slots [", l[b], ", ", h[b], ") must lie in [Q = ", Q,
                      ", capacity = ", cap, ")");
    width = std::max(width, h[b]);
  }
  at::Tensor mask = at::empty({B, 1, Q, width}, seg.options().dtype(at::kBool));
  fill_step_mask(sg, of, l, h, B, Q, width, mask.data_ptr<bool>());
  const at::Tensor slots = at::arange(std::max<int64_t>(Q, 1), seg.options());
  return cpu_rope_attention(qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slots, width,
                            mask, scale, std::nullopt, 0);
}

// The registered out= forms (module.cpp: "*.out"), over the *_out functions above.

std::tuple<at::Tensor&, at::Tensor&> add_rms_norm_out_op(const at::Tensor& x,
                                                          const at::Tensor& residual,
                                                          const at::Tensor& weight, double eps,
                                                          at::Tensor& h, at::Tensor& y) {
  cpu_add_rms_norm_out(x, residual, weight, eps, h, y);
  return {h, y};
}

at::Tensor& silu_mul_out_op(const at::Tensor& gu, at::Tensor& out) {
  cpu_silu_mul_out(gu, out);
  return out;
}

at::Tensor& rope_attention_out_op(const at::Tensor& qkv, int64_t heads, int64_t kv_heads,
                                  const at::Tensor& cos, const at::Tensor& sin,
                                  at::Tensor& k_cache, at::Tensor& v_cache,
                                  const at::Tensor& slots, int64_t attend, const at::Tensor& mask,
                                  double scale, const std::optional<at::Tensor>& kt_cache,
                                  int64_t context_start, at::Tensor& out) {
  cpu_rope_attention_out(qkv, heads, kv_heads, cos, sin, k_cache, v_cache, slots, attend, mask,
                         scale, kt_cache, context_start, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(jacobi_ext, CPU, m) {
  m.impl("fused_add_rms_norm.out", &add_rms_norm_out_op);
  m.impl("silu_and_mul.out", &silu_mul_out_op);
  m.impl("cpu_rope_attention.out", &rope_attention_out_op);
  m.impl("kv_commit", &cpu_kv_commit);
  m.impl("cpu_step_mask", &cpu_step_mask);
  m.impl("cpu_decode_attention", &cpu_decode_attention);
  m.impl("rms_norm", &cpu_rms_norm);
  m.impl("fused_add_rms_norm", &cpu_add_rms_norm);
  m.impl("silu_and_mul", &cpu_silu_mul);
  m.impl("qk_rms_norm_", &qk_rms_norm_);
  m.impl("cpu_rope_attention", &cpu_rope_attention);
  m.impl("rope_attention", &decode_rope_attention_cpu);
}

}  // namespace jacobi::ops

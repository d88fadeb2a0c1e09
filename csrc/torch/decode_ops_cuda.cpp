// The CUDA implementations of the fused decode-step ops (kernels: csrc/cuda/decode_cuda.cu),
// under the same op names and schemas as their CPU twins (decode_ops.cpp, sampling_ops.cpp),
// so that the lean forward calls one op on either device: rms_norm, fused_add_rms_norm,
// silu_and_mul, qk_rms_norm_, kv_commit, argmax and rope_attention.
// Argument checks read shapes, dtypes and devices only: no device value is read on the host, so
// a step made of these ops is capturable in a CUDA graph.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <tuple>
#include <vector>

#include "checks.h"
#include "cuda/decode_cuda.h"
#include "cuda_launch.h"

namespace jacobi::ops {
namespace {

namespace ck = jacobi::checks;
using jacobi::cuda::DecodeDType;

DecodeDType decode_dtype(const at::Tensor& t, const char* name) {
  if (t.scalar_type() == at::kFloat) return DecodeDType::kFloat32;
  if (t.scalar_type() == at::kBFloat16) return DecodeDType::kBFloat16;
  TORCH_CHECK_VALUE(false, name, " must be float32 or bfloat16, got ", t.scalar_type());
}

// The tensor that decides the device: a CUDA tensor (the dispatcher may route here a call whose
// other tensors are on the CPU; the guard below needs a CUDA device).
const at::Tensor& cuda_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK_VALUE(t.is_cuda(), name, " must be a CUDA tensor, got one on ", t.device());
  return t;
}

void on_device(const at::Tensor& t, const char* name, const at::Tensor& ref) {
  TORCH_CHECK_VALUE(t.device() == ref.device(), name, " must be on ", ref.device(), ", got ",
                    t.device());
}

at::Tensor rms_norm_cuda(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight,
                         double eps, at::Tensor* h_out) {
  c10::cuda::CUDAGuard guard(cuda_tensor(x, "x").device());
  const DecodeDType d = decode_dtype(x, "x");
  ck::rank(weight, "weight", 1, "[features]");
  on_device(weight, "weight", x);
  TORCH_CHECK_VALUE(weight.scalar_type() == x.scalar_type(), "weight has dtype ",
                    weight.scalar_type(), ", x has ", x.scalar_type());
  TORCH_CHECK_VALUE(x.dim() >= 1 && weight.size(0) == x.size(-1), "weight has ", weight.size(0),
                    " features, x's last dim ", x.dim() ? x.size(-1) : 0);
  at::Tensor rc;
  if (residual != nullptr) {
    TORCH_CHECK_VALUE(residual->sizes() == x.sizes() && residual->scalar_type() == x.scalar_type(),
                      "residual must have x's shape ", x.sizes(), " and dtype ", x.scalar_type(),
                      ", got ", residual->sizes(), " ", residual->scalar_type());
    on_device(*residual, "residual", x);
    rc = residual->contiguous();
  }
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (h_out != nullptr) *h_out = at::empty(x.sizes(), x.options());
  const int64_t n = x.size(-1);
  jacobi::cuda::RmsNormLaunch a{d, n ? xc.numel() / n : 0, n, xc.data_ptr(),
                                residual ? rc.data_ptr() : nullptr, wc.data_ptr(),
                                static_cast<float>(eps), h_out ? h_out->data_ptr() : nullptr,
                                y.data_ptr()};
  check_launch("rms_norm", jacobi::cuda::rms_norm(a, current_stream()));
  return y;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return rms_norm_cuda(x, nullptr, weight, eps, nullptr);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
  at::Tensor h;
  at::Tensor y = rms_norm_cuda(x, &residual, weight, eps, &h);
  return {h, y};
}

at::Tensor silu_mul(const at::Tensor& gu) {
  c10::cuda::CUDAGuard guard(cuda_tensor(gu, "gu").device());
  const DecodeDType d = decode_dtype(gu, "gu");
  TORCH_CHECK_VALUE(gu.dim() >= 1 && gu.size(-1) % 2 == 0,
                    "gu must be [..., 2 n] (gate then up), got ", gu.sizes());
  const at::Tensor c = gu.contiguous();
  std::vector<int64_t> shape(gu.sizes().begin(), gu.sizes().end());
  const int64_t n = shape.back() / 2;
  shape.back() = n;
  at::Tensor out = at::empty(shape, gu.options());
  check_launch("silu_and_mul", jacobi::cuda::silu_mul(d, n ? out.numel() / n : 0, n, c.data_ptr(),
                                                      out.data_ptr(), current_stream()));
  return out;
}

void qk_rms_norm_(at::Tensor& qkv, int64_t heads, int64_t kv_heads, const at::Tensor& q_weight,
                  const at::Tensor& k_weight, double eps) {
  c10::cuda::CUDAGuard guard(cuda_tensor(qkv, "qkv").device());
  const DecodeDType d = decode_dtype(qkv, "qkv");
  const int64_t D = ck::qk_norm_args(qkv, heads, kv_heads, q_weight, k_weight);
  const int64_t row = qkv.size(-1);
  const at::Tensor wq = q_weight.contiguous(), wk = k_weight.contiguous();
  jacobi::cuda::QkRmsNormLaunch a{d, row ? qkv.numel() / row : 0, row, heads, kv_heads, D,
                                  qkv.data_ptr(), wq.data_ptr(), wk.data_ptr(),
                                  static_cast<float>(eps)};
  check_launch("qk_rms_norm_", jacobi::cuda::qk_rms_norm(a, current_stream()));
}

at::Tensor decode_rope_attention(const at::Tensor& qkv, int64_t heads, int64_t kv_heads,
                                 const at::Tensor& cos, const at::Tensor& sin,
                                 at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& seg,
                                 const at::Tensor& off, const at::Tensor& lo,
                                 const at::Tensor& hi, double scale) {
  c10::cuda::CUDAGuard guard(cuda_tensor(qkv, "qkv").device());
  const DecodeDType d = decode_dtype(qkv, "qkv");
  ck::rank(qkv, "qkv", 3, "[B, Q, (heads + 2 kv_heads) * D]");
  ck::rank(k_cache, "k_cache", 4, "[B, kv_heads, capacity, D]");
  TORCH_CHECK_VALUE(heads >= 1 && kv_heads >= 1 && heads % kv_heads == 0, "heads (", heads,
                    ") must be a positive multiple of kv_heads (", kv_heads, ")");
  const int64_t B = qkv.size(0), Q = qkv.size(1), D = k_cache.size(3), cap = k_cache.size(2);
  TORCH_CHECK_VALUE(jacobi::cuda::decode_attention_head_dim_ok(D),
                    "rope_attention on CUDA takes head dims 64 and 128, got ", D);
  TORCH_CHECK_VALUE(qkv.size(2) == (heads + 2 * kv_heads) * D, "qkv's last dim is ",
                    qkv.size(2), ", expected (heads + 2 kv_heads) * D = ",
                    (heads + 2 * kv_heads) * D);
  TORCH_CHECK_VALUE(Q <= cap, "the step's ", Q, " tokens do not fit the cache's ", cap,
                    " slots");
  for (auto [t, name] : {std::pair{&k_cache, "k_cache"}, {&v_cache, "v_cache"}}) {
    TORCH_CHECK_VALUE(t->sizes() == at::IntArrayRef({B, kv_heads, cap, D}), name, " must be [",
                      B, ", ", kv_heads, ", ", cap, ", ", D, "], got ", t->sizes());
    TORCH_CHECK_VALUE(t->is_contiguous() && t->scalar_type() == qkv.scalar_type(), name,
                      " must be contiguous with qkv's dtype ", qkv.scalar_type());
    // (the kernel reads committed rows 16 bytes a load: D * element size is a multiple of 16)
    TORCH_CHECK_VALUE(reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0, name,
                      " must start at a 16-byte aligned address (a cache the runtime allocates "
                      "does; a view into the middle of a buffer may not)");
    on_device(*t, name, qkv);
  }
  for (auto [t, name] : {std::pair{&cos, "cos"}, {&sin, "sin"}}) {
    TORCH_CHECK_VALUE(t->numel() == B * Q * D && t->size(-1) == D, name, " must be [B, Q, D] = [",
                      B, ", ", Q, ", ", D, "], got ", t->sizes());
    TORCH_CHECK_VALUE(t->scalar_type() == qkv.scalar_type(), name, " must have qkv's dtype");
    on_device(*t, name, qkv);
  }
  for (auto [t, name] : {std::pair{&seg, "seg"}, {&off, "off"}}) {
    ck::dtype(*t, name, at::kLong);
    TORCH_CHECK_VALUE(t->dim() == 2 && t->size(0) == B && t->size(1) == Q && t->stride(1) == 1,
                      name, " must be [B, Q] = [", B, ", ", Q,
                      "] int64 with contiguous rows, got ", t->sizes());
    on_device(*t, name, qkv);
  }
  for (auto [t, name] : {std::pair{&lo, "lo"}, {&hi, "hi"}}) {
    ck::dtype(*t, name, at::kLong);
    TORCH_CHECK_VALUE(t->dim() == 1 && t->size(0) == B, name, " must be [B = ", B, "], got ",
                      t->sizes());
    on_device(*t, name, qkv);
  }
  const at::Tensor qc = qkv.contiguous(), cc = cos.contiguous(), sc = sin.contiguous();
  const at::Tensor lc = lo.contiguous(), hc = hi.contiguous();
  at::Tensor out = at::empty({B, Q, heads, D}, qkv.options());
  if (out.numel() == 0) return out;
  const int64_t splits = jacobi::cuda::decode_attention_splits(cap, Q);
  const int64_t rows = B * Q * heads;
  // The split partials: sizes fixed by the shapes, so a graph's replays reuse its allocation.
  at::Tensor partial_out = at::empty({splits, rows, D}, qkv.options().dtype(at::kFloat));
  at::Tensor partial_stats = at::empty({splits, rows, 2}, qkv.options().dtype(at::kFloat));
  jacobi::cuda::RopeAttentionLaunch a{};
  a.dtype = d;
  a.B = B, a.Hq = heads, a.Hkv = kv_heads, a.Q = Q, a.D = D, a.capacity = cap;
  a.qkv = qc.data_ptr(), a.cos = cc.data_ptr(), a.sin = sc.data_ptr();
  a.k_cache = k_cache.data_ptr(), a.v_cache = v_cache.data_ptr();
  a.seg = seg.data_ptr<int64_t>(), a.off = off.data_ptr<int64_t>();
  a.seg_stride = seg.stride(0), a.off_stride = off.stride(0);
  a.lo = lc.data_ptr<int64_t>(), a.hi = hc.data_ptr<int64_t>();
  a.scale = static_cast<float>(scale);
  a.splits = splits;
  a.partial_out = partial_out.data_ptr<float>();
  a.partial_stats = partial_stats.data_ptr<float>();
  a.out = out.data_ptr();
  check_launch("rope_attention", jacobi::cuda::rope_attention(a, current_stream()));
  return out;
}

// argmax's CUDA twin: the same pick (jacobi/decode_step.h: greedy_better), one block a row.
at::Tensor argmax(const at::Tensor& logits) {
  c10::cuda::CUDAGuard guard(cuda_tensor(logits, "logits").device());
  TORCH_CHECK_VALUE(logits.dim() >= 1 && logits.size(-1) >= 1,
                    "logits must be [..., vocab] with vocab >= 1, got shape ", logits.sizes());
  using jacobi::cuda::LogitsDType;
  LogitsDType type;
  switch (logits.scalar_type()) {
    case at::kFloat: type = LogitsDType::kFloat32; break;
    case at::kBFloat16: type = LogitsDType::kBFloat16; break;
    case at::kHalf: type = LogitsDType::kFloat16; break;
    case at::kDouble: type = LogitsDType::kFloat64; break;
    default:
      TORCH_CHECK_VALUE(false, "logits must be float32, bfloat16, float16 or float64, got ",
                        logits.scalar_type());
  }
  const int64_t V = logits.size(-1), rows = logits.numel() / V;
  std::vector<int64_t> shape(logits.sizes().begin(), logits.sizes().end() - 1);
  at::Tensor out = at::empty(shape, logits.options().dtype(at::kLong));
  if (rows == 0) return out;
  const at::Tensor x = logits.contiguous();
  check_launch("argmax", jacobi::cuda::argmax(type, x.data_ptr(), rows, V, out.data_ptr<int64_t>(),
                                              current_stream()));
  return out;
}

void kv_commit(at::TensorList caches, const at::Tensor& src, const at::Tensor& dst,
               const at::Tensor& count, at::TensorList transposed) {
  TORCH_CHECK_VALUE(transposed.empty(),
                    "kv_commit on CUDA moves [B, H, capacity, D] caches only; transposed "
                    "keys are a CPU layout (got ", transposed.size(), ")");
  if (caches.empty()) return;
  const at::Tensor& ref = cuda_tensor(caches[0], "caches[0]");
  c10::cuda::CUDAGuard guard(ref.device());
  for (auto [t, name] : {std::pair{&src, "src"}, {&dst, "dst"}, {&count, "count"}}) {
    ck::dtype(*t, name, at::kLong);
    TORCH_CHECK_VALUE(t->dim() == 1, name, " must be [B] int64, got ", t->sizes());
    on_device(*t, name, ref);
  }
  const int64_t B = src.size(0);
  TORCH_CHECK_VALUE(dst.size(0) == B && count.size(0) == B, "src, dst and count must be [B], got ",
                    src.sizes(), ", ", dst.sizes(), ", ", count.sizes());
  for (const at::Tensor& t : caches) {
    TORCH_CHECK_VALUE(t.dim() == 4 && t.size(0) == B && t.is_contiguous() &&
                          t.device() == ref.device(),
                      "each cache must be a contiguous tensor [B = ", B, ", H, capacity, D] on ",
                      ref.device(), ", got ", t.sizes(), " on ", t.device());
    TORCH_CHECK_VALUE(t.size(3) * t.element_size() % 2 == 0,
                      "a cache slot must be a multiple of 2 bytes, got ",
                      t.size(3) * t.element_size());
  }
  const at::Tensor sc = src.contiguous(), dc = dst.contiguous(), cc = count.contiguous();
  // One launch per run of caches of one shape and element size (a model's layers: one launch
  // for all of them), at most kCommitMaxCaches each.
  const int64_t total = static_cast<int64_t>(caches.size());
  for (int64_t i0 = 0; i0 < total;) {
    const at::Tensor& first = caches[i0];
    jacobi::cuda::KvCommitLaunch a{};
    a.B = B, a.H = first.size(1), a.capacity = first.size(2);
    a.row_bytes = first.size(3) * first.element_size();
    a.src = sc.data_ptr<int64_t>(), a.dst = dc.data_ptr<int64_t>(), a.n = cc.data_ptr<int64_t>();
    a.count = 0;
    while (i0 < total && a.count < jacobi::cuda::kCommitMaxCaches &&
           caches[i0].sizes() == first.sizes() &&
           caches[i0].element_size() == first.element_size()) {
      a.caches[a.count++] = caches[i0++].data_ptr();
    }
    check_launch("kv_commit", jacobi::cuda::kv_commit(a, current_stream()));
  }
}

}  // namespace

TORCH_LIBRARY_IMPL(jacobi_ext, CUDA, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("fused_add_rms_norm", &add_rms_norm);
  m.impl("silu_and_mul", &silu_mul);
  m.impl("qk_rms_norm_", &qk_rms_norm_);
  m.impl("kv_commit", &kv_commit);
  m.impl("argmax", &argmax);
  m.impl("rope_attention", &decode_rope_attention);
}

}  // namespace jacobi::ops
